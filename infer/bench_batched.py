"""`python -m infer bench --batched`: many requests at once, served by the batched engine, against the same
requests one by one and against contender plugins (Hugging Face static batching, from `reference`).

All requests arrive at time 0 with their prompt and output length fixed by the workload; greedy decoding (or
the workload's sampling settings, `--temperature` / `--top-k` / `--top-p` / `--min-p`, each request its own
seed) with the end-of-sequence token ignored, so every contender produces exactly the same number of tokens per
request and the figures compare like with like:
- tokens/s: generated tokens (each request's own count, never padding) over the wall time;
- requests/s: requests over the wall time;
- time to first token and latency per request, from time 0, as a client would see them (one by one, a
  request waits for those before it; in static batches, for the batches before its own and, for latency,
  for its batch's longest request).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infer.bench_common import format_table, machine_info, measure_read_bandwidth, percentile, speed_ratio
from infer.cache.paged_quantized import KV_CACHE_DTYPES
from infer.models import Transformer
from infer.ragged import DECODE_KERNELS
from infer.roofline import (
    ForwardProfile,
    Limits,
    ModelShape,
    SlowSteps,
    StepPoint,
    StepRecord,
    best_limits,
    limit_dtypes,
    measure_limits,
    median_step_ms,
    native_product_kernels,
    plot_roofline,
    profile_forward,
    profile_table,
    slow_steps,
    step_points,
    summarize_phases,
    summarize_points,
    typical_limits,
)
from infer.sampling import GREEDY_BELOW, SamplingParams

if TYPE_CHECKING:
    from infer.kernels.native import NativeKernels


@dataclass(frozen=True)
class Sampling:
    """How a workload's requests pick their tokens (`SamplingParams`' fields of the name): greedy by default."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __str__(self) -> str:
        """'greedy', or the settings that are on ('temperature 0.8, top_p 0.9')."""
        if self.temperature < GREEDY_BELOW:
            return "greedy"
        return ", ".join(f"{f.name} {getattr(self, f.name):g}" for f in fields(self)
                         if f.name == "temperature" or getattr(self, f.name) != f.default)


@dataclass(frozen=True)
class BatchRequest:
    """One request of a workload: its prompt, how many tokens it generates and how it picks them (its seed
    `seed`)."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    seed: int = 0


@dataclass
class BatchedRun:
    """One timed pass over a workload: per request (in workload order) the time to its first token and to
    its last, both from the start; `stats`: contender-specific figures (blocks, preemptions, ...)."""

    name: str
    wall_s: float
    ttft_s: list[float]
    latency_s: list[float]
    new_tokens: int
    stats: dict[str, float] = field(default_factory=dict)
    trace: list[StepRecord] = field(default_factory=list)  # an engine's steps (infer/roofline.py)


def batched_workload(vocab_size: int, *, num_requests: int = 48, prompt_lens: tuple[int, int] = (16, 256),
                     new_tokens: tuple[int, int] = (8, 96), shared_prefix: int = 0, seed: int = 0,
                     sampling: Sampling = Sampling()) -> list[BatchRequest]:
    """`num_requests` requests with prompt and output lengths drawn uniformly from the given inclusive
    ranges, token ids uniform over the vocabulary; the first `shared_prefix` prompt tokens are the same in
    every request (a system prompt). `sampling`: every request's (checked as `SamplingParams` checks it: its
    error names the field); request i's seed is `seed + i`."""
    request_params(BatchRequest([], 1, sampling))
    for name, (lo, hi) in (("prompt_lens", prompt_lens), ("new_tokens", new_tokens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be a range 1 <= low <= high, got {lo}..{hi}")
    if num_requests < 1 or shared_prefix < 0:
        raise ValueError(f"need num_requests >= 1 and shared_prefix >= 0, got {num_requests}, {shared_prefix}")
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(shared_prefix)]
    return [BatchRequest(prefix + [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_lens))],
                         rng.randint(*new_tokens), sampling, seed + i) for i in range(num_requests)]


