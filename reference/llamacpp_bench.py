"""llama.cpp as a bench contender (`python -m infer bench --against llama.cpp`), on the same weights: the
checkpoint converted to GGUF in the bench's dtype (reference/gguf_convert.py), driven greedily through
llama-cpp-python with the engine's thread count. Needs `pip install -e ".[llamacpp]"` (llama-cpp-python
builds llama.cpp from source with cmake)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infer.bench_common import Contender, Trial, peak_memory_bytes
from infer.gguf import find_gguf
from reference.gguf_convert import cached_gguf


def next_token(llm: Any) -> int:
    """Greedy: the argmax of the logits llama.cpp computed for the last evaluated token (read in place:
    without logits_all, llama-cpp-python keeps no copy)."""
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))


def llamacpp_contenders(
    path: Path, dtype: torch.dtype, device: torch.device, prompt_ids: list[int], new_tokens: int
) -> list[Contender]:
    """One contender: llama.cpp on the CPU with the GGUF of `path` in `dtype`."""
    try:
        from llama_cpp import Llama
    except ImportError as e:
        raise ValueError(f"llama.cpp is not installed ({e}); pip install -e '.[llamacpp]'") from e
    if device.type != "cpu":
        raise ValueError("the llama.cpp contender runs on the CPU only; use --device cpu")
    stored = find_gguf(Path(path))  # a GGUF file is run as it is (its own quantization), else the conversion
    gguf_path = stored if stored is not None else cached_gguf(path, dtype)
    label = f"{gguf_path.name.rsplit('.', 2)[-2]} file" if stored is not None else str(dtype).removeprefix('torch.')
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
