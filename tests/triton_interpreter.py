"""A shortcut for Triton's CPU interpreter (TRITON_INTERPRET=1), which runs every Triton test here without a GPU.

Triton 3.9's interpreter patches `triton.language` for interpretation when a kernel launches and undoes it when
the launch ends, but also patches it again at every call of a nested `@triton.jit` helper inside the kernel (and
never undoes those): ~3 ms of `inspect.getmembers` over the language modules a call. The paged kernels call
helpers once per block a program reads, so that was half of an interpreted decode step (134 s of the engine's
property test on a 2-core Zen 3 EPYC, 68 s of it re-patching). Inside a launch the language is already patched,
so a helper's call skips it here; kernels compute the same, only the interpreter's bookkeeping is skipped.
Applied only where the interpreter has the functions this replaces; otherwise nothing changes.
`INFER_TRITON_INTERPRETER_AS_IS=1` leaves the interpreter as it is (tests/conftest.py)."""

from __future__ import annotations

from typing import Any


def skip_nested_language_patching() -> bool:
    """Install the shortcut; False (and nothing changed) where this Triton's interpreter differs."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_class = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or scope_class is None or getattr(patch_lang, "_skips_nested", False):
        return False
    from triton import language as tl

    patched: set[int] = set()  # the language modules (triton.language, its core) the running launch patched

    def languages(fn: Any) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_once(fn: Any) -> Any:
        seen = languages(fn)
        if patched and seen <= patched:  # a helper inside a running launch: its language is patched already
            return scope_class()
        scope = patch_lang(fn)  # a launch, or a helper reading another module (tl.zeros reads triton.language.core)
        if not patched:  # a launch: its scope ends with it
            restore = scope.restore

            def restore_and_end() -> None:
                patched.clear()
                restore()

            scope.restore = restore_and_end
        patched.update(seen)
        return scope

    patch_once._skips_nested = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_once
    return True
