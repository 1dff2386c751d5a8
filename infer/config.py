"""Typed model configuration read from a Hugging Face `config.json`.

Field names follow Hugging Face. Both config formats are read: the legacy one real checkpoints ship
(`rope_theta`, `rope_scaling`, `rope_local_base_freq`, `sliding_window_pattern`) and the one
transformers 5 writes (`rope_parameters`, `layer_types`). Unknown keys are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infer.errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "gemma3_text")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class RopeConfig:
    """How one kind of layer rotates its queries and keys."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one decoder-only model."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    # One entry per layer: FULL_ATTENTION or SLIDING_ATTENTION.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_local: RopeConfig | None = None  # RoPE of sliding layers, when it differs (Gemma 3)
    query_pre_attn_scalar: float | None = None  # Gemma 3: queries are scaled by its -1/2 power
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def has_sliding_layers(self) -> bool:
        """Whether any layer attends through a sliding window."""
        return SLIDING_ATTENTION in self.layer_types

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` uses the sliding-window mask."""
        return self.layer_types[layer] == SLIDING_ATTENTION

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build a config from the parsed contents of a Hugging Face `config.json`."""
        return _from_hf_dict(raw)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` (or the `config.json` inside a directory)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise CheckpointError(f"no config.json at {path}: a checkpoint directory needs one")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON ({e}); re-download the checkpoint") from e
        return _from_hf_dict(raw)


def _require(raw: dict[str, Any], key: str) -> Any:
    if key not in raw or raw[key] is None:
        raise CheckpointError(f"config.json has no '{key}', which a {raw.get('model_type')} model needs")
    return raw[key]


def _rope_from_params(params: dict[str, Any] | None, default_theta: float) -> RopeConfig:
    """One RopeConfig from a `rope_scaling` or `rope_parameters` dict (either may be absent)."""
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise CheckpointError(
            f"unsupported rope type '{rope_type}': this engine implements 'default', 'linear' and 'llama3'"
        )
    return RopeConfig(
        theta=float(params.get("rope_theta", default_theta)),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _is_per_layer_type(params: Any) -> bool:
    return isinstance(params, dict) and (FULL_ATTENTION in params or SLIDING_ATTENTION in params)


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _from_hf_dict(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type == "gemma3":  # the multimodal wrapper: its text part is what we run
        raise CheckpointError(
            "model_type 'gemma3' is the multimodal Gemma 3; this engine runs the text-only "
            "'gemma3_text' checkpoints (e.g. gemma-3-1b)"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    num_layers = int(_require(raw, "num_hidden_layers"))
    num_heads = int(_require(raw, "num_attention_heads"))
    hidden = int(_require(raw, "hidden_size"))
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise CheckpointError(
            f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})"
        )
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    is_gemma = model_type == "gemma3_text"

    # Layer types: transformers 5 writes them; legacy Gemma 3 gives a period instead.
    layer_types = raw.get("layer_types")
    if layer_types is None:
        if is_gemma:
            pattern = int(raw.get("sliding_window_pattern", 6))
            layer_types = [
                SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)
            ]
        elif raw.get("use_sliding_window") and raw.get("sliding_window"):
            max_window_layers = int(raw.get("max_window_layers", num_layers))
            layer_types = [
                SLIDING_ATTENTION if i >= max_window_layers else FULL_ATTENTION for i in range(num_layers)
            ]
        else:
            layer_types = [FULL_ATTENTION] * num_layers
    layer_types = tuple(layer_types)
    if len(layer_types) != num_layers or set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise CheckpointError(
            f"layer_types must list {num_layers} entries of '{FULL_ATTENTION}' or '{SLIDING_ATTENTION}', "
            f"got {list(layer_types)}"
        )
    sliding_window = raw.get("sliding_window") if SLIDING_ATTENTION in layer_types else None
    if SLIDING_ATTENTION in layer_types and not sliding_window:
        raise CheckpointError("config.json has sliding_attention layers but no 'sliding_window' size")

    # RoPE: `rope_parameters` (transformers 5; per layer type for Gemma 3) or the legacy keys.
    rope_params = raw.get("rope_parameters")
    default_theta = 1_000_000.0 if is_gemma else 10000.0
    if isinstance(rope_params, dict) and _is_per_layer_type(rope_params):
        rope = _rope_from_params(rope_params.get(FULL_ATTENTION), default_theta)
        rope_local = _rope_from_params(rope_params.get(SLIDING_ATTENTION), 10000.0)
    elif rope_params is not None:
        rope = _rope_from_params(rope_params, float(raw.get("rope_theta", default_theta)))
        rope_local = None
    else:
        rope = _rope_from_params(raw.get("rope_scaling"), float(raw.get("rope_theta", default_theta)))
        rope_local = None
        if is_gemma:
            rope_local = RopeConfig(theta=float(raw.get("rope_local_base_freq", 10000.0)))
    if is_gemma and rope_local is None:
        rope_local = RopeConfig(theta=10000.0)

    hidden_act = raw.get("hidden_activation") or raw.get("hidden_act") or ("gelu_pytorch_tanh" if is_gemma else "silu")
    if hidden_act not in ("silu", "gelu_pytorch_tanh"):
        raise CheckpointError(f"unsupported activation '{hidden_act}': supported are silu and gelu_pytorch_tanh")
    tie_default = model_type != "llama"
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(_require(raw, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_require(raw, "intermediate_size")),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", tie_default)),
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        hidden_act=hidden_act,
        layer_types=layer_types,
        sliding_window=int(sliding_window) if sliding_window else None,
        rope=rope,
        rope_local=rope_local,
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)) if is_gemma else None,
        final_logit_softcapping=raw.get("final_logit_softcapping"),
        attn_logit_softcapping=raw.get("attn_logit_softcapping"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
    )
