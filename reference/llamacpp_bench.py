"""llama.cpp as a bench contender (`python -m infer bench --against llama.cpp`, and `bench --batched --against
llama.cpp`), on the same weights: a GGUF file as it is, or the checkpoint converted to GGUF in the bench's dtype
(reference/gguf_convert.py), driven greedily through llama-cpp-python with the engine's thread count. Needs
`pip install -e ".[llamacpp]"` (llama-cpp-python builds llama.cpp from source with cmake)."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infer.bench_batched import BatchedRun, BatchRequest
from infer.bench_common import Contender, Trial, peak_memory_bytes
from infer.gguf import find_gguf
from infer.sampling import GREEDY_BELOW
from reference.gguf_convert import cached_gguf


def next_token(llm: Any) -> int:
    """Greedy: the argmax of the logits llama.cpp computed for the last evaluated token (read in place:
    without logits_all, llama-cpp-python keeps no copy)."""
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))


def _gguf_for(path: Path, dtype: torch.dtype) -> tuple[Path, str]:
    """The file llama.cpp runs for `path` and its label: a GGUF file as it is (its own quantization), else the
    checkpoint converted in `dtype`."""
    stored = find_gguf(Path(path))
    if stored is not None:
        return stored, f"{stored.name.rsplit('.', 2)[-2]} file"
    return cached_gguf(path, dtype), str(dtype).removeprefix("torch.")


def _import_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError as e:
        raise ValueError(f"llama.cpp is not installed ({e}); pip install -e '.[llamacpp]'") from e
    return llama_cpp


def llamacpp_contenders(
    path: Path, dtype: torch.dtype, device: torch.device, prompt_ids: list[int], new_tokens: int
) -> list[Contender]:
    """One contender: llama.cpp on the CPU with the GGUF of `path` in `dtype`."""
    Llama = _import_llama_cpp().Llama
    if device.type != "cpu":
        raise ValueError("the llama.cpp contender runs on the CPU only; use --device cpu")
    gguf_path, label = _gguf_for(path, dtype)
    llm = Llama(model_path=str(gguf_path), n_ctx=len(prompt_ids) + new_tokens + 8, n_batch=max(len(prompt_ids), 8),
                n_threads=torch.get_num_threads(), n_threads_batch=torch.get_num_threads(), verbose=False,
                use_extra_bufts=False)  # the AMX repacking path crashed on the Intel machines

    def run() -> Trial:
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt_ids)
        token = next_token(llm)
        ttft = time.perf_counter() - start
        steps = []
        for _ in range(new_tokens - 1):
            start = time.perf_counter()
            llm.eval([token])
            token = next_token(llm)
            steps.append(time.perf_counter() - start)
        config = llm.metadata
        cache_bytes = 0
        if config:
            layers = int(config.get("llama.block_count", 0))
            kv = int(config.get("llama.attention.head_count_kv", 0)) * int(config.get("llama.attention.key_length", 0))
            cache_bytes = 2 * layers * kv * llm.n_ctx() * 2  # llama.cpp's default f16 KV cache
        return Trial(ttft, len(prompt_ids), steps, cache_bytes, peak_memory_bytes(device))

    return [Contender(f"llama.cpp[{label}]", run)]


# ---- many requests at once: llama.cpp's continuous batching, as llama-server runs its slots ----

# Sequences llama.cpp decodes at once (the engine's default max_num_seqs), and tokens a llama_decode call takes
# (llama-server's default micro-batch).
PARALLEL = 64
TOKEN_BUDGET = 512


@dataclass
class _Slot:
    """One request in a llama.cpp sequence: how much of its prompt is fed, the tokens it has picked."""

    index: int  # the request's place in the workload
    request: BatchRequest
    fed: int = 0  # prompt tokens decoded so far
    generated: list[int] = field(default_factory=list)


def llamacpp_continuous_batching(llama_cpp: Any, model: Any, work: list[BatchRequest], threads: int,
                                 parallel: int = PARALLEL, budget: int = TOKEN_BUDGET, unified: bool = False,
                                 flash: bool = True, name: str = "llama.cpp") -> tuple[BatchedRun, list[list[int]]]:
    """The workload through llama.cpp as llama-server serves it: up to `parallel` requests in sequences, each
    llama_decode call a batch of every running request's last token and then prompt tokens up to `budget` in all
    (a prompt longer than what is left goes on in the next call), a request admitted in arrival order when a
    sequence frees and its sequence cleared when it ends; greedy, every request exactly its `max_new_tokens` (no
    end token stops it). Each sequence its own KV cache (`unified`: one cache of every sequence's cells, which
    each token's attention then walks) and flash attention (`flash`): the fastest of the four on SmolLM2's Q4_1
    file, 16 requests of 128 tokens on a 2-core Zen 4 (210-236 tok/s against 159-207 for the others; llama.cpp's
    own defaults are one sequence and its choice of attention). The context is made before the clock starts.
    Returns the run and each request's tokens."""
    if any(r.sampling.temperature >= GREEDY_BELOW for r in work):
        raise ValueError("the llama.cpp batched contender runs greedy workloads only; drop --temperature")
    parallel = min(parallel, len(work))
    longest = sorted((len(r.prompt_ids) + r.max_new_tokens for r in work), reverse=True)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = (sum(longest[:parallel]) if unified else longest[0] * parallel) + 16 * parallel
    params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash
                              else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    params.n_batch = params.n_ubatch = budget
    params.n_seq_max = parallel
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = unified
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        raise ValueError(f"llama.cpp could not make a context of {params.n_ctx} tokens for {parallel} sequences")
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(budget + parallel, 0, 1)
    try:
        waiting: deque[_Slot] = deque(_Slot(i, r) for i, r in enumerate(work))
        free = list(range(parallel - 1, -1, -1))  # sequence ids, the lowest handed out first
        running: dict[int, _Slot] = {}
        done: list[_Slot] = []
        ttft = [0.0] * len(work)
        latency = [0.0] * len(work)
        start = time.perf_counter()
        while waiting or running:
            while waiting and free:
                running[free.pop()] = waiting.popleft()
            # (sequence, position, token, whether its logits pick the sequence's next token): the decoding requests'
            # last tokens first, then prompt tokens, as llama-server fills its batch
            rows = [(seq, len(slot.request.prompt_ids) + len(slot.generated) - 1, slot.generated[-1], True)
                    for seq, slot in running.items() if slot.generated]
            for seq, slot in running.items():
                prompt = slot.request.prompt_ids
                take = min(len(prompt) - slot.fed, budget - len(rows))
                rows += [(seq, i, prompt[i], i == len(prompt) - 1) for i in range(slot.fed, slot.fed + take)]
                slot.fed += take
            for n, (seq, pos, token, wanted) in enumerate(rows):
                batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.logits[n] = token, pos, 1, wanted
                batch.seq_id[n][0] = seq
            batch.n_tokens = len(rows)
            outputs = [seq for seq, _, _, wanted in rows if wanted]
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise ValueError(f"llama.cpp's llama_decode failed on a batch of {len(rows)} tokens")
            scores = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(len(outputs), vocab))
            picked = scores.argmax(axis=1).tolist()
            now = time.perf_counter() - start
            for seq, token in zip(outputs, picked, strict=True):
                slot = running[seq]
                if not slot.generated:
                    ttft[slot.index] = now
                slot.generated.append(int(token))
                if len(slot.generated) == slot.request.max_new_tokens:
                    latency[slot.index] = now
                    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), seq, -1, -1)
                    done.append(running.pop(seq))
                    free.append(seq)
        wall = time.perf_counter() - start
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
    tokens: list[list[int]] = [[] for _ in work]
    for slot in done:
        tokens[slot.index] = slot.generated
    return BatchedRun(name, wall, ttft, latency, sum(r.max_new_tokens for r in work)), tokens


def llamacpp_batched_contender(
    path: Path, dtype: torch.dtype, device: torch.device, batch_size: int
) -> tuple[str, Callable[[list[BatchRequest]], BatchedRun]]:
    """`bench --batched --against llama.cpp`: llama.cpp's continuous batching (`llamacpp_continuous_batching`) on
    the GGUF of `path` (`batch_size` is the static-batching contenders'; llama.cpp runs up to PARALLEL sequences, as
    the engine runs up to its max_num_seqs)."""
    llama_cpp = _import_llama_cpp()
    if device.type != "cpu":
        raise ValueError("the llama.cpp contender runs on the CPU only; use --device cpu")
    gguf_path, label = _gguf_for(path, dtype)
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # (llama.cpp's load and context logs: quiet)
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.use_extra_bufts = False  # the AMX repacking path crashed on the Intel machines
    model = llama_cpp.llama_model_load_from_file(str(gguf_path).encode(), params)
    if not model:
        raise ValueError(f"llama.cpp could not load {gguf_path}")
    threads = torch.get_num_threads()
    name = f"llama.cpp[{label}]"

    def run(work: list[BatchRequest]) -> BatchedRun:
        return llamacpp_continuous_batching(llama_cpp, model, work, threads, name=name)[0]

    return name, run
