"""Read a GGUF file (llama.cpp's format) as a checkpoint: a `ModelConfig` and fp32 tensors by Hugging Face name.

The container is read with the `gguf` package (llama.cpp's own reader). The metadata becomes the dict a
config.json would hold, validated by `ModelConfig.from_dict` like any other; tensor names are mapped back to
the Hugging Face ones, quantized blocks are dequantized (`infer.gguf_quants`), and what llama.cpp's converter
changed is undone: the q/k row permutation of Llama (for its interleaved RoPE) and Gemma's norms stored as
`1 + weight`. Llama 3's RoPE scaling arrives as per-frequency factors (`rope_freqs`) and is applied as such.
Every problem raises one `CheckpointError` naming the file and the key or tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from infer.errors import CheckpointError
from infer.families import FAMILIES
from infer.gguf_quants import BLOCK_TYPES, dequantize

# GGUF `general.architecture` -> the model_type this engine runs.
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
# llama.cpp's Gemma 3 loader: every 6th layer is global unless the file says otherwise.
GEMMA3_SLIDING_PERIOD = 6
_MISSING: Any = object()


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: `path` itself if it is a `.gguf` file, or the one `.gguf` in a directory
    that has no config.json (a Hugging Face checkpoint directory is read as such). None otherwise."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise CheckpointError(f"{path} holds {len(found)} GGUF files ({names}); pass the one to load")
    return found[0] if found else None


class GGUFFile:
    """An open GGUF file: its metadata values (as Python values) and its tensors (a map of the file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._reader = _open_reader(path)
        self.tensors = {t.name: t for t in self._reader.tensors}

    @property
    def arch(self) -> str:
        return str(self.require("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata `key` (an int, float, bool, str or list of them), `default` when absent."""
        field = self._reader.fields.get(key)
        if field is None:
            return default
        try:
            return _field_value(field)
        except (UnicodeDecodeError, IndexError, ValueError) as e:
            raise CheckpointError(f"{self.path}: metadata key {key} cannot be read ({e}); the file is corrupt") from e

    def require(self, key: str) -> Any:
        """The value of metadata `key`, which the model cannot do without."""
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise CheckpointError(
                f"{self.path} lacks the metadata key {key}, which a GGUF model needs; re-convert it with a "
                "current llama.cpp (convert_hf_to_gguf.py)"
            )
        return value


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file under its Hugging Face name: shape known at once, values on `load()`."""

    name: str  # the GGUF name (blk.0.attn_q.weight)
    kind: str  # the ggml type (F32, Q4_K, ...)
    shape: tuple[int, ...]  # torch order (rows first)
    data: np.ndarray
    rope_heads: int | None = None  # undo llama.cpp's RoPE row permutation over this many heads
    norm_offset: float = 0.0  # subtracted after dequantization (Gemma's norms are stored as 1 + w)

    def load(self) -> torch.Tensor:
        """The tensor as the Hugging Face checkpoint holds it, in float32 on the CPU."""
        raw = torch.from_numpy(np.array(self.data, copy=True).reshape(-1).view(np.uint8))
        self.release()
        tensor = dequantize(raw, self.kind, self.shape)
        if self.rope_heads is not None:
            tensor = unpermute_rope_rows(tensor, self.rope_heads)
        if self.norm_offset:
            tensor = tensor - self.norm_offset
        return tensor

    def rows(self, part: slice) -> GGUFTensor:
        """The tensor of rows `part` only (a view of the file's map: a tensor-parallel rank reads its rows alone).
        A row holds whole quantization blocks, and RoPE's row permutation stays within a head, so a cut on head
        boundaries (`rope_heads` must divide it) keeps both."""
        start, stop, _ = part.indices(self.shape[0])
        heads = self.rope_heads
        if heads is not None:
            per_head = self.shape[0] // heads
            if start % per_head or stop % per_head:
                raise ValueError(f"{self.name}: rows {start}:{stop} split a RoPE head of {per_head} rows")
            heads = (stop - start) // per_head
        data = self.data.reshape(self.shape[0], -1)[start:stop]
        return replace(self, shape=(stop - start, *self.shape[1:]), data=data, rope_heads=heads)

    def release(self) -> None:
        """Drop this tensor's pages of the file's map from the process's resident set once it has been read into
        memory of its own (they stay in the page cache and are read again if touched): else the whole file's map
        sits beside the loaded weights at the load's peak (1B Q4_K_M: 2.9 GB for 1.1 GB of weights)."""
        base: Any = self.data
        while base is not None and not isinstance(getattr(base, "_mmap", None), mmap.mmap):
            base = base.base
        if base is None or not hasattr(mmap, "MADV_DONTNEED") or not self.data.nbytes:
            return
        start = self.data.ctypes.data - base.ctypes.data + int(base.offset) % mmap.ALLOCATIONGRANULARITY
        first = start // mmap.PAGESIZE * mmap.PAGESIZE
        with contextlib.suppress(OSError, ValueError):  # a platform without it: the pages just stay resident
            base._mmap.madvise(mmap.MADV_DONTNEED, first, start + self.data.nbytes - first)


def unpermute_rope_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of a q or k projection (or bias) from llama.cpp's interleaved RoPE pairs back to Hugging Face's
    rotate-half order: convert_hf_to_gguf.py permutes Llama's q_proj/k_proj this way for its RoPE kernel."""
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def read_gguf(path: Path) -> tuple[ModelConfig, dict[str, GGUFTensor]]:
    """The config and the tensors (by Hugging Face name) of the GGUF file `path`; nothing is dequantized yet."""
    gguf = GGUFFile(path)
    arch = gguf.arch
    if arch not in MODEL_TYPES:
        raise CheckpointError(
            f"{path}: general.architecture={arch!r} is not supported; this engine runs GGUF architectures "
            f"{', '.join(MODEL_TYPES)}"
        )
    raw = config_dict(gguf)
    try:
        config = ModelConfig.from_dict(raw)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: its metadata does not describe a valid {arch} model: {e}") from e
    config = _with_rope_factors(gguf, config)
    return config, _tensors(gguf, config)


def config_dict(gguf: GGUFFile) -> dict[str, Any]:
    """The config.json-style dict the file's metadata describes (Hugging Face key names)."""
    arch = gguf.arch
    names = set(gguf.tensors)

    def key(name: str) -> str:
        return f"{arch}.{name}"

    heads = gguf.require(key("attention.head_count"))
    eos = [gguf.get("tokenizer.ggml.eos_token_id"), gguf.get("tokenizer.ggml.eot_token_id")]
    raw: dict[str, Any] = {
        "model_type": MODEL_TYPES[arch],
        "num_hidden_layers": gguf.require(key("block_count")),
        "hidden_size": gguf.require(key("embedding_length")),
        "intermediate_size": gguf.require(key("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": gguf.get(key("attention.head_count_kv"), heads),
        "rms_norm_eps": gguf.require(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": gguf.get(key("context_length")),
        "rope_theta": gguf.get(key("rope.freq_base")),
        "rope_scaling": _rope_scaling(gguf, arch),
        "vocab_size": _vocab_size(gguf, arch),
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in names,
        # Llama's attention_bias puts biases on all four projections; Qwen 2's fixed q/k/v biases (a family
        # trait) leave o_proj without one, so the output projection's bias is what tells them apart.
        "attention_bias": "blk.0.attn_output.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "bos_token_id": gguf.get("tokenizer.ggml.bos_token_id"),
        # Generation ends on eos and, where the file names one, the end-of-turn token (as llama.cpp stops).
        "eos_token_id": list(dict.fromkeys(i for i in eos if i is not None)) or None,
        "final_logit_softcapping": gguf.get(key("final_logit_softcapping")),
        "attn_logit_softcapping": gguf.get(key("attn_logit_softcapping")),
    }
    head_dim = gguf.get(key("attention.key_length"))
    if head_dim is None and arch == "llama":
        head_dim = gguf.get(key("rope.dimension_count"))  # what transformers reads for Llama
    if head_dim is not None:
        raw["head_dim"] = head_dim
    _check_head_dims(gguf, arch, raw)
    if arch == "gemma3":
        raw.update(_gemma3_keys(gguf, raw))
    return raw


def _check_head_dims(gguf: GGUFFile, arch: str, raw: dict[str, Any]) -> None:
    """Values and RoPE must span the whole key head: this engine has no separate value or rotary width."""
    head_dim = raw.get("head_dim")
    if head_dim is None and isinstance(raw["hidden_size"], int) and isinstance(raw["num_attention_heads"], int):
        head_dim = raw["hidden_size"] // max(raw["num_attention_heads"], 1)
    for name in ("attention.value_length", "rope.dimension_count"):
        value = gguf.get(f"{arch}.{name}")
        if value is not None and value != head_dim:
            raise CheckpointError(
                f"{gguf.path}: {arch}.{name}={value} differs from the head size {head_dim}; this engine runs only "
                "models whose values and RoPE span the whole head"
            )


def _vocab_size(gguf: GGUFFile, arch: str) -> Any:
    tokens = gguf._reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    return gguf.require(f"{arch}.vocab_size")


def _rope_scaling(gguf: GGUFFile, arch: str) -> dict[str, Any] | None:
    kind = gguf.get(f"{arch}.rope.scaling.type")
    factor = gguf.get(f"{arch}.rope.scaling.factor")
    if kind is None and gguf.get(f"{arch}.rope.scale_linear") is not None:  # the key older files carry
        kind, factor = "linear", gguf.get(f"{arch}.rope.scale_linear")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise CheckpointError(
            f"{gguf.path}: {arch}.rope.scaling.type={kind!r} is not supported; this engine implements linear "
            "RoPE scaling and Llama 3's (rope_freqs)"
        )
    return {"rope_type": "linear", "factor": factor}


def _gemma3_keys(gguf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's sliding layers and attention scale, which llama.cpp derives where the file is silent."""
    layers = raw["num_hidden_layers"]
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise CheckpointError(f"{gguf.path}: gemma3.block_count={layers!r} is invalid; expected an integer >= 1")
    window = gguf.get("gemma3.attention.sliding_window")
    pattern = gguf.get("gemma3.attention.sliding_window_pattern", GEMMA3_SLIDING_PERIOD)
    if window is None:
        types = [FULL_ATTENTION] * layers
    elif isinstance(pattern, list):  # one flag per layer, true where it slides
        types = [SLIDING_ATTENTION if flag else FULL_ATTENTION for flag in pattern]
    elif isinstance(pattern, int) and pattern > 0:
        types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(layers)]
    else:
        raise CheckpointError(f"{gguf.path}: gemma3.attention.sliding_window_pattern={pattern!r} is invalid")
    # llama.cpp scales queries by head_dim ** -0.5, except for the 62-layer 27B (hidden / heads).
    scalar = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    if layers == 62:
        scalar = raw["hidden_size"] // raw["num_attention_heads"]
    local_theta = FAMILIES["gemma3_text"].local_rope_theta
    return {
        "layer_types": types,
        "sliding_window": window,
        "rope_local_base_freq": gguf.get("gemma3.rope.freq_base_swa", local_theta),
        "query_pre_attn_scalar": scalar,
    }


def _with_rope_factors(gguf: GGUFFile, config: ModelConfig) -> ModelConfig:
    """Llama 3's RoPE scaling, which llama.cpp stores as one divisor per frequency (`rope_freqs.weight`)."""
    tensor = gguf.tensors.get("rope_freqs.weight")
    if tensor is None:
        return config
    expected = (config.head_dim // 2,)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if tensor.tensor_type.name != "F32" or shape != expected:
        raise CheckpointError(
            f"{gguf.path}: tensor rope_freqs.weight is {tensor.tensor_type.name} {shape}; expected F32 {expected} "
            "(one factor per rotated pair)"
        )
    factors = tuple(float(f) for f in np.asarray(tensor.data, dtype=np.float32).reshape(-1))
    if not all(np.isfinite(factors)) or min(factors) <= 0:
        raise CheckpointError(f"{gguf.path}: tensor rope_freqs.weight holds factors that are not finite and > 0")
    return dataclasses.replace(config, rope=dataclasses.replace(config.rope, freq_factors=factors))


# GGUF tensor names -> Hugging Face module names (the leaf `.weight` / `.bias` is kept).
GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# With Gemma's four norms per block, llama.cpp's `ffn_norm` is the one before the MLP.
SANDWICH_BLOCK_NAMES = {**BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm"}
# Tensors llama.cpp writes that hold no weight of the model (read into the config instead).
NOT_WEIGHTS = {"rope_freqs.weight"}


def hf_name(gguf_name: str, sandwich: bool) -> str | None:
    """The Hugging Face name (without the `model.` prefix) of GGUF tensor `gguf_name`, None if unknown."""
    block = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if block:
        part = (SANDWICH_BLOCK_NAMES if sandwich else BLOCK_NAMES).get(block[2])
        return None if part is None else f"layers.{int(block[1])}.{part}.{block[3]}"
    base, _, leaf = gguf_name.rpartition(".")
    part = GLOBAL_NAMES.get(base)
    return None if part is None or leaf not in ("weight", "bias") else f"{part}.{leaf}"


def _tensors(gguf: GGUFFile, config: ModelConfig) -> dict[str, GGUFTensor]:
    family = FAMILIES[config.model_type]
    out: dict[str, GGUFTensor] = {}
    for name, tensor in gguf.tensors.items():
        if name in NOT_WEIGHTS:
            continue
        target = hf_name(name, family.sandwich_norms)
        if target is None:
            raise CheckpointError(
                f"{gguf.path}: tensor {name} has no counterpart in a {config.model_type} model; the file is a "
                "variant this engine does not run"
            )
        kind = tensor.tensor_type.name
        if kind not in BLOCK_TYPES:
            raise CheckpointError(
                f"{gguf.path}: tensor {name} is stored as {kind}, which this engine cannot dequantize; supported: "
                f"{', '.join(BLOCK_TYPES)} (re-quantize the model to one of them with llama-quantize)"
            )
        out[target] = GGUFTensor(
            name=name, kind=kind, shape=tuple(int(d) for d in reversed(tensor.shape.tolist())), data=tensor.data,
            rope_heads=_rope_heads(name, config), norm_offset=1.0 if family.norm_plus_one and
            name.endswith("norm.weight") else 0.0,
        )
    _check_blocks(gguf, out, config.num_hidden_layers)
    return out


def _rope_heads(name: str, config: ModelConfig) -> int | None:
    """Heads to un-permute over: llama.cpp permutes q and k (weights and biases) of `llama` models only; its
    Qwen and Gemma converters keep Hugging Face's rotate-half layout (transformers un-permutes Llama alone)."""
    if config.model_type != "llama":
        return None
    if ".attn_q." in name:
        return config.num_attention_heads
    if ".attn_k." in name:
        return config.num_key_value_heads
    return None


def _check_blocks(gguf: GGUFFile, tensors: dict[str, GGUFTensor], block_count: int) -> None:
    """block_count must match the blocks the file holds (none dropped, none missing)."""
    present = {int(m.group(1)) for name in tensors if (m := re.match(r"layers\.(\d+)\.", name))}
    if present != set(range(block_count)):
        held = f"blocks 0..{max(present)}" if present else "no blocks"
        raise CheckpointError(
            f"{gguf.path}: {gguf.arch}.block_count={block_count}, but the file holds {held} ({len(present)} "
            "distinct); the metadata and the tensors disagree"
        )


def _open_reader(path: Path) -> Any:
    """A GGUFReader over `path`; a truncated or corrupt file is one CheckpointError naming what is wrong."""
    from gguf import GGUFReader

    class Reader(GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            _check_extents(path, int(self.data.shape[0]), start_offs, fields)
            super()._build_tensors(start_offs, fields)

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
            parts = _array_parts(self, orig_offs, raw_type)
            return parts if parts is not None else super()._get_field_parts(orig_offs, raw_type)

    try:
        reader = Reader(path)
    except CheckpointError:
        raise
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError, OverflowError) as e:
        raise CheckpointError(
            f"{path} cannot be read as a GGUF file ({type(e).__name__}: {e}); it is truncated, corrupt or not "
            "GGUF: download or convert it again"
        ) from e
    if reader.byte_order != "I":
        raise CheckpointError(f"{path} is a big-endian GGUF file; convert it to little-endian first")
    return reader


def _array_parts(reader: Any, offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]] | None:
    """A metadata array of scalars or strings read whole, in the form GGUFReader's `_get_field_parts` gives (its
    size in bytes, parts, the parts holding values, value types); None for anything else (the reader's own way).

    The reader makes a numpy view per element: a real vocabulary's three arrays (Gemma 3: 262,144 tokens, scores
    and types) took it 25 s on a Zen 3 EPYC, most of loading the file's tokenizer. Here an array of scalars is one
    view and an array of strings one pass over the bytes. Values are the same; a string array's parts are `bytes`.
    """
    from gguf import GGUFValueType

    if raw_type != GGUFValueType.ARRAY or reader.byte_order != "I":
        return None
    data = reader.data
    head = [data[offs: offs + 4].view(np.uint32), data[offs + 4: offs + 12].view(np.uint64)]  # item type, count
    item_type, count, start = int(head[0][0]), int(head[1][0]), offs + 12
    scalar = reader.gguf_scalar_to_np.get(item_type)
    if scalar is not None:
        end = start + np.dtype(scalar).itemsize * count
        if end > data.shape[0]:
            raise ValueError(f"an array of {count} values runs past the end of the file")
        types = [GGUFValueType.ARRAY, GGUFValueType(item_type)] if count else [GGUFValueType.ARRAY]
        return end - offs, [*head, data[start:end].view(scalar)], [2], types
    if item_type != GGUFValueType.STRING:
        return None  # nested arrays
    view, size, strings, at = memoryview(data), int(data.shape[0]), [], start
    for _ in range(count):
        if at + 8 > size:
            raise ValueError(f"an array of {count} strings runs past the end of the file")
        length = int.from_bytes(view[at: at + 8], "little")
        if at + 8 + length > size:
            raise ValueError(f"a string of {length} bytes runs past the end of the file")
        strings.append(bytes(view[at + 8: at + 8 + length]))
        at += 8 + length
    return (at - offs, [*head, *strings], list(range(2, 2 + count)),
            [GGUFValueType.ARRAY, GGUFValueType.STRING] if count else [GGUFValueType.ARRAY])


def _check_extents(path: Path, size: int, start: int, fields: list[Any]) -> None:
    """Name the first tensor whose data would run past the end of the file (a truncated download)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for field in fields:
        try:
            _, name, _, dims, raw_type, offset = field.parts
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
        except (ValueError, KeyError):
            continue  # an unknown type: the reader reports it
        end = start + int(offset[0]) + int(np.prod(dims.astype(np.int64))) * type_size // block_size
        if end > size:
            raise CheckpointError(
                f"{path} is truncated: tensor {bytes(name).decode(errors='replace')} needs bytes up to {end}, but "
                f"the file has {size}; download or convert it again"
            )


def _field_value(field: Any) -> Any:
    """A metadata field as a Python value: str, int, float, bool, or a list of them."""
    from gguf import GGUFValueType

    kind = field.types[-1]
    if kind == GGUFValueType.STRING:
        strings = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return strings if field.types[0] == GGUFValueType.ARRAY else strings[0]
    if kind == GGUFValueType.ARRAY:  # an empty array: no element type recorded
        return []
    values = np.concatenate([np.atleast_1d(field.parts[i]) for i in field.data]).tolist()
    return values if field.types[0] == GGUFValueType.ARRAY else values[0]
