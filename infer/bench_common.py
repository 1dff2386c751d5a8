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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from infer.tuning import cpu_flags


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
