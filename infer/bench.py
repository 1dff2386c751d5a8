"""`python -m infer bench`: time generation, optionally against Hugging Face on the same weights.

Reports time to first token, prompt and decode tokens/s, per-step latency statistics, cache and peak
memory, and the roofline: bytes a decode step must read (weights + KV) against the machine's
measured read bandwidth (copy bandwidth is reported beside it). Contenders run in alternating trials after a
warm-up, so drift in machine speed spreads evenly over them. The engine needs no `transformers`; the
Hugging Face contender is a plugin (`--against-hf`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from infer.bench_batched import add_batched_args, check_batched_args, run_batched_bench
from infer.bench_common import (
    BATCHED_PLUGINS,
    CHECKPOINT_PLUGINS,
    CONTENDER_PLUGINS,
    Contender,
    engine_contender,
    format_table,
    machine_info,
    measure_read_bandwidth,
    percentile,
    plugin,
    pyplot,
    read_buffer_bytes,
    speed_ratio,
)
from infer.bench_memory import MemorySpec
from infer.bench_memory import measure as measure_memory
from infer.cli_args import add_model_args, check_model_args, load_with_args
from infer.config import ModelConfig
from infer.families import ARCHITECTURES
from infer.memory import synchronize
from infer.models import Transformer
from infer.tuning import CHOICES, Choice, choose_threads, record


def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Best observed bytes/s of a large tensor copy (bytes read + bytes written)."""
    nbytes = read_buffer_bytes(device) if nbytes is None else nbytes
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def decode_bytes_per_step(model: torch.nn.Module, config: ModelConfig, context: int, kv_bytes_per_elem: int) -> int:
    """Bytes one decode step reads: every weight once (the embedding only as the tied LM head), plus
    K and V of `context` positions in every layer (sliding layers at most their window)."""
    stored = [*model.named_parameters(), *model.named_buffers()]  # a quantized model's codes are buffers
    weights = sum(p.nbytes for name, p in stored if not name.startswith("embed_tokens"))
    if config.tie_word_embeddings:
        weights += sum(p.nbytes for name, p in stored if name.startswith("embed_tokens"))
    kv = 0
    for layer in range(config.num_hidden_layers):
        seen = min(context, config.sliding_window or context) if config.is_sliding(layer) else context
        kv += 2 * config.num_key_value_heads * seen * config.head_dim * kv_bytes_per_elem
    return weights + kv


def summarize(c: Contender, bytes_per_step: int | None, bandwidth: float | None) -> dict[str, float | str]:
    """Medians over trials for rates, pooled statistics over every step for latency."""
    steps = [s for t in c.trials for s in t.step_times_s]
    decode_rates = [len(t.step_times_s) / sum(t.step_times_s) for t in c.trials if t.step_times_s]
    ttft = statistics.median(t.ttft_s for t in c.trials)
    row: dict[str, float | str] = {
        "name": c.name,
        "ttft_ms": ttft * 1e3,
        "prompt_tok_s": c.trials[0].prompt_tokens / ttft,
        "decode_tok_s": statistics.median(decode_rates) if decode_rates else float("nan"),
        "step_mean_ms": statistics.fmean(steps) * 1e3 if steps else float("nan"),
        "step_p50_ms": percentile(steps, 50) * 1e3,
        "step_p95_ms": percentile(steps, 95) * 1e3,
        "step_p99_ms": percentile(steps, 99) * 1e3,
        "step_min_ms": min(steps) * 1e3 if steps else float("nan"),
        "step_max_ms": max(steps) * 1e3 if steps else float("nan"),
        "cache_mib": c.trials[-1].cache_bytes / 2**20,
        # The bench process's peak, which every contender's weights share: the per-contender figures
        # (peak_mib, own_mib) come from infer.bench_memory.
        "process_peak_mib": max(t.peak_bytes for t in c.trials) / 2**20,
    }
    if bytes_per_step and bandwidth and steps:
        row["roofline_fraction"] = bytes_per_step / percentile(steps, 50) / bandwidth
    return row


def step_latency_at(c: Contender, positions: list[int]) -> dict[int, float]:
    """Median latency (ms) of decode step number p (1 = the first step after prefill)."""
    out = {}
    for p in positions:
        times = [t.step_times_s[p - 1] for t in c.trials if len(t.step_times_s) >= p]
        out[p] = statistics.median(times) * 1e3 if times else float("nan")
    return out