def request_params(request: BatchRequest) -> SamplingParams:
    """The request's settings, exactly `max_new_tokens` tokens (the end token does not stop it)."""
    s = request.sampling
    return SamplingParams(max_new_tokens=request.max_new_tokens, temperature=s.temperature, top_k=s.top_k,
                          top_p=s.top_p, min_p=s.min_p, seed=request.seed, ignore_eos=True)


def run_engine(model: Transformer, work: list[BatchRequest], name: str = "infer engine",
               **engine_args: Any) -> BatchedRun:
    """The workload through `infer.Engine`, every request added at time 0."""
    from infer.engine import Engine

    engine = Engine(model, None, **engine_args)
    engine.trace = []
    # CUDA graphs of the decode shapes the workload can reach, captured before the clock starts (a server
    # captures them at start-up).
    began = time.perf_counter()
    shapes = engine.capture_decode_graphs(max(len(r.prompt_ids) + r.max_new_tokens for r in work))
    capture_s = time.perf_counter() - began
    start = time.perf_counter()
    results = engine.generate([r.prompt_ids for r in work], [request_params(r) for r in work])
    wall = time.perf_counter() - start
    failed = [r.error for r in results if r.finish_reason == "error"]
    if failed:
        raise ValueError(f"the engine failed {len(failed)} request(s): {failed[0]}")
    s, pool = engine.stats, engine.pool
    stats = {"steps": s.steps, "preemptions": s.preemptions, "prefix_hit_rate": s.prefix_hit_rate,
             "pool_blocks": pool.num_blocks, "block_size": pool.block_size, "peak_blocks_used": s.peak_blocks_used,
             "peak_blocks_shared": s.peak_blocks_shared, "max_waste_slots_per_running_seq": s.max_waste_per_running_seq,
             "graph_steps": s.graph_steps, "graph_prompt_steps": s.graph_prompt_steps, "graph_shapes": shapes,
             "graph_capture_s": capture_s,
             "kv_memory_bytes": engine.memory_bytes, "max_num_seqs": engine.scheduler.max_num_seqs,
             "token_budget": engine.scheduler.max_num_batched_tokens}
    return BatchedRun(name, wall, [r.time_to_first_token_s for r in results],
                      [r.time_to_first_token_s + sum(r.decode_times_s) for r in results],
                      sum(len(r.token_ids) for r in results), stats, engine.trace)


def run_quantized(model: Transformer, name: str, engine_args: dict[str, Any], work: list[BatchRequest]
                  ) -> BatchedRun:
    """`run_engine` with the arguments first (a runner of the workload alone)."""
    return run_engine(model, work, name, **engine_args)


def run_one_by_one(model: Transformer, work: list[BatchRequest], cache: str = "contiguous") -> BatchedRun:
    """The workload through `infer.generate`, one request after another."""
    from infer.generation import generate

    ttft, latency, tokens = [], [], 0
    start = time.perf_counter()
    for request in work:
        began = time.perf_counter() - start
        result = generate(model, None, request.prompt_ids, request_params(request), cache=cache)
        ttft.append(began + result.time_to_first_token_s)
        latency.append(time.perf_counter() - start)
        tokens += len(result.token_ids)
    return BatchedRun(f"infer one by one[{cache}]", time.perf_counter() - start, ttft, latency, tokens)


def summarize_batched(run: BatchedRun) -> dict[str, float | str]:
    """A table row: throughput and the spread of per-request times."""
    return {"name": run.name, "wall_s": run.wall_s, "tok_s": run.new_tokens / run.wall_s,
            "req_s": len(run.ttft_s) / run.wall_s,
            "ttft_p50_ms": percentile(run.ttft_s, 50) * 1e3, "ttft_p99_ms": percentile(run.ttft_s, 99) * 1e3,
            "latency_p50_ms": percentile(run.latency_s, 50) * 1e3,
            "latency_p99_ms": percentile(run.latency_s, 99) * 1e3}


