"""Why the batched engine's quantized pools lag the bf16 pool on CUDA (5x on the H200 of 2026-11-27): the same
mixed workload (64 requests, the bench's) with each pool kind, its step time by phase, the timing hooks' split
of a step, and torch.profiler's top device kernels and host ops for the first quantized kind. A lease is short:
one table per question, nothing else.

    python tests/gpu_pool_profile.py [--kinds bf16,int8] [--requests 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def phase_ms(trace: list[Any]) -> dict[str, float]:
    """Median milliseconds of a step per phase of the engine's trace."""
    by: dict[str, list[float]] = {}
    for record in trace:
        seconds = record.schedule_s + record.build_s + record.forward_s + record.sample_s
        by.setdefault(record.phase, []).append(seconds * 1e3)
    return {phase: sorted(ms)[len(ms) // 2] for phase, ms in by.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="bf16,int8", help="pool kinds: bf16 (exact) and any of int8, int4, fp4")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to try the script")
    parser.add_argument("--size", default="1b", choices=["1b", "150m"], help="the bench checkpoint's size")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import infer
    from infer.bench_batched import batched_workload, run_engine
    from infer.roofline import ForwardProfile, profile_forward, profile_table
    from reference.checkpoints import build_bench_checkpoint

    began = time.perf_counter()
    model = infer.load_model(build_bench_checkpoint("llama", size=args.size), dtype="bfloat16",
                              device=args.device)
    print(f"model loaded in {time.perf_counter() - began:.0f} s", flush=True)
    work = batched_workload(model.config.vocab_size, num_requests=args.requests)
    out: dict[str, Any] = {}
    for kind in args.kinds.split(","):
        engine_args: dict[str, Any] = {"cache_memory": 2048 * 2**20}
        if kind != "bf16":
            engine_args["kv_cache_dtype"] = kind
        run_engine(model, work[:4], **engine_args)  # warm-up
        run = run_engine(model, work, **engine_args)
        phases = phase_ms(run.trace)
        profile = ForwardProfile()
        with profile_forward(model, profile):
            profiled = run_engine(model, work, **(engine_args | {"decode_graphs": False}))
        parts = {p["part"]: p["seconds"] for p in profile_table(profiled.trace, profile)}
        print(f"\n{kind}: {run.wall_s:.2f} s, {run.new_tokens / run.wall_s:.0f} tok/s, {len(run.trace)} steps; "
              "step p50 ms by phase " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()), flush=True)
        print("  hooked run: " + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items()), flush=True)
        out[kind] = {"wall_s": run.wall_s, "steps": len(run.trace), "phase_ms": phases, "parts": parts}
        if args.json:  # after every kind: a stage cut by its time limit keeps what it measured
            Path(args.json).write_text(json.dumps(out, indent=1))
        # torch.profiler for the first quantized kind only (on the H200 of 2026-11-29 int4's cost the stage its limit)
        if kind == "bf16" or any("device_ms_per_step" in v for v in out.values()):
            continue
        acts = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if args.device == "cuda" else [])
        with torch.profiler.profile(activities=acts) as prof:
            run = run_engine(model, work, **engine_args)
        events = prof.key_averages()
        steps = len(run.trace)
        print(f"  under torch.profiler: {run.wall_s:.2f} s, {steps} steps; top device kernels:")
        print(f"  {'kernel':64s} {'calls/step':>10s} {'ms/step':>8s}")
        for e in sorted(events, key=lambda e: -e.device_time_total)[:12]:
            print(f"  {e.key[:64]:64s} {e.count / steps:10.1f} {e.device_time_total / steps / 1e3:8.3f}")
        print(f"  {'host op (self CPU time)':64s} {'calls/step':>10s} {'ms/step':>8s}")
        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:16]:
            print(f"  {e.key[:64]:64s} {e.count / steps:10.1f} {e.self_cpu_time_total / steps / 1e3:8.3f}")
        sys.stdout.flush()
        out[kind]["device_ms_per_step"] = sum(e.device_time_total for e in events) / steps / 1e3
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