def plot_steps(contenders: list[Contender], prompt_len: int, path: Path) -> bool:
    """PNG of per-step latency against position for each contender; False if matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for c in contenders:
        n = min(len(t.step_times_s) for t in c.trials)
        med = [statistics.median(t.step_times_s[i] for t in c.trials) * 1e3 for i in range(n)]
        ax.plot(range(prompt_len + 1, prompt_len + 1 + n), med, label=c.name)
    ax.set_xlabel("position (tokens in context)")
    ax.set_ylabel("decode step latency (ms, median of trials)")
    ax.set_title("Per-step decode latency")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run_bench(args: argparse.Namespace) -> int:
    """The `bench` subcommand."""
    from tqdm import tqdm

    from infer.loader import resolve_dtype

    given = check_model_args(args)
    # Contender plugins are looked up before anything loads, so a missing one fails at once.
    group = BATCHED_PLUGINS if args.batched else CONTENDER_PLUGINS
    other_names = list(dict.fromkeys([*args.against, *["hf"] * args.against_hf]))
    others = [plugin(group, name) for name in other_names]
    if args.batched:
        check_batched_args(args)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and (others or args.batched or args.cache_table):
        raise ValueError("under torchrun (tensor parallelism) bench times infer's single-request decode only: drop "
                         "--against / --against-hf / --batched / --cache-table")
    for name in ("prompt_len", "new_tokens", "trials"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    path = given if given is not None else _bench_checkpoint(args.arch, args.size)
    dtype = resolve_dtype(args.dtype)
    device = torch.device(args.device)
    model = load_with_args(path, args)
    if args.fused_projections:
        model.fused_projections = True
    record(Choice("fused projections", "on" if args.fused_projections else "off",
                  "--fused-projections" if args.fused_projections else "the library default (oracle-exact)"))
    if args.batched:
        # Every contender runs on all cores unless told: the thread choice times one-token steps, and on a shared
        # 2-core Xeon it once took one thread for a run whose steps are hundreds of rows (221 generated tok/s
        # against 512 on two)
        if args.threads > 0:
            choose_threads(model, forced=args.threads)
        else:
            record(Choice("CPU threads", str(torch.get_num_threads()), "PyTorch's default: a batched step's rows "
                          "use every core (the one-token choice is for single requests; --threads to force)"))
        return run_batched_bench(args, model, path, others)
    choose_threads(model, forced=args.threads)
    config = model.config
    if args.cache_table:
        kinds = args.cache_table.split(",")
        contexts = [int(c) for c in args.contexts.split(",")]
        table = cache_kind_table(model, kinds, contexts, args.new_tokens, args.seed)
        print(f"\nmodel {path} ({config.model_type}), {dtype}, {device}, {args.new_tokens} decode steps per row")
        print(format_table(table, ["cache", "context", "cache_mib", "decode_tok_s", "step_p50_ms"]))
        if args.json:
            Path(args.json).write_text(json.dumps(table, indent=1))
        return 0
    gen = torch.Generator().manual_seed(args.seed)
    prompt_ids = torch.randint(0, config.vocab_size, (args.prompt_len,), generator=gen).tolist()

    contenders = [engine_contender(f"infer[{args.cache}]", model, prompt_ids, args.new_tokens, args.cache, True)]
    if args.compare:
        contenders.append(engine_contender("infer[no cache]", model, prompt_ids, args.new_tokens, args.cache, False))
    for plugin_name, make in zip(other_names, others, strict=True):
        for c in make(path, dtype, device, prompt_ids, args.new_tokens):
            c.plugin = plugin_name
            contenders.append(c)

    total = (args.warmup + args.trials) * len(contenders)
    with tqdm(total=total, desc="bench", unit="run", file=sys.stderr) as bar:
        for _ in range(args.warmup):
            for c in contenders:
                bar.set_postfix_str(f"warm-up {c.name}")
                c.run()
                bar.update()
        for _ in range(args.trials):  # alternate, so slow drift hits every contender alike
            for c in contenders:
                bar.set_postfix_str(c.name)
                c.trials.append(c.run())
                bar.update()

    copy_bandwidth = measure_copy_bandwidth(device)
    bandwidth, read_rates = measure_read_bandwidth(device)  # the roofline's denominator: a decode step reads
    mid_context = args.prompt_len + args.new_tokens // 2
    kv_elem = torch.tensor([], dtype=dtype).element_size()
    bytes_per_step = decode_bytes_per_step(model, config, mid_context, kv_elem)
    rows = [summarize(c, bytes_per_step, bandwidth) for c in contenders]
    positions = [p for p in args.positions if p <= args.new_tokens - 1]
    for row, c in zip(rows, contenders, strict=True):
        row.update({f"step@{p}_ms": v for p, v in step_latency_at(c, positions).items()})
    baseline_mib = None
    if model.tensor_parallel is not None and not args.no_memory:
        args.no_memory = True  # a fresh process per contender cannot join the group
        print("memory: not measured under tensor parallelism (each contender's own process would need every rank)",
              file=sys.stderr)
    if not args.no_memory:  # after the timings, each contender alone in a fresh process
        for row, c in zip(rows, contenders, strict=True):
            spec = MemorySpec(c.name, c.plugin, str(path), args.dtype, args.device, prompt_ids, args.new_tokens,
                              cache=args.cache, use_kv_cache=c.name != "infer[no cache]",
                              compute_dtype=args.compute_dtype, fused_projections=args.fused_projections,
                              decode_gemv=args.decode_gemv, huge_pages=not args.no_huge_pages,
                              native_ops=not args.no_native_ops, native_step=not args.no_native_step,
                              weights=args.weights, group_size=args.group_size)
            print(f"measuring the memory of {c.name} in its own process", file=sys.stderr)
            figures = measure_memory(spec)
            row["peak_mib"], row["own_mib"] = figures.peak_bytes / 2**20, figures.own_bytes / 2**20
            baseline_mib = figures.baseline_bytes / 2**20

    print(f"\nmodel {path} ({config.model_type}), {dtype}, {device}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, {args.trials} trials")
    print(format_table(rows, ["name", "ttft_ms", "prompt_tok_s", "decode_tok_s", "step_p50_ms", "step_p95_ms",
                              "step_p99_ms", "step_min_ms", "step_max_ms", *[f"step@{p}_ms" for p in positions],
                              "cache_mib", *(["peak_mib", "own_mib"] if not args.no_memory else []),
                              "roofline_fraction"]))
    if baseline_mib is not None:
        print(f"memory: peak_mib is each contender's peak resident set alone in a fresh process (on CUDA, peak "
              f"allocated), own_mib that minus the process's {baseline_mib:.0f} MiB after importing torch")
    print(f"roofline: {bytes_per_step / 1e6:.1f} MB read per decode step at context {mid_context}; "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s, the best of "
          f"{', '.join(f'{k} {v / 1e9:.1f}' for k, v in read_rates.items())} (copy {copy_bandwidth / 1e9:.1f}); "
          f"floor {bytes_per_step / bandwidth * 1e3:.1f} ms/step")
    ratios = _ratios(rows)
    for line in ratios:
        print(line)
    print(f"choices (threads {torch.get_num_threads()}):")
    for choice in CHOICES.values():
        print(f"  {choice.name}: {choice.value} ({choice.reason})")
    report = {
        "machine": machine_info(), "choices": [asdict(c) for c in CHOICES.values()],
        "units": {"ttft_ms": "ms", "prompt_tok_s": "tokens/s", "decode_tok_s": "tokens/s", "step_*_ms": "ms",
                  "cache_mib": "MiB", "peak_mib": "MiB (the contender alone in a fresh process)",
                  "own_mib": "MiB (peak_mib minus the process after importing torch)",
                  "process_peak_mib": "MiB (the bench process, all contenders loaded)", "baseline_mib": "MiB",
                  "bandwidth_bytes_s": "bytes/s",
                  "bytes_per_decode_step": "bytes", "roofline_fraction": "fraction of read bandwidth",
                  "copy_bandwidth_bytes_s": "bytes/s (read + written)",
                  "read_bandwidth_by_method_bytes_s": "bytes/s", "read_buffer_bytes": "bytes"},
        "model": str(path), "dtype": str(dtype), "device": str(device), "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "trials": args.trials, "bandwidth_bytes_s": bandwidth,
        "copy_bandwidth_bytes_s": copy_bandwidth, "read_bandwidth_by_method_bytes_s": read_rates,
        "read_buffer_bytes": read_buffer_bytes(device),
        "bytes_per_decode_step": bytes_per_step, "baseline_mib": baseline_mib, "results": rows, "ratios": ratios,
        "contenders": {c.name: [asdict(t) for t in c.trials] for c in contenders},
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {args.plot}" if plot_steps(contenders, args.prompt_len, Path(args.plot))
              else "matplotlib is not installed: no plot (pip install matplotlib)")
    return 0


def cache_kind_table(
    model: Transformer, kinds: list[str], contexts: list[int], new_tokens: int, seed: int = 0
) -> list[dict[str, float | str]]:
    """Per cache kind and context: bytes held and decode tokens/s over `new_tokens` greedy steps.

    The prompt is prefilled once per context into a contiguous cache; every kind is then filled with
    the same K/V through its own `update` (what a prefill would write), so a 4k context costs one
    prefill, not one per kind.
    """
    from infer.cache import create_cache

    config = model.config
    weight = model.norm.weight  # the activations' dtype and device
    rows: list[dict[str, float | str]] = []
    for context in contexts:
        ids = torch.randint(0, config.vocab_size, (1, context), generator=torch.Generator().manual_seed(seed))
        source = create_cache("contiguous", config, max_seq_len=context, dtype=weight.dtype, device=weight.device)
        with torch.inference_mode():
            first = model(ids.to(weight.device), source).argmax(-1)
        k_all, v_all = source.k_cache, source.v_cache  # type: ignore[attr-defined]
        for kind in kinds:
            cache = create_cache(kind, config, max_seq_len=context + new_tokens, dtype=weight.dtype,
                                 device=weight.device)
            with torch.inference_mode():
                for layer in range(config.num_hidden_layers):
                    cache.update(layer, k_all[layer], v_all[layer])
                cache.advance(context)
                token, times = first.view(1, 1), []
                for _ in range(new_tokens):
                    synchronize(weight.device)
                    start = time.perf_counter()
                    token = model(token, cache)[:, -1].argmax(-1, keepdim=True)
                    token.item()
                    times.append(time.perf_counter() - start)
            rows.append({"cache": kind, "context": context, "cache_mib": cache.memory_bytes / 2**20,
                         "decode_tok_s": len(times) / sum(times), "step_p50_ms": percentile(times, 50) * 1e3})
    return rows


def _ratios(rows: list[dict[str, float | str]]) -> list[str]:
    engine = rows[0]
    lines = []
    for row in rows[1:]:
        decode = float(engine["decode_tok_s"]) / float(row["decode_tok_s"])
        ttft = float(row["ttft_ms"]) / float(engine["ttft_ms"])
        lines.append(f"{engine['name']} vs {row['name']}: decode {speed_ratio(decode)}, "
                     f"time to first token {speed_ratio(ttft)}")
    return lines


def _bench_checkpoint(arch: str, size: str) -> Path:
    build = plugin(CHECKPOINT_PLUGINS, "random")
    return Path(build(arch, size=size))


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """Register the `bench` subcommand (its options shared with `generate` from `infer.cli_args`)."""
    from infer.cache import CACHE_KINDS

    p = sub.add_parser("bench", help="benchmark generation (optionally against Hugging Face)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(p, dtype="bfloat16")  # --model: default the bench-sized --arch checkpoint
    p.add_argument("--arch", default="llama", choices=list(ARCHITECTURES),
                   help="which bench-sized random checkpoint to build and use when --model is not given")
    p.add_argument("--size", default="1b", choices=["1b", "150m"],
                   help="bench checkpoint size (150m: llama, qwen3, gemma3_text)")
    p.add_argument("--cache", default="contiguous", choices=sorted(CACHE_KINDS), help="KV-cache kind")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--max-new-tokens", "--new-tokens", dest="new_tokens", type=int, default=128,
                   help="decode steps per trial (--new-tokens is the old name)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per contender")
    p.add_argument("--trials", type=int, default=3, help="timed runs per contender, alternating")
    p.add_argument("--positions", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 128],
                   help="decode steps whose latency to report (comma-separated)")
    p.add_argument("--compare", action="store_true", help="also run without the KV cache")
    p.add_argument("--fused-projections", action="store_true",
                   help="run the engine with q/k/v and gate/up fused (model.fused_projections; not bit-exact)")
    p.add_argument("--against-hf", action="store_true", help="also run transformers (dynamic and static cache)")
    p.add_argument("--against", action="append", default=[], metavar="NAME",
                   help="also run the installed contender plugin NAME (repeatable; 'hf' is --against-hf)")
    p.add_argument("--cache-table", default=None, metavar="KINDS",
                   help="instead: a table of cache bytes and decode tok/s for these comma-separated kinds")
    p.add_argument("--contexts", default="512,4096", help="contexts of --cache-table (comma-separated)")
    add_batched_args(p)
    p.add_argument("--no-memory", action="store_true",
                   help="skip measuring each contender's peak memory in its own process (after the timings)")
    p.add_argument("--json", default=None, help="write the full report here")
    p.add_argument("--plot", default=None, help="write a PNG of per-step latency against position (with "
                   "--batched: every step against the roofline)")
    p.set_defaults(seed=0)
    p.set_defaults(run=run_bench)