BATCHED_UNITS = {"wall_s": "s", "tok_s": "generated tokens/s", "req_s": "requests/s", "ttft_*_ms": "ms from start",
                 "latency_*_ms": "ms from start"}


def run_batched_bench(args: argparse.Namespace, model: Transformer, path: Path,
                      others: list[Callable[..., tuple[str, Callable[[list[BatchRequest]], BatchedRun]]]]) -> int:
    """The `bench --batched` subcommand, after the model is loaded: every contender over the same workload,
    alternating over `--trials`; the table of medians (by wall time), the ratios and the engine's pool
    figures, and the JSON report."""
    from tqdm import tqdm

    from infer.tuning import CHOICES

    config = model.config
    work = batched_workload(config.vocab_size, num_requests=args.requests, prompt_lens=args.batched_prompt_lens,
                            new_tokens=args.batched_new_tokens, shared_prefix=args.shared_prefix, seed=args.seed,
                            sampling=workload_sampling(args))
    dtype, device = model.dtype, model.device
    engine_args = {name: getattr(args, name) for name in ("max_num_seqs", "max_num_batched_tokens", "decode_attention",
                                                          "chunk_attention", "num_blocks", "cache_memory")
                   if getattr(args, name) is not None}  # unset: the Engine's own defaults
    if args.no_decode_graphs:
        engine_args["decode_graphs"] = False
    if args.mixed_graphs is not None:
        engine_args["mixed_graphs"] = args.mixed_graphs
    packed = "off" if args.no_packed_products else args.packed_products
    if packed != "auto":
        engine_args["packed_products"] = False if packed == "off" else packed
    runners: list[tuple[str, Callable[[list[BatchRequest]], BatchedRun]]] = [
        ("infer engine", lambda w: run_engine(model, w, **engine_args))]
    for kv in args.kv_cache_dtype:  # the same engine with its pool quantized, in the same memory
        # (the Triton paged kernel reads exact blocks only: a quantized pool takes the engine's other choice)
        # (and its staging pads one write a row of a pure-decode step: no steps with prompt tokens from graphs)
        quantized = {k: v for k, v in engine_args.items()
                     if (k, v) != ("decode_attention", "triton") and k != "mixed_graphs"}
        quantized["kv_cache_dtype"] = kv
        runners.append((f"infer engine[{kv}]", partial(run_quantized, model, f"infer engine[{kv}]", quantized)))
    if not args.no_one_by_one:
        runners.append(("infer one by one", lambda w: run_one_by_one(model, w)))
    for make in others:
        runners.append(make(path, dtype, device, args.batch_size))
    runs: dict[str, list[BatchedRun]] = {name: [] for name, _ in runners}
    warm = work[: min(4, len(work))]
    with tqdm(total=len(runners) * (args.trials + 1), desc="bench --batched", unit="run", file=sys.stderr) as bar:
        warmed = []
        for name, run in runners:  # a short warm-up: first-call costs out of the timings
            bar.set_postfix_str(f"warm-up {name}")
            warmed.append(run(warm))
            bar.update()
        # the limits timed before the runs, between their trials and after them (report_roofline), at the engine's
        # token budget too: the report reads the runs against their median
        budget = int(warmed[0].stats["token_budget"])
        limits: list[Limits] = [] if args.no_roofline else [machine_limits(model, budget)]
        for trial in range(args.trials):
            for name, run in runners:
                bar.set_postfix_str(name)
                runs[name].append(run(work))
                bar.update()
            if limits and trial < args.trials - 1:
                limits.append(machine_limits(model, budget))
    medians = [sorted(r, key=lambda x: x.wall_s)[len(r) // 2] for r in runs.values()]
    rows = [summarize_batched(r) for r in medians]
    print(f"\nmodel {path} ({config.model_type}), {dtype}, {device}, {len(work)} requests (prompts "
          f"{args.batched_prompt_lens[0]}-{args.batched_prompt_lens[1]}, new {args.batched_new_tokens[0]}-"
          f"{args.batched_new_tokens[1]}, shared prefix {args.shared_prefix}, {work[0].sampling}), "
          f"{args.trials} trial(s), medians")
    print(format_table(rows, ["name", "wall_s", "tok_s", "req_s", "ttft_p50_ms", "ttft_p99_ms", "latency_p50_ms",
                              "latency_p99_ms"]))
    engine = rows[0]
    ratios = [f"{engine['name']} vs {row['name']}: throughput "
              f"{speed_ratio(float(engine['tok_s']) / float(row['tok_s']))}" for row in rows[1:]]
    for line in ratios:
        print(line)
    engines = [m for m in medians if m.stats]
    pools: list[dict[str, float | str]] = []
    if len(engines) > 1:  # the pool kinds side by side: what the same memory holds, and what it runs
        pools = [pool_row(m, work) for m in engines]
        print(format_table(pools, ["name", "kv_mib", "blocks", "requests_fit", "requests_per_gib", "tpot_p50_ms",
                                   "tok_s", "preemptions"]))
        print(f"requests_fit: requests of the workload's mean length ({mean_length(work):.0f} tokens) the pool holds "
              "at once; "
              "requests_per_gib: the same per GiB of pool; tpot_p50_ms: the median request's time per output token "
              "after its first, the latency they were served at (every pool under the same request and token limits)")
    pool = medians[0].stats
    print(f"pool: {pool['pool_blocks']:.0f} blocks of {pool['block_size']:.0f} tokens; peak used "
          f"{pool['peak_blocks_used']:.0f}, peak shared {pool['peak_blocks_shared']:.0f}; worst waste "
          f"{pool['max_waste_slots_per_running_seq']:.2f} slots per running request (under one block: "
          f"{pool['max_waste_slots_per_running_seq'] < pool['block_size']}); {pool['steps']:.0f} steps, "
          f"{pool['preemptions']:.0f} preemptions, prefix hit rate {pool['prefix_hit_rate']:.1%}")
    if pool["graph_shapes"]:
        print(f"decode graphs: {pool['graph_steps']:.0f} steps replayed ({pool['graph_prompt_steps']:.0f} of them "
              f"with prompt tokens) from {pool['graph_shapes']:.0f} padded shapes, captured in "
              f"{pool['graph_capture_s']:.1f} s before the clock started")
    quantized_runs = list(zip(args.kv_cache_dtype, medians[1 : 1 + len(args.kv_cache_dtype)], strict=True))
    roofline = None if args.no_roofline else report_roofline(model, work, engine_args, medians[0], limits,
                                                             quantized_runs, Path(args.plot) if args.plot else None)
    print("choices: " + "; ".join(f"{c.name}: {c.value}" for c in CHOICES.values()))
    if args.json:
        report = {"machine": machine_info(), "choices": [asdict(c) for c in CHOICES.values()],
                  "units": BATCHED_UNITS, "model": str(path), "dtype": str(dtype), "device": str(device),
                  "workload": [asdict(r) | {"prompt_ids": len(r.prompt_ids)} for r in work],
                  "engine_args": engine_args, "batch_size": args.batch_size, "results": rows, "ratios": ratios,
                  "engine_stats": pool, "pools": pools, "roofline": roofline,
                  "runs": {name: [asdict(r) | {"trace": len(r.trace)} for r in rs] for name, rs in runs.items()}}
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


def machine_limits(model: Transformer, max_rows: int) -> Limits:
    """The machine's limits for `model`'s products (`measure_limits` at its projection shape, the native packed
    product a contender for bf16 weights) and its read bandwidth, measured now."""
    config, device = model.config, model.device
    bandwidth, _ = measure_read_bandwidth(device)
    return measure_limits(limit_dtypes(model), device, config.hidden_size, config.intermediate_size, max_rows,
                          bandwidth, native_contender(model))


def native_contender(model: Transformer) -> NativeKernels | None:
    """The kernels whose packed product contends for the limit of `model`'s products: bf16 or fp32 weights, a CPU
    build that has it."""
    return native_product_kernels(model.device, model.dtype)


def report_roofline(model: Transformer, work: list[BatchRequest], engine_args: dict[str, Any], run: BatchedRun,
                    samples: list[Limits] | None = None, quantized: list[tuple[str, BatchedRun]] | None = None,
                    plot: Path | None = None) -> dict[str, Any]:
    """Print (and return for the JSON) the machine's limits, timed now and in `samples` (before the runs and between
    their trials): their median at each row count (the machine while the runs ran), the engine run's FLOPs and bytes
    and its fraction of the roofline per phase, the median step's against the best timing too, each `quantized` pool's
    run (its kind, its run) against its own roofline (its K/V read at its blocks' bytes), and where a step's time goes
    (a further run under timing hooks); with `plot`, a PNG of every step against the roofline (`plot_roofline`).
    The JSON holds each run's steps (`StepPoint`)."""
    config, dtype = model.config, model.dtype
    budget = int(run.stats["token_budget"])  # (the engine's: the caller's or its measured choice)
    dtypes = limit_dtypes(model)
    native = native_contender(model)
    timings = [*(samples or []), machine_limits(model, budget)]
    limits, best = typical_limits(timings), best_limits(timings)
    bandwidth = limits.bandwidth
    shape = ModelShape.of(model, dtype.itemsize)
    # every run's steps costed once, each quantized pool's K/V at its own bytes: the phase tables, the JSON, the plot
    pooled = [(q, pool_shape(shape, kind, q)) for kind, q in quantized or []]
    steps = {run.name: step_points(run.trace, shape, limits),
             **{q.name: step_points(q.trace, own, limits) for q, own in pooled}}
    phases = summarize_points(steps[run.name])
    strict = {p.phase: p.fraction_p50 for p in summarize_phases(run.trace, shape, best)}
    table: list[dict[str, float | str]] = [
        {"phase": p.phase, "steps": p.steps, "seconds": p.seconds, "gflop": p.flops / 1e9, "gb": p.bytes / 1e9,
         "gflop_s": p.flops / p.seconds / 1e9, "gb_s": p.bytes / p.seconds / 1e9, "roofline_s": p.roofline_s,
         "fraction": p.fraction, "fraction_p50": p.fraction_p50, "fraction_at_shape": p.fraction_at_shape,
         "p50_vs_best": strict[p.phase],
         "step_p50_ms": median_step_ms(run.trace, p.phase) if p.phase != "all" else 0.0}
        for p in phases]
    rates = ", ".join(f"{rows} rows {rate / 1e9:.0f}" for rows, rate in limits.flops_by_rows.items())
    named = " or ".join([*(str(d).removeprefix("torch.") for d in dtypes), *(["the native packed product"] if native
                                                                              else [])])
    peaks = [t.peak_flops / 1e9 for t in timings]
    print(f"roofline: matmul [rows, {config.hidden_size}] @ [{config.hidden_size}, {config.intermediate_size}] in "
          f"{named} (the fastest), the median of {len(timings)} timings (before the runs, between the trials, after "
          f"them): {rates} GFLOP/s; read {bandwidth / 1e9:.1f} GB/s; the peak timed {min(peaks):.0f}-{max(peaks):.0f} "
          "GFLOP/s. A step's bound is max(FLOPs / peak matmul, bytes / read) (fraction; fraction_p50: the median "
          "step's own; p50_vs_best: the same against the fastest timing), or with the matmul rate at the step's own "
          "rows (fraction_at_shape)")
    print(format_table(table, ["phase", "steps", "seconds", "gflop", "gb", "gflop_s", "gb_s", "roofline_s", "fraction",
                               "fraction_p50", "p50_vs_best", "fraction_at_shape", "step_p50_ms"]))
    slow = slow_steps(run.trace)
    print(f"one-off slow steps (over {slow.factor:g}x their phase's median step): {slow.count}, {slow.excess_s:.3f} s "
          f"past that median, {slow.share:.1%} of the steps' time (`--plot` shows where); {host_taken(slow)}")
    pools = quantized_pool_fractions([(q, own.kv_elem_bytes, steps[q.name]) for q, own in pooled])
    if pools:
        print("each quantized pool against its own roofline (its K/V at its blocks' bytes a K or V element, the exact "
              f"pool's {shape.kv_elem_bytes:g}; staged blocks counted at the codes' size too: a tighter bound):")
        print(format_table(pools, ["name", "kv_bytes_per_element", "phase", "steps", "seconds", "gb", "roofline_s",
                                   "fraction", "fraction_p50", "fraction_at_shape", "step_p50_ms"]))
    profile = ForwardProfile()
    # The hooks synchronise the device around every op, which a CUDA graph capture forbids (and a replayed graph
    # would bypass): the profiled run steps op by op.
    with profile_forward(model, profile):
        profiled = run_engine(model, work, **(engine_args | {"decode_graphs": False, "mixed_graphs": False}))
    parts = profile_table(profiled.trace, profile)
    print(f"where a step's time goes (a further run under timing hooks, without decode graphs, "
          f"{profiled.wall_s:.1f} s):")
    print(format_table(parts, ["part", "seconds", "share"]))
    if plot is not None:
        print(f"wrote {plot}" if plot_roofline(steps, limits, plot)
              else "matplotlib is not installed: no plot (pip install matplotlib)")
    return {"matmul_flops_by_rows": limits.flops_by_rows, "matmul_dtypes": [str(d) for d in dtypes],
            "matmul_native_packed": native is not None, "read_bandwidth": bandwidth,
            "timings": [{"matmul_flops_by_rows": t.flops_by_rows, "read_bandwidth": t.bandwidth} for t in timings],
            "phases": table, "pools": pools,
            "profile": parts, "slow_steps": asdict(slow) | {"share": slow.share},
            "steps": {name: [asdict(p) for p in points] for name, points in steps.items()}}


def host_taken(slow: SlowSteps) -> str:
    """What the host took in a run's slow steps and in the whole run, as a clause of the report's line."""
    def steal(s: float | None) -> str:
        return "not measured" if s is None else f"{s:.3f} s"

    return (f"in them {slow.faults} page faults ({slow.faulting} of them with more than the run's usual: first "
            f"touches of fresh memory, a pool's new pages), the host's steal {steal(slow.steal_s)} (its CPUs' time "
            f"given to other guests); in the whole run {slow.run_faults} page faults, steal {steal(slow.run_steal_s)}")


def quantized_pool_fractions(runs: list[tuple[BatchedRun, float, list[StepPoint]]]) -> list[dict[str, float | str]]:
    """Each quantized pool's run per phase against its own roofline (its run, its bytes a K or V element, its steps
    costed at them by `step_points`: the same FLOPs and weights, its K/V at `QuantizedPagedPool.element_bytes`)."""
    rows: list[dict[str, float | str]] = []
    for run, element, points in runs:
        rows += [{"name": run.name, "kv_bytes_per_element": element, "phase": p.phase, "steps": p.steps,
                  "seconds": p.seconds, "gb": p.bytes / 1e9, "roofline_s": p.roofline_s, "fraction": p.fraction,
                  "fraction_p50": p.fraction_p50, "fraction_at_shape": p.fraction_at_shape,
                  "step_p50_ms": median_step_ms(run.trace, p.phase) if p.phase != "all" else 0.0}
                 for p in summarize_points(points)]
    return rows


def pool_shape(shape: ModelShape, kind: str, run: BatchedRun) -> ModelShape:
    """The model's shape with its K/V at a `kind` pool's bytes a K or V element (`QuantizedPagedPool.element_bytes`,
    at the run's block size)."""
    from infer.cache.paged_quantized import QuantizedPagedPool

    return replace(shape, kv_elem_bytes=QuantizedPagedPool.element_bytes(shape.config, kind,
                                                                         int(run.stats["block_size"])))


def mean_length(work: list[BatchRequest]) -> float:
    """The workload's mean request length: prompt and new tokens."""
    return sum(len(r.prompt_ids) + r.max_new_tokens for r in work) / len(work)


def pool_row(run: BatchedRun, work: list[BatchRequest]) -> dict[str, float | str]:
    """An engine's pool: its memory, blocks, the requests of the workload's mean length it holds at once (and per GiB
    of pool), the median request's time per output token after its first (the latency it served at), its
    throughput."""
    s = run.stats
    fit = s["pool_blocks"] // -(-mean_length(work) // s["block_size"])
    per_token = [(end - first) / (r.max_new_tokens - 1)
                 for r, first, end in zip(work, run.ttft_s, run.latency_s, strict=True) if r.max_new_tokens > 1]
    return {"name": run.name, "kv_mib": s["kv_memory_bytes"] / 2**20, "blocks": s["pool_blocks"],
            "requests_fit": fit, "requests_per_gib": fit / (s["kv_memory_bytes"] / 2**30),
            "tpot_p50_ms": percentile(per_token, 50) * 1e3 if per_token else 0.0,
            "tok_s": run.new_tokens / run.wall_s, "preemptions": s["preemptions"]}


def workload_sampling(args: argparse.Namespace) -> Sampling:
    """`--temperature`, `--top-k`, `--top-p`, `--min-p`."""
    return Sampling(args.temperature, args.top_k, args.top_p, args.min_p)


def check_batched_args(args: argparse.Namespace) -> None:
    """Refuse bad `--batched` options before any model loads."""
    for name in ("requests", "batch_size", "max_num_seqs", "max_num_batched_tokens", "num_blocks", "trials"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.plot and args.no_roofline:
        raise ValueError("--plot draws the steps against the roofline: drop --no-roofline")
    if args.shared_prefix < 0:
        raise ValueError(f"--shared-prefix must be >= 0, got {args.shared_prefix}")
    if args.cache_memory is not None and args.num_blocks is not None:
        raise ValueError("give --cache-memory or --num-blocks, not both")
    if args.cache_memory is not None and args.cache_memory < 1:
        raise ValueError(f"--cache-memory must be >= 1 MiB, got {args.cache_memory / 2**20:g}")
    try:
        request_params(BatchRequest([], 1, workload_sampling(args)))
    except ValueError as error:  # "SamplingParams.top_p=..." as the flag the user gave: "--top-p=..."
        text = str(error)
        for f in fields(Sampling):
            text = text.replace(f"SamplingParams.{f.name}", "--" + f.name.replace("_", "-"))
        raise ValueError(text) from None


def mebibytes(text: str) -> int:
    """'64' -> 64 MiB in bytes, for argparse."""
    try:
        return int(float(text) * 2**20)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size in MiB such as 64, got {text!r}") from None


def kv_dtypes(text: str) -> list[str]:
    """'int8,int4' -> ['int8', 'int4'], each a quantized pool kind, for argparse."""
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KV_CACHE_DTYPES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown KV cache dtype {bad[0]!r}; use {', '.join(KV_CACHE_DTYPES)}")
    return kinds


def length_range(text: str) -> tuple[int, int]:
    """'16-256' -> (16, 256), for argparse."""
    try:
        lo, hi = (int(x) for x in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a range LOW-HIGH such as 16-256, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return lo, hi


def add_batched_args(p: argparse.ArgumentParser) -> None:
    """The `bench` options of the batched workload."""
    g = p.add_argument_group("batched workload (--batched)")
    g.add_argument("--batched", action="store_true",
                   help="instead: many requests at once through the batched engine, against the same one by one "
                        "and the --against plugins' batched contenders")
    g.add_argument("--requests", type=int, default=48, help="requests in the workload")
    g.add_argument("--batched-prompt-lens", type=length_range, default=(16, 256), metavar="LOW-HIGH",
                   help="prompt lengths, drawn uniformly")
    g.add_argument("--batched-new-tokens", type=length_range, default=(8, 96), metavar="LOW-HIGH",
                   help="tokens each request generates, drawn uniformly")
    g.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with (a system prompt)")
    g.add_argument("--temperature", type=float, default=0.0, help="every request's temperature (0: greedy, the "
                   "default); each request samples with its own seed (--seed + its index)")
    g.add_argument("--top-k", type=int, default=0, help="every request's top-k (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="every request's top-p (1: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="every request's min-p (0: off)")
    g.add_argument("--batch-size", type=int, default=16, help="batch size of the static-batching contenders")
    g.add_argument("--max-num-seqs", type=int, default=None, help="the engine's cap on running requests "
                   "(default: the Engine's, 64)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="the engine's tokens per forward "
                   "(default: the Engine's, measured: infer.tuning.choose_token_budget)")
    g.add_argument("--num-blocks", type=int, default=None,
                   help="the engine's pool size in blocks of 16 tokens (default: sized for the machine); a small "
                        "pool shows preemption")
    g.add_argument("--cache-memory", type=mebibytes, default=None, metavar="MIB",
                   help="the engines' KV memory in MiB (default: sized for the machine); with --kv-cache-dtype, "
                        "the same budget for every pool kind")
    g.add_argument("--kv-cache-dtype", type=kv_dtypes, default=[], metavar="KINDS",
                   help=f"also run the engine with its pool's blocks quantized, comma-separated "
                        f"({', '.join(KV_CACHE_DTYPES)}): blocks, requests that fit and throughput side by side")
    g.add_argument("--decode-attention", default=None, choices=["auto", *DECODE_KERNELS],
                   help="how the engine's decode steps attend (default: auto: the Triton kernel on CUDA, else "
                        "measured)")
    g.add_argument("--chunk-attention", default=None, choices=["auto", "native", "triton", "sdpa"],
                   help="how the engine's prompt chunks attend (default: auto: with the native or Triton decode "
                        "kernel, their tokens as its rows where measured faster than SDPA over each chunk)")
    g.add_argument("--no-decode-graphs", action="store_true",
                   help="step the engine eagerly on CUDA (default: pure-decode steps replayed from CUDA graphs)")
    g.add_argument("--mixed-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="steps carrying prompt chunks replayed from CUDA graphs too, every token a row of the "
                        "in-place kernel (Engine(mixed_graphs=...); default: on wherever they can run on CUDA; "
                        "--no-mixed-graphs runs those steps eagerly)")
    g.add_argument("--no-packed-products", action="store_true",
                   help="keep F.linear for the engine's products past the few-row kernel's rows (default: weights "
                        "packed once, where measured faster; a second copy of the projections)")
    g.add_argument("--packed-products", default="auto", choices=["auto", "off", "onednn", "native"],
                   help="the packed copies' layout: oneDNN's GEMM past the few-row kernel's rows, or the native "
                        "packed product for every product of 2+ rows (default: measured; off: --no-packed-products, "
                        "which also keeps a quantized model's codes unpacked at load: the single-request bench's "
                        "products on the codes kernel)")
    g.add_argument("--no-one-by-one", action="store_true", help="skip the one-by-one run (the slowest)")
    g.add_argument("--no-roofline", action="store_true",
                   help="skip the roofline report (the machine's matmul and read limits, the fraction of them each "
                        "phase reaches) and the profiled run of where a step's time goes")
