"""One rank of the tensor-parallel tests (tests/test_tensor_parallel.py): started by torch.multiprocessing with gloo
on the CPU, it loads its shard of each case's model and writes what the test compares with one process (logits,
tokens, its bytes) to `out/rank{r}.pt`. Comparisons happen in the test's own process, against models it loads
itself."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

PREFILL = [3, 5, 7, 11, 13, 17, 19]  # fed as two chunks, 4 + 3
STEPS = [23, 29, 31, 37, 41]  # one-token steps after it
# Shared prefixes, and a prompt found whole in the prefix cache while its first run holds the blocks (its last token
# is recomputed into a copy-on-write copy: one copy in this schedule, and one preemption in a pool of 7 blocks).
ENGINE_PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12], [40, 41]]


@dataclass(frozen=True)
class Case:
    """One model to load sharded: a checkpoint (or GGUF file) and load_model's options."""

    name: str
    path: Path
    options: dict[str, Any] = field(default_factory=dict)
    kinds: tuple[str, ...] = ("contiguous", "sliding", "paged")
    engine: bool = True
    native_step: bool = False  # turned on after the load, as a user might: the whole-step call must stay out


def teacher_forced(model: Any, kind: str) -> torch.Tensor:
    """Logits of PREFILL (every position, two chunks) and of each of STEPS, through a cache of `kind`:
    `[len(PREFILL) + len(STEPS), vocab]`."""
    import infer

    cache = infer.create_cache(kind, model.config, max_seq_len=32, dtype=model.dtype, device=model.device)
    rows = []
    with torch.inference_mode():
        for chunk in (PREFILL[:4], PREFILL[4:], *([t] for t in STEPS)):
            rows.append(model(torch.tensor([chunk], device=model.device), cache, all_logits=True)[0])
    return torch.cat(rows).float().cpu()


def run_rank(rank: int, world: int, init_file: str, cases: list[Case], out: str, timeout_s: float) -> None:
    """Every case on this rank, results to `out/rank{rank}.pt`."""
    import infer
    from infer.engine import Engine
    from infer.sampling import SamplingParams

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    results: dict[str, Any] = {}
    for case in cases:
        model = infer.load_model(case.path, tensor_parallel=True, **case.options)
        model.native_step = model.native_step or case.native_step
        got: dict[str, Any] = {"weight_bytes": sum(t.nbytes for t in model.state_dict().values())}
        for kind in case.kinds:
            got[kind] = teacher_forced(model, kind)
        cache = infer.create_cache("contiguous", model.config, max_seq_len=32, dtype=model.dtype)
        got["cache_bytes"] = cache.memory_bytes
        got["greedy"] = infer.generate(model, None, PREFILL, SamplingParams(max_new_tokens=8, temperature=0.0,
                                                                            ignore_eos=True)).token_ids
        # No seed: each rank's sampler state differs; rank 0's tokens must be every rank's.
        got["sampled"] = infer.generate(model, None, PREFILL, SamplingParams(max_new_tokens=8, temperature=1.0,
                                                                             ignore_eos=True)).token_ids
        if case.engine:
            engine = Engine(model, None, num_blocks=7, block_size=4, max_num_seqs=3, max_num_batched_tokens=8,
                            keep_logits=True)
            if rank == 0:
                params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
                done = engine.generate(ENGINE_PROMPTS, params)
                engine.close()
                got["engine"] = [(r.token_ids, None if r.logits is None else r.logits.cpu()) for r in done]
                got["engine_preemptions"] = engine.stats.preemptions
            else:
                try:
                    engine.add_request([1, 2, 3])
                except ValueError as e:
                    got["follower_refused"] = str(e)
                frozen: list[int] = []

                def watched(*args: Any, forward: Any = engine._forward_ragged, seen: list[int] = frozen,
                            **kwargs: Any) -> Any:
                    seen.append(gc.get_freeze_count())
                    return forward(*args, **kwargs)

                engine._forward_ragged = watched  # type: ignore[method-assign]
                engine.follow()
                got["follower_frozen"] = bool(frozen) and all(frozen) and not gc.get_freeze_count()
        results[case.name] = got
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown: gloo's worker threads can abort it (as infer's CLI does under torchrun)


def fail_rank(rank: int, world: int, init_file: str, path: str, out: str, timeout_s: float) -> None:
    """Rank 1 dies before its first step; rank 0 records what its first collective raised, and when."""
    import time

    import infer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    model = infer.load_model(path, tensor_parallel=True)
    if rank == 1:
        raise SystemExit(3)
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            model(torch.tensor([PREFILL]))
        error = None
    except Exception as e:  # noqa: BLE001 (recorded for the test to judge)
        error = f"{type(e).__name__}: {e}"
    torch.save({"error": error, "seconds": time.perf_counter() - start}, Path(out) / "rank0.pt")
    os._exit(0)
