"""What the bench's parts share: a timed trial and a contender (the engine's own among them), finding the
contender plugins, and the report's pieces (percentiles, the text table, speed ratios, the machine).

`infer.bench`, `infer.bench_batched` and `infer.bench_memory` (and the contender plugins in `reference`) all
build on this module, and it imports none of them: the bench runs its batched workload and its memory child,
and those need these pieces, so kept in `infer.bench` they would import each other in a circle.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from infer.kernels.native import native_kernels
from infer.memory import available_memory, empty_on_huge_pages, synchronize
from infer.tuning import cpu_flags, last_level_cache_bytes


@dataclass
class Trial:
    """One timed generation: prefill (to the first token) and each decode step."""

    ttft_s: float
    prompt_tokens: int
    step_times_s: list[float]
    cache_bytes: int = 0
    peak_bytes: int = 0


@dataclass
class Contender:
    """A named way to generate, run as `run()` once per trial."""

    name: str
    run: Callable[[], Trial]
    trials: list[Trial] = field(default_factory=list)
    plugin: str | None = None  # the contender plugin that made it (None: the engine), for its memory child


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on CUDA; the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def engine_contender(
    name: str, model: torch.nn.Module, prompt_ids: list[int], new_tokens: int, cache: str, use_kv_cache: bool
) -> Contender:
    """The engine's own `generate`, greedy, never stopping early."""
    from infer.generation import generate
    from infer.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    device = next(model.parameters()).device

    def run() -> Trial:
        result = generate(model, None, prompt_ids, params, cache=cache, use_kv_cache=use_kv_cache)  # type: ignore[arg-type]
        return Trial(
            ttft_s=result.time_to_first_token_s,
            prompt_tokens=len(prompt_ids),
            step_times_s=result.decode_times_s,
            cache_bytes=result.cache_memory_bytes,
            peak_bytes=peak_memory_bytes(device),
        )

    return Contender(name, run)


def format_table(rows: list[dict[str, float | str]], columns: list[str]) -> str:
    """A plain aligned text table."""
    cells = [[str(col) for col in columns]]
    for row in rows:
        cells.append([f"{row.get(col, float('nan')):.2f}" if isinstance(row.get(col), float) else str(row.get(col, ""))
                      for col in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def speed_ratio(ratio: float) -> str:
    """'1.25x faster' or '1.25x slower' (never a slowdown worded as a speed-up)."""
    if ratio >= 1:
        return f"{ratio:.2f}x faster"
    return f"{1 / ratio:.2f}x slower" if ratio > 0 else "no comparison (zero rate)"


def machine_info() -> dict[str, object]:
    """What the figures depend on: CPU model and flags that matter, threads, library versions, the commit."""
    info: dict[str, object] = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                               "python": sys.version.split()[0]}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = cpu_flags()
    if flags is not None:
        info["cpu_flags"] = sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16",
                                            "amx_fp16", "amx_int8", "fma", "f16c"})
    info["cpu_count"] = os.cpu_count()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    for package in ("transformers", "llama_cpp"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info[package] = importlib.metadata.version(package.replace("_", "-"))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5)
        if commit.returncode == 0:
            info["commit"] = commit.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


# Contenders and bench checkpoints come from other packages through entry points (the Hugging Face
# contender and the random-checkpoint builder from `reference`, see pyproject.toml), so the engine never
# imports them by name and runs without them.
CONTENDER_PLUGINS = "infer.bench.contenders"
BATCHED_PLUGINS = "infer.bench.batched"  # contenders of the batched workload (bench --batched)
CHECKPOINT_PLUGINS = "infer.bench.checkpoints"


def plugin(group: str, name: str) -> Callable[..., Any]:
    """The callable an installed package registers as entry point `name` of `group`."""
    found = {ep.name: ep for ep in importlib.metadata.entry_points(group=group)}
    if name not in found:
        raise ValueError(
            f"no bench plugin {name!r} is installed (in {group}: {', '.join(sorted(found)) or 'none'}); "
            "pip install -e '.[bench]' registers the Hugging Face one"
        )
    try:
        return cast(Callable[..., Any], found[name].load())
    except ImportError as e:
        raise ValueError(f"the bench plugin {name!r} cannot load ({e}); pip install -e '.[bench]'") from e


def read_buffer_bytes(device: torch.device) -> int:
    """Size of the bandwidth probes' buffer: on the CPU at least 1 GiB and twice the last-level cache (the
    Xeons here have 480 MiB of L3: a smaller buffer measures the cache), at most a quarter of free memory."""
    if device.type != "cpu":
        return 256 * 2**20
    wanted = max(2**30, 2 * last_level_cache_bytes())
    free = available_memory(device)
    return max(64 * 2**20, min(wanted, free // 4)) if free else wanted


def measure_read_bandwidth(device: torch.device, nbytes: int | None = None,
                           repeats: int = 5) -> tuple[float, dict[str, float]]:
    """Bytes/s of reading a large buffer once, the bound a decode step, which reads weights and K/V and writes
    almost nothing, can reach: the best of the methods tried (torch's sum; on the CPU also the native read of
    infer/kernels/cpu_decode.c, streaming as its GEMV does), each the best of `repeats`, and every method's figure.
    On the CPU the buffer lies on the pages the loader gives weights (huge pages where the kernel has them)."""
    nbytes = read_buffer_bytes(device) if nbytes is None else nbytes
    if device.type == "cpu":
        src = empty_on_huge_pages((nbytes // 4,), torch.float32).fill_(1.0)
    else:
        src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    methods: dict[str, Callable[[], object]] = {"torch.sum": src.sum}
    kernels = native_kernels() if device.type == "cpu" else None
    if kernels is not None:
        methods[f"native read ({kernels.isa})"] = lambda: kernels.read(src)
    rates = {}
    for name, read in methods.items():
        best = float("inf")
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            read()
            synchronize(device)
            best = min(best, time.perf_counter() - start)
        rates[name] = src.nbytes / best
    return max(rates.values()), rates


def pyplot() -> Any | None:
    """matplotlib's pyplot on its file-only backend (Agg: no display needed), or None where matplotlib is not
    installed (it is the bench extra's, `pip install infer[bench]`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
