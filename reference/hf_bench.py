"""Hugging Face `transformers` as benchmark contenders, on the same checkpoint and in the same process.

Each contender is a hand-written greedy loop (no `generate()` bookkeeping), with `logits_to_keep=1`
as `generate()` itself uses: the fastest way a user can drive HF, so the engine's ratios are not
flattered. Two caches: the default `DynamicCache` (grows by `torch.cat`) and `StaticCache`; on CUDA also the
static cache with the decode step compiled by `torch.compile(mode="reduce-overhead")` (CUDA graphs), the
fast path Hugging Face documents.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, Cache, DynamicCache, PreTrainedModel, StaticCache

from infer.bench_batched import BatchedRun, BatchRequest, request_params
from infer.bench_common import Contender, Trial, peak_memory_bytes
from reference.sampling import hf_logits_processors


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_greedy_trial(model: PreTrainedModel, cache_kind: str, prompt_ids: list[int], new_tokens: int,
                    cache: Cache | None = None, decode: Callable[..., Any] | None = None) -> Trial:
    """One timed greedy generation with HF's model and the named cache (or `cache` itself, reset first);
    `decode`: what runs the one-token steps (default: the model; a compiled forward for the compiled one)."""
    device = next(model.parameters()).device
    n = len(prompt_ids)
    ids = torch.tensor([prompt_ids], device=device)
    step = model if decode is None else decode
    with torch.inference_mode():
        if cache is not None:
            cache.reset()
        elif cache_kind == "static":
            cache = StaticCache(config=model.config, max_cache_len=n + new_tokens)
        else:
            cache = DynamicCache(config=model.config)
        _sync(device)
        start = time.perf_counter()
        out = model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(n, device=device),
                    logits_to_keep=1, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        token.item()
        ttft = time.perf_counter() - start
        steps = []
        for i in range(new_tokens - 1):
            start = time.perf_counter()
            position = torch.tensor([n + i], device=device)
            out = step(input_ids=token, past_key_values=cache, cache_position=position, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            token.item()
            steps.append(time.perf_counter() - start)
    cache_bytes = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            cache_bytes += t.nbytes if isinstance(t, torch.Tensor) else 0
    return Trial(ttft, n, steps, cache_bytes, peak_memory_bytes(device))


def hf_contenders(
    path: Path, dtype: torch.dtype, device: torch.device, prompt_ids: list[int], new_tokens: int
) -> list[Contender]:
    """HF with its dynamic cache and with its static cache, sharing one loaded model."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(device).eval()
    contenders = [
        Contender(f"hf[{kind}]", lambda kind=kind: hf_greedy_trial(model, kind, prompt_ids, new_tokens))  # type: ignore[misc]
        for kind in ("dynamic", "static")
    ]
    if device.type == "cuda":
        contenders.append(hf_compiled_contender(model, prompt_ids, new_tokens))
    return contenders


def hf_compiled_contender(model: PreTrainedModel, prompt_ids: list[int], new_tokens: int,
                          mode: str = "reduce-overhead") -> Contender:
    """HF's static cache with the one-token step compiled (`torch.compile(model.forward, mode=mode,
    fullgraph=True)`, as HF's docs show); prefill stays eager. One cache serves every trial (reset each time):
    the compiled step specialises on the cache's tensors, so a new cache per trial would recompile. The bench's
    warm-up trial pays the compilation."""
    cache = StaticCache(config=model.config, max_cache_len=len(prompt_ids) + new_tokens)
    step = torch.compile(model.forward, mode=mode, fullgraph=True)
    return Contender(f"hf[static+compile:{mode}]",
                     lambda: hf_greedy_trial(model, "static", prompt_ids, new_tokens, cache=cache, decode=step))


def hf_static_batches(model: PreTrainedModel, work: list[BatchRequest], batch_size: int) -> BatchedRun:
    """Static batching as users do it with `transformers`: requests in arrival order, `batch_size` at a time,
    left-padded with an attention mask, greedy or sampled as the workload says (HF's logits processors and
    `torch.multinomial`, as `generate(do_sample=True)` samples), each batch run until its longest request is done
    (a hand-written loop doing what `generate()` does, without its bookkeeping). A request's first token
    comes with its batch's prefill; its result, with the end of its batch."""
    device = next(model.parameters()).device
    params = request_params(work[0])  # (the workload's settings: every request's)
    processors = hf_logits_processors(params)

    def pick(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # (`ids`: the prompts; the workload's settings take no repetition penalty, which would read the tokens)
        if params.is_greedy:
            return logits.argmax(-1, keepdim=True)
        scores = processors(cast(torch.LongTensor, ids), cast(torch.FloatTensor, logits.float()))
        return torch.multinomial(scores.softmax(-1), 1)

    ttft: list[float] = []
    latency: list[float] = []
    start = time.perf_counter()
    for b in range(0, len(work), batch_size):
        batch = work[b : b + batch_size]
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[0] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch], device=device)
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch],
                            device=device)
        steps = max(r.max_new_tokens for r in batch)
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                        logits_to_keep=1, use_cache=True)
            token = pick(out.logits[:, -1], ids)
            token.tolist()
            first = time.perf_counter() - start
            last = positions[:, -1:]
            for _ in range(steps - 1):
                mask = torch.cat([mask, mask.new_ones(len(batch), 1)], dim=1)
                last = last + 1
                out = model(input_ids=token, attention_mask=mask, position_ids=last, past_key_values=cache,
                            use_cache=True)
                token = pick(out.logits[:, -1], ids)
            token.tolist()
        done = time.perf_counter() - start
        ttft += [first] * len(batch)
        latency += [done] * len(batch)
    wall = time.perf_counter() - start
    return BatchedRun(f"hf static batches[{batch_size}]", wall, ttft, latency, sum(r.max_new_tokens for r in work))


def hf_batched_contender(
    path: Path, dtype: torch.dtype, device: torch.device, batch_size: int
) -> tuple[str, Callable[[list[BatchRequest]], BatchedRun]]:
    """`bench --batched --against hf`: HF static batching on the same checkpoint."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(device).eval()
    return f"hf static batches[{batch_size}]", lambda work: hf_static_batches(model, work, batch_size)
