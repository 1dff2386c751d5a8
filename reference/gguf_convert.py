"""A Hugging Face checkpoint as a GGUF file, written the way llama.cpp's `convert_hf_to_gguf.py` writes it.

Written with the `gguf` package (llama.cpp's own writer), for Llama, Qwen 2, Qwen 3 and Gemma 3: tensor names
`token_embd`, `blk.N.attn_q`, ...; Llama's q/k rows (and biases) permuted from Hugging Face's rotate-half RoPE
layout to llama.cpp's interleaved one; Llama 3 RoPE scaling as a `rope_freqs` tensor; Gemma's norms stored as
`1 + weight`; 2-D weights in the asked type (F32, F16, BF16, or a block type such as Q8_0, quantized by
`gguf.quants`), norms and biases in F32. The tokenizer (byte-level BPE) goes in as llama.cpp's metadata: tokens,
merges, token types, special token ids, BOS/EOS flags and the chat template. Both llama.cpp (the bench) and
`infer.load_model` (the GGUF tests) read the result.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from infer.config import SLIDING_ATTENTION, ModelConfig
from reference.tiny_tokenizer import LLAMA3_SPLIT, QWEN_SPLIT

DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
# model_type -> GGUF general.architecture
ARCHES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0",
              "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "Q4_K": "MOSTLY_Q4_K_S", "Q5_0": "MOSTLY_Q5_0",
              "Q6_K": "MOSTLY_Q6_K"}
# A tokenizer.json split regex -> llama.cpp's name for that pre-tokenizer (tokenizer.ggml.pre).
PRE_TOKENIZERS = {LLAMA3_SPLIT: "llama-bpe", QWEN_SPLIT: "qwen2"}
GEMMA3_SLIDING_PERIOD = 6  # what llama.cpp assumes for Gemma 3 when the file names no pattern


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


def quantize_q4_k(data: np.ndarray) -> np.ndarray:
    """Rows of `data` (lengths a multiple of 256) as Q4_K blocks of 144 bytes (gguf-py quantizes no k-quant): per
    sub-block of 32 a scale (max - min') / 15 and a min' = min(0, min), both as 6-bit multiples of the
    super-block's fp16 `d` and `dmin`; codes round((x + min') / scale) in 0..15. Simpler than llama.cpp's
    search, the same format: what its dequantization (and ours) must read back."""
    rows = data.reshape(-1, 8, 32).astype(np.float32)  # [super-blocks * ..., sub-block, value]
    n = rows.shape[0]
    low = np.minimum(rows.min(axis=2), 0.0)
    scale_f, min_f = (rows.max(axis=2) - low) / 15.0, -low
    d = (scale_f.max(axis=1) / 63.0).astype(np.float16)
    dmin = (min_f.max(axis=1) / 63.0).astype(np.float16)
    safe_d = np.where(d > 0, d.astype(np.float32), 1.0)[:, None]
    safe_m = np.where(dmin > 0, dmin.astype(np.float32), 1.0)[:, None]
    sc = np.clip(np.round(scale_f / safe_d), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(min_f / safe_m), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.round((rows + offset[:, :, None]) / np.where(step > 0, step, 1.0)[:, :, None]), 0, 15)
    q = q.astype(np.uint8).reshape(n, 4, 2, 32)  # 64-value chunks: low nibbles the first 32, high the next
    packed = np.zeros((n, 12), dtype=np.uint8)  # the inverse of infer.gguf_quants._k_scales
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    blocks = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), packed,
                             (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)], axis=1)
    return blocks.reshape(*data.shape[:-1], -1)


def quantize_q6_k(data: np.ndarray) -> np.ndarray:
    """Rows of `data` (lengths a multiple of 256) as Q6_K blocks of 210 bytes: per sub-block of 16 a scale
    max|x| / 31 as an int8 multiple of the super-block's fp16 `d`; codes round(x / (d sc)) in -32..31, stored + 32
    as 4 low bits in `ql` and 2 high ones in `qh` (llama.cpp's order). Simpler than its search, the same format."""
    rows = data.reshape(-1, 16, 16).astype(np.float32)
    n = rows.shape[0]
    scale_f = np.abs(rows).max(axis=2) / 31.0
    d = (scale_f.max(axis=1) / 127.0).astype(np.float16)
    safe_d = np.where(d > 0, d.astype(np.float32), 1.0)[:, None]
    sc = np.clip(np.round(scale_f / safe_d), -128, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    codes = np.clip(np.round(rows / np.where(step != 0, step, 1.0)[:, :, None]), -32, 31) + 32
    q = codes.astype(np.uint8).reshape(n, 2, 4, 32)  # halves of 128: four runs of 32 each
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)],
                        axis=2)  # [n, half, 64]
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    blocks = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)],
                            axis=1)
    return blocks.reshape(*data.shape[:-1], -1)


