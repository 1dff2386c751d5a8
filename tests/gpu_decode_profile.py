"""Where a batch-1 decode step's time goes on CUDA, at the Llama-3.2-1B shapes: the kernels of an eager step
(torch.profiler, the top ones by device time), the graph-replayed step against their sum, and each projection
shape's one-row product through F.linear, torch.mv and the Triton GEMV, as fractions of the read bandwidth.
A lease is short: this prints one table per question and nothing else.

    python tests/gpu_decode_profile.py [--context 576,8192] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def timed_ms(fn: object, repeat: int = 50) -> float:
    """Median milliseconds of `fn()` by CUDA events, after warm-ups."""
    for _ in range(5):
        fn()  # type: ignore[operator]
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()  # type: ignore[operator]
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def profile_context(model: object, context: int) -> dict[str, float]:
    """One table: the eager step's top kernels after `context` cached tokens, and the graph replay's time (with
    the attention kernel and with masked attention); the figures as a row."""
    import infer
    from infer.graphs import GraphedDecoder

    config = model.config  # type: ignore[attr-defined]
    cache = infer.create_cache("contiguous", config, max_seq_len=context + 64, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, config.vocab_size, (1, context), device="cuda")
    with torch.no_grad():
        model(ids, cache)  # type: ignore[operator]
        token = ids[:, -1:]
        eager_ms = timed_ms(lambda: model(token, cache), repeat=20)  # type: ignore[operator]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                model(token, cache)  # type: ignore[operator]  # rewrites the same slot: no advance
            torch.cuda.synchronize()
        replay_ms = {}
        for kernel in (True, False):  # the step's attention: the Triton kernel, or every slot under a mask
            model.static_attention_kernel = kernel  # type: ignore[attr-defined]
            graphed = GraphedDecoder(model, cache)  # type: ignore[arg-type]
            graphed.step(token)
            graph = graphed.graph
            replay_ms[kernel] = timed_ms(graph.replay) if graph is not None else float("nan")
        model.static_attention_kernel = True  # type: ignore[attr-defined]
        graph_ms = replay_ms[True]
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events) / 5 / 1e3
    print(f"\ncontext {context}: eager step {eager_ms:.3f} ms, graph replay {graph_ms:.3f} ms (masked attention "
          f"over every slot: {replay_ms[False]:.3f} ms), kernel time per eager step {total:.3f} ms "
          f"({len(events)} kernel kinds)")
    print(f"{'kernel':70s} {'calls/step':>10s} {'ms/step':>8s}")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:14]:
        print(f"{e.key[:70]:70s} {e.count / 5:10.1f} {e.device_time_total / 5 / 1e3:8.3f}", flush=True)
    return {"context": context, "eager_ms": eager_ms, "graph_ms": graph_ms, "graph_masked_ms": replay_ms[False],
            "kernel_ms": total, "launches": sum(e.count for e in events) / 5}


SWEEP = [(1, 1024), (2, 1024), (4, 512), (8, 512), (16, 256), (4, 1024), (8, 256), (2, 2048)]


def sweep_shape(out_f: int, in_f: int, bandwidth: float) -> dict[str, float]:
    """One row: a one-row product of shape [out_f, in_f] by each form, as a fraction of the read bandwidth."""
    from infer.kernels.gemv import triton_gemv

    weights = [torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    x = torch.randn(in_f, device="cuda", dtype=torch.bfloat16)
    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "linear": lambda w: torch.nn.functional.linear(x[None], w), "mv": lambda w: torch.mv(w, x),
        "triton": lambda w: triton_gemv(w, x)}
    for blocks in SWEEP:
        fns[str(blocks)] = functools.partial(lambda w, b: triton_gemv(w, x, b), b=blocks)
    fraction = {}
    for name, fn in fns.items():
        ms = timed_ms(lambda fn=fn: [fn(w) for w in weights]) / len(weights)
        fraction[name] = out_f * in_f * 2 / (ms / 1e3) / bandwidth
    best = max((b for b in fraction if b.startswith("(")), key=fraction.__getitem__)
    print(f"{str([out_f, in_f]):18s} {fraction['linear']:9.2f} {fraction['mv']:9.2f} {fraction['triton']:9.2f} "
          f"{fraction[best]:11.2f} {best}", flush=True)
    return {"out": out_f, "in": in_f, **fraction}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", default="576,8192", help="cached tokens before the profiled steps")
    parser.add_argument("--json", default=None, help="write the figures here (rows per context, per shape)")
    args = parser.parse_args()
    import infer
    from infer.bench_common import measure_read_bandwidth
    from reference.checkpoints import build_bench_checkpoint

    began = time.perf_counter()
    model = infer.load_model(build_bench_checkpoint("llama"), dtype="bfloat16", device="cuda")
    print(f"model loaded in {time.perf_counter() - began:.0f} s; decode GEMV: {model.decode_gemv}", flush=True)
    bandwidth, _ = measure_read_bandwidth(torch.device("cuda"))
    # Every weight but the embedding table, which a step reads one row of, unless it is the tied LM head.
    tied = model.config.tie_word_embeddings
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if tied or "embed" not in n)
    print(f"read bandwidth {bandwidth / 1e9:.0f} GB/s; weights read per step {weight_bytes / 1e9:.2f} GB: "
          f"floor {weight_bytes / bandwidth * 1e3:.3f} ms")
    rows = [profile_context(model, int(c)) for c in args.context.split(",")]
    print(f"\n{'shape [out, in]':18s} {'F.linear':>9s} {'mv':>9s} {'triton':>9s} {'best swept':>11s} blocks"
          "   (fractions of the read bandwidth)")
    config = model.config
    h, kv, f = config.hidden_size, config.num_key_value_heads * config.head_dim, config.intermediate_size
    shapes = [sweep_shape(o, i, bandwidth) for o, i in ((h, h), (kv, h), (f, h), (h, f), (2 * f, h),
                                                        (config.vocab_size, h))]
    if args.json:
        Path(args.json).write_text(json.dumps({"bandwidth_bytes_s": bandwidth, "weight_bytes": weight_bytes,
                                               "results": rows, "one_row_products": shapes}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
