"""Peak memory of one bench contender, measured alone in a fresh process.

In the bench's own process every contender's weights are loaded side by side, so the process-wide peak
says nothing about any one of them. Here a child process imports torch (its baseline), loads only that
contender (the engine, or a contender plugin by entry point) and runs one generation of the same prompt;
its peak resident set (VmHWM; on CUDA the peak allocated device memory) is the contender's `peak`, and
`own` = peak - baseline is what the contender itself added.

    python -m infer.bench_memory '{"name": "infer[contiguous]", "plugin": null, ...}'
prints one JSON line: {"peak_bytes": ..., "baseline_bytes": ...}.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class MemorySpec:
    """What the child needs to rebuild one contender: `plugin` None for the engine itself."""

    name: str
    plugin: str | None
    path: str
    dtype: str
    device: str
    prompt_ids: list[int]
    new_tokens: int
    cache: str = "contiguous"
    use_kv_cache: bool = True
    compute_dtype: str = "exact"
    fused_projections: bool = False
    decode_gemv: str = "auto"
    huge_pages: bool = True
    native_ops: bool = True
    native_step: bool = True
    weights: str = "auto"  # the --weights of the run: "auto" keeps a GGUF file's stored blocks
    group_size: int = 32


@dataclass(frozen=True)
class MemoryFigures:
    """One contender's memory, from its own process (bytes)."""

    peak_bytes: int
    baseline_bytes: int

    @property
    def own_bytes(self) -> int:
        """What the contender added to a process that had only imported torch."""
        return self.peak_bytes - self.baseline_bytes


def measure(spec: MemorySpec, timeout_s: float = 1800) -> MemoryFigures:
    """Run `spec` in a fresh Python process and return its memory figures; a ValueError with the child's
    last error line if it fails."""
    done = subprocess.run([sys.executable, "-m", "infer.bench_memory", json.dumps(spec.__dict__)],
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise ValueError(f"measuring the memory of {spec.name} failed: {lines[-1] if lines else 'no output'}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    return MemoryFigures(int(figures["peak_bytes"]), int(figures["baseline_bytes"]))


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"/proc/self/status has no {field}")


def _peak_bytes(device: Any) -> int:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    try:
        return _status_bytes("VmHWM")
    except (OSError, ValueError):  # not Linux: the process peak from getrusage
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child(spec: MemorySpec) -> MemoryFigures:
    import torch

    from infer.bench_common import CONTENDER_PLUGINS, engine_contender, plugin
    from infer.loader import load_model, resolve_dtype

    device = torch.device(spec.device)
    baseline = 0 if device.type == "cuda" else _peak_bytes(device)
    dtype = resolve_dtype(spec.dtype)
    if spec.plugin is None:
        model = load_model(Path(spec.path), dtype=dtype, device=device, compute_dtype=spec.compute_dtype,
                           decode_gemv=spec.decode_gemv, huge_pages=spec.huge_pages,
                           weights="stored" if spec.weights == "auto" else spec.weights, group_size=spec.group_size)
        model.native_ops, model.native_step = spec.native_ops, spec.native_step
        if spec.fused_projections:
            model.fused_projections = True
        contenders = [engine_contender(spec.name, model, spec.prompt_ids, spec.new_tokens, spec.cache,
                                       spec.use_kv_cache)]
    else:
        contenders = plugin(CONTENDER_PLUGINS, spec.plugin)(Path(spec.path), dtype, device, spec.prompt_ids,
                                                            spec.new_tokens)
    chosen = [c for c in contenders if c.name == spec.name]
    if not chosen:
        raise ValueError(f"no contender {spec.name!r} among {[c.name for c in contenders]}")
    chosen[0].run()
    return MemoryFigures(_peak_bytes(device), baseline)


def main(argv: list[str]) -> int:
    """The child: one JSON argument (a MemorySpec), one JSON line out."""
    if len(argv) != 1:
        print("usage: python -m infer.bench_memory '<MemorySpec as JSON>'", file=sys.stderr)
        return 2
    try:
        figures = _child(MemorySpec(**json.loads(argv[0])))
    except (ValueError, TypeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"peak_bytes": figures.peak_bytes, "baseline_bytes": figures.baseline_bytes}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