def quantize_blocks(data: np.ndarray, kind: Any) -> np.ndarray:
    """`data` (rows last) in ggml block type `kind`: gguf.quants' quantizers, and ours for Q4_K and Q6_K (gguf-py
    quantizes no k-quant)."""
    import gguf

    if kind == gguf.GGMLQuantizationType.Q4_K:
        return quantize_q4_k(data)
    if kind == gguf.GGMLQuantizationType.Q6_K:
        return quantize_q6_k(data)
    return np.asarray(gguf.quants.quantize(data, kind))


def quantize_roundtrip(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """`weight` as a GGUF of type `kind` stores it, read back by llama.cpp's reference (`gguf.quants`): what a
    model loaded from that file holds."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    data = quantize_blocks(weight.float().numpy(), qtype)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, qtype))).reshape(weight.shape)


def hf_to_gguf(path: str | Path, out: str | Path, dtype: torch.dtype | str = torch.bfloat16) -> Path:
    """Write the checkpoint at `path` as a GGUF file `out` with 2-D weights in `dtype`: a torch dtype (bf16,
    f16, f32) or a ggml type name ("Q8_0", "Q4_0", "Q4_1", ...)."""
    import gguf

    path, out = Path(path), Path(out)
    config = ModelConfig.from_file(path)
    kind = DTYPES.get(dtype, dtype) if isinstance(dtype, torch.dtype) else dtype
    if not isinstance(kind, str) or kind not in FILE_TYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)} or {list(FILE_TYPES)}, got {dtype}")
    if config.model_type not in ARCHES:
        raise ValueError(f"GGUF conversion supports {list(ARCHES)}, got {config.model_type!r}")
    arch = ARCHES[config.model_type]
    writer = gguf.GGUFWriter(str(out), arch)
    _write_config(writer, config, path.name)
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[kind]))
    _write_tokenizer(writer, path, config)
    _write_tensors(writer, config, tensor_reader(path), gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_config(writer: Any, config: ModelConfig, name: str) -> None:
    import gguf

    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope.theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if config.model_type == "llama":
        writer.add_rope_dimension_count(config.head_dim)
    if config.rope.rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope.factor)
    if config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.attn_logit_softcapping is not None:
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if config.model_type == "gemma3_text":
        _write_gemma3(writer, config)
    elif config.has_sliding_layers:
        raise ValueError(f"{config.model_type} with sliding-window layers has no GGUF form here")


def _write_gemma3(writer: Any, config: ModelConfig) -> None:
    """Gemma 3's window and layer pattern; its attention scale and local RoPE base only where llama.cpp's
    defaults (head_dim, 10000) give them, since llama.cpp derives both rather than reading them."""
    derived = (config.hidden_size // config.num_attention_heads if config.num_hidden_layers == 62
               else config.head_dim)
    if config.query_pre_attn_scalar != derived:
        raise ValueError(
            f"query_pre_attn_scalar={config.query_pre_attn_scalar:g}: llama.cpp derives it for Gemma 3 ({derived} "
            "here) and a GGUF cannot carry another; build the checkpoint with query_pre_attn_scalar=head_dim"
        )
    if config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)
    sliding = [t == SLIDING_ATTENTION for t in config.layer_types]
    if sliding != [(i + 1) % GEMMA3_SLIDING_PERIOD != 0 for i in range(config.num_hidden_layers)]:
        writer.add_sliding_window_pattern(sliding)
    if config.rope_local is not None and config.rope_local.theta != 10000.0:
        writer.add_rope_freq_base_swa(config.rope_local.theta)


def _write_tokenizer(writer: Any, path: Path, config: ModelConfig) -> None:
    """tokenizer.json / tokenizer_config.json as llama.cpp's vocabulary metadata: a byte-level BPE as `gpt2`,
    padded with `[PADn]` tokens up to the model's vocab_size (as convert_hf_to_gguf.py pads); a BPE with byte
    fallback (Gemma's SentencePiece vocabulary) as `llama`, its tokens, scores and types and no merges, a token of
    several "▁" spelled with spaces (as llama.cpp's Gemma files spell it)."""
    import gguf

    spec = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    settings = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab = dict(spec["model"]["vocab"])
    specials = {t["content"]: t["special"] for t in spec["added_tokens"]}
    vocab |= {t["content"]: t["id"] for t in spec["added_tokens"]}
    by_id = {i: token for token, i in vocab.items()}
    sentencepiece = bool(spec["model"].get("byte_fallback"))
    unk = settings.get("unk_token")
    tokens, types = [], []
    for i in range(max(config.vocab_size, len(by_id)) if sentencepiece else config.vocab_size):
        token = by_id.get(i)
        tokens.append(f"[PAD{i}]" if token is None else token)
        types.append(gguf.TokenType.UNUSED if token is None else gguf.TokenType.CONTROL if specials.get(token)
                     else gguf.TokenType.USER_DEFINED if token in specials
                     else gguf.TokenType.UNKNOWN if sentencepiece and token == unk
                     else gguf.TokenType.BYTE if sentencepiece and re.fullmatch(r"<0x[0-9A-F]{2}>", token)
                     else gguf.TokenType.NORMAL)
    if sentencepiece:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list([" " * len(t) if len(t) > 1 and set(t) == {"\u2581"} else t for t in tokens])
        writer.add_token_scores([-float(i) for i in range(len(tokens))])
        writer.add_token_types(types)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(_pre_tokenizer_name(spec["pre_tokenizer"]))
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    ids = {name: vocab[settings[name]] for name in ("bos_token", "eos_token", "unk_token", "pad_token")
           if isinstance(settings.get(name), str)}
    # As llama.cpp's SpecialVocab: config.json's bos_token_id where the tokenizer names no BOS (Qwen).
    bos = ids.get("bos_token", config.bos_token_id)
    if bos is not None:
        writer.add_bos_token_id(bos)
    if "eos_token" in ids:
        writer.add_eos_token_id(ids["eos_token"])
    if "unk_token" in ids:
        writer.add_unk_token_id(ids["unk_token"])
    if "pad_token" in ids:
        writer.add_pad_token_id(ids["pad_token"])
    for flag in ("add_bos_token", "add_eos_token"):
        if isinstance(settings.get(flag), bool):
            getattr(writer, f"add_{flag}")(settings[flag])
    if settings.get("chat_template"):
        writer.add_chat_template(settings["chat_template"])


def _pre_tokenizer_name(pre: dict[str, Any]) -> str:
    if pre["type"] == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    pieces = pre.get("pretokenizers", [])
    regex = pieces[0].get("pattern", {}).get("Regex") if pieces and pieces[0]["type"] == "Split" else None
    if regex not in PRE_TOKENIZERS:
        raise ValueError(f"no llama.cpp pre-tokenizer name known for {json.dumps(pre)[:200]}")
    return PRE_TOKENIZERS[regex]


# Hugging Face module name (after "model.layers.N.") -> GGUF tensor name (after "blk.N.")
BLOCK_TENSORS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
GEMMA3_BLOCK_TENSORS = {**BLOCK_TENSORS, "post_attention_layernorm": "post_attention_norm",
                        "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_name(hf_name: str, model_type: str) -> str:
    """The GGUF name convert_hf_to_gguf.py gives Hugging Face tensor `hf_name` (with its `model.` prefix)."""
    name = hf_name.removeprefix("model.")
    leaf = name.rsplit(".", 1)[1]
    if name.startswith("layers."):
        _, layer, rest = name.split(".", 2)
        table = GEMMA3_BLOCK_TENSORS if model_type == "gemma3_text" else BLOCK_TENSORS
        return f"blk.{layer}.{table[rest.rsplit('.', 1)[0]]}.{leaf}"
    return {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}[name.rsplit(".", 1)[0]] + \
        f".{leaf}"


def _write_tensors(writer: Any, config: ModelConfig, weights: Callable[[str], torch.Tensor], kind: Any) -> None:
    import gguf

    names = sorted(_hf_names(config))
    for name in names:
        data = weights(name).float().numpy()
        if config.model_type == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            data = permute_for_rope(data, heads)
        if config.model_type == "gemma3_text" and name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp's Gemma kernels multiply by the stored norm weight itself
        if data.ndim == 1 or kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name, config.model_type), data.astype(np.float32))
        else:
            writer.add_tensor(gguf_name(name, config.model_type), quantize_blocks(data, kind), raw_dtype=kind)
    factors = llama3_rope_factors(config)
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors)


def _hf_names(config: ModelConfig) -> list[str]:
    """The checkpoint tensors the model uses, with their `model.` prefix."""
    from infer.models import Transformer

    with torch.device("meta"):
        model = Transformer(config)
    names = [n for n in model.state_dict() if not (n == "lm_head.weight" and config.tie_word_embeddings)]
    return [n if n.startswith("lm_head.") else f"model.{n}" for n in names]


def tensor_reader(path: Path) -> Callable[[str], torch.Tensor]:
    """Read any tensor of a checkpoint by name, whichever safetensors shard holds it."""
    index: dict[str, Any] = {}
    for file in sorted(path.glob("*.safetensors")):
        handle = safe_open(str(file), framework="pt")
        index |= {name: handle for name in handle.keys()}  # noqa: SIM118 - safe_open has keys() only
    if not index:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return lambda name: index[name].get_tensor(name)


def cached_gguf(path: str | Path, dtype: torch.dtype | str = torch.bfloat16) -> Path:
    """The checkpoint's GGUF next to its folder, `<folder>.<kind>.gguf` (built on first use; rebuilt when the weights
    are newer). Not inside the folder: a GGUF there would be what `load_model` reads once config.json is gone."""
    path = Path(path)
    kind = DTYPES.get(dtype, "X") if isinstance(dtype, torch.dtype) else dtype
    out = path.parent / f"{path.name}.{kind.lower()}.gguf"
    newest = max(f.stat().st_mtime for f in path.glob("*.safetensors"))
    if not out.exists() or out.stat().st_mtime < newest:
        tmp = out.with_suffix(".gguf.tmp")
        hf_to_gguf(path, tmp, dtype)
        tmp.replace(out)
    return out
