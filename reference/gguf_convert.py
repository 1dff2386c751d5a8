"""A Hugging Face Llama checkpoint as a GGUF file, so llama.cpp runs the very weights the engine runs.

Written with the `gguf` package (llama.cpp's own writer), after llama.cpp's `convert_hf_to_gguf.py`:
tensor names `token_embd`, `blk.N.attn_q`, ...; q/k rows permuted from Hugging Face's rotate-half RoPE
layout to llama.cpp's interleaved one; Llama 3 RoPE scaling as a `rope_freqs` tensor. The bench feeds
token ids, so the vocabulary is placeholder strings (`<t0>`, `<t1>`, ...) of the model's size. Only Llama:
Qwen 3 and Gemma 3 are refused with a clear error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from infer.config import ModelConfig

DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def permute_for_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q or k projection from HF's rotate-half order to llama.cpp's interleaved pairs."""
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def unpermute_for_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute_for_rope`."""
    return (weight.reshape(n_head, weight.shape[0] // n_head // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def llama3_rope_factors(config: ModelConfig) -> np.ndarray | None:
    """Per-frequency divisors of Llama 3's RoPE scaling (llama.cpp's `rope_freqs`), None without it."""
    rope = config.rope
    if rope.rope_type != "llama3":
        return None
    dim = config.head_dim
    freqs = 1.0 / (rope.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope.factor)
        else:
            smooth = ((rope.original_max_position_embeddings / wavelen - rope.low_freq_factor)
                      / (rope.high_freq_factor - rope.low_freq_factor))
            factors.append(1 / ((1 - smooth) / rope.factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def hf_to_gguf(path: str | Path, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the checkpoint at `path` as a GGUF file `out` with weights in `dtype` (bf16, f16 or f32)."""
    import gguf

    path, out = Path(path), Path(out)
    config = ModelConfig.from_file(path)
    if config.model_type != "llama":
        raise ValueError(f"GGUF conversion supports Llama checkpoints only, got {config.model_type!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype}")
    kind = getattr(gguf.GGMLQuantizationType, DTYPES[dtype])
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(path.name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope.theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type({"BF16": gguf.LlamaFileType.MOSTLY_BF16, "F16": gguf.LlamaFileType.MOSTLY_F16,
                          "F32": gguf.LlamaFileType.ALL_F32}[DTYPES[dtype]])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([f"<t{i}>" for i in range(config.vocab_size)])
    writer.add_token_types([gguf.TokenType.NORMAL] * config.vocab_size)
    writer.add_token_merges(["<t0> <t1>"])  # llama.cpp needs the key; ids are fed, never text
    writer.add_bos_token_id(config.bos_token_id if config.bos_token_id is not None else 0)
    writer.add_eos_token_id(config.eos_token_ids[0] if config.eos_token_ids else 0)

    def put(name: str, tensor: torch.Tensor, keep_f32: bool = False) -> None:
        data = tensor.float().numpy()
        if keep_f32 or kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, data.astype(np.float32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    weights = tensor_reader(path)
    put("token_embd.weight", weights("model.embed_tokens.weight"))
    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}."
        q = permute_for_rope(weights(pre + "self_attn.q_proj.weight").float().numpy(), heads)
        k = permute_for_rope(weights(pre + "self_attn.k_proj.weight").float().numpy(), kv_heads)
        put(f"blk.{i}.attn_q.weight", torch.from_numpy(q))
        put(f"blk.{i}.attn_k.weight", torch.from_numpy(k))
        put(f"blk.{i}.attn_v.weight", weights(pre + "self_attn.v_proj.weight"))
        put(f"blk.{i}.attn_output.weight", weights(pre + "self_attn.o_proj.weight"))
        put(f"blk.{i}.ffn_gate.weight", weights(pre + "mlp.gate_proj.weight"))
        put(f"blk.{i}.ffn_up.weight", weights(pre + "mlp.up_proj.weight"))
        put(f"blk.{i}.ffn_down.weight", weights(pre + "mlp.down_proj.weight"))
        put(f"blk.{i}.attn_norm.weight", weights(pre + "input_layernorm.weight"), keep_f32=True)
        put(f"blk.{i}.ffn_norm.weight", weights(pre + "post_attention_layernorm.weight"), keep_f32=True)
    put("output_norm.weight", weights("model.norm.weight"), keep_f32=True)
    if not config.tie_word_embeddings:
        put("output.weight", weights("lm_head.weight"))
    factors = llama3_rope_factors(config)
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def tensor_reader(path: Path) -> Callable[[str], torch.Tensor]:
    """Read any tensor of a checkpoint by name, whichever safetensors shard holds it."""
    index: dict[str, Any] = {}
    for file in sorted(path.glob("*.safetensors")):
        handle = safe_open(str(file), framework="pt")
        index |= {name: handle for name in handle.keys()}  # noqa: SIM118 - safe_open has keys() only
    if not index:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return lambda name: index[name].get_tensor(name)


def cached_gguf(path: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The checkpoint's GGUF beside it (built on first use; rebuilt when the weights are newer)."""
    path = Path(path)
    out = path / f"model-{DTYPES.get(dtype, 'X').lower()}.gguf"
    newest = max(f.stat().st_mtime for f in path.glob("*.safetensors"))
    if not out.exists() or out.stat().st_mtime < newest:
        tmp = out.with_suffix(".gguf.tmp")
        hf_to_gguf(path, tmp, dtype)
        tmp.replace(out)
    return out
