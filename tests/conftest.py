"""Shared fixtures: the tiny checkpoints (built once, cached on disk) and the Hypothesis profiles."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import Phase, settings

# Without a GPU the Triton kernels run under Triton's interpreter on the CPU (set before any kernel module is
# imported: `triton.jit` reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1" and not os.environ.get("INFER_TRITON_INTERPRETER_AS_IS"):
    from tests.triton_interpreter import skip_nested_language_patching

    skip_nested_language_patching()

import infer
import reference
from infer.cache.paged import PagedKVPool
from reference import build_checkpoint
from tests.helpers import TEST_DEVICE

# INFER_TEST_DEVICE=cuda (tests/gpu_check.py sets it): every model, cache and oracle a test makes without
# naming a device is made there, so the oracle suites (properties, conformance, engine, sampling, stopping,
# chat) hold the CUDA path to Hugging Face as they hold the CPU path. The defaults of the factories are
# switched, nothing else: a test that names "cpu" stays on the CPU.
if TEST_DEVICE != "cpu":
    if not torch.device(TEST_DEVICE).type == "cuda" or not torch.cuda.is_available():
        raise pytest.UsageError(f"INFER_TEST_DEVICE={TEST_DEVICE}: only 'cpu' or an available CUDA device")
    # fp32 is compared with the oracle at 1e-5: no TF32 anywhere.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for factory in (infer.load_model, infer.create_cache, PagedKVPool.__init__, reference.Oracle.__init__):
        defaults = factory.__kwdefaults__ or {}
        if "device" not in defaults:
            raise pytest.UsageError(f"{factory.__qualname__} has no keyword-only `device` to switch")
        defaults["device"] = TEST_DEVICE

    # Token ids a test builds on the CPU go to the model's device when the test itself calls the model; ids
    # the library passes are left alone, so a library path that feeds CPU ids to a CUDA model still fails (and
    # so are ids a test puts on another device on purpose, such as "meta").
    module_call = infer.Transformer.__call__

    def call_from_tests(self: infer.Transformer, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("tests.") and isinstance(input_ids, torch.Tensor) and input_ids.device.type == "cpu":
            input_ids = input_ids.to(self.embed_tokens.weight.device)
        return module_call(self, input_ids, *args, **kwargs)

    infer.Transformer.__call__ = call_from_tests  # type: ignore[method-assign]

# One intra-op thread per test process: the models are tiny, and with xdist workers (or other load) on few
# cores, OpenMP threads waiting on each other made a 5 ms forward take 500 ms.
torch.set_num_threads(1)

# A forward pass takes longer than Hypothesis' default 200 ms deadline, so no profile has one.
settings.register_profile("dev", deadline=None, max_examples=20)
settings.register_profile("thorough", deadline=None, max_examples=200)
settings.register_profile("ci", derandomize=True, deadline=None, database=None, max_examples=20, print_blob=True)
# tests/mutation_check.py's runs: a planted bug needs a failing example, not the smallest one (shrinking took 3-4 of
# the 4-5 minutes of each planted bug in the whole-step properties, every example two engines)
settings.register_profile("mutants", deadline=None, database=None, max_examples=20,
                          phases=(Phase.explicit, Phase.reuse, Phase.generate))
settings.load_profile(os.environ.get("INFER_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(scope="session")
def checkpoint_dir() -> Callable[..., Path]:
    """build_checkpoint itself: call it with (arch, config_format=..., seed=..., **overrides)."""

    def build(arch: str, **kwargs: Any) -> Path:
        return build_checkpoint(arch, **kwargs)

    return build


@pytest.fixture(scope="session")
def llama_dir() -> Path:
    return build_checkpoint("llama")


@pytest.fixture(scope="session")
def qwen3_dir() -> Path:
    return build_checkpoint("qwen3")


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    return build_checkpoint("gemma3_text")
