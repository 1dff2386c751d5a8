"""Typed model configuration read from a Hugging Face `config.json`.

Field names follow Hugging Face. Both config formats are read: the legacy one real checkpoints ship
(`rope_theta`, `rope_scaling`, `rope_local_base_freq`, `sliding_window_pattern`) and the one
transformers 5 writes (`rope_parameters`, `layer_types`). Unknown keys are ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infer.errors import CheckpointError
from infer.families import ARCHITECTURES, FAMILIES

SUPPORTED_MODEL_TYPES = ARCHITECTURES
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
# The "upper" rule's keys when a config.json turns use_sliding_window on and leaves them out: transformers'
# defaults (Qwen2Config and Qwen3Config alike), a 4096-token window from layer 28 on.
UPPER_DEFAULT_SLIDING_WINDOW = 4096
UPPER_DEFAULT_MAX_WINDOW_LAYERS = 28


@dataclass(frozen=True)
class RopeConfig:
    """How one kind of layer rotates its queries and keys."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # Per-frequency divisors of the inverse frequencies, as GGUF files carry Llama 3's scaling (llama.cpp's
    # `rope_freqs` tensor: one factor per rotated pair, applied after `rope_type`'s own scaling); None: none.
    freq_factors: tuple[float, ...] | None = None


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
    def has_sliding_layers(self) -> bool:
        """Whether any layer attends through a sliding window."""
        return SLIDING_ATTENTION in self.layer_types

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` uses the sliding-window mask."""
        return self.layer_types[layer] == SLIDING_ATTENTION

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build a config from the parsed contents of a Hugging Face `config.json`."""
        if not isinstance(raw, dict):
            raise TypeError(f"ModelConfig.from_dict takes the parsed config.json dict, got {type(raw).__name__}")
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
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise CheckpointError(f"{path} is not valid JSON ({e}); re-download the checkpoint") from e
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path} must hold a JSON object, got {type(raw).__name__}")
        return _from_hf_dict(raw)


_MISSING: Any = object()


def _bad(key: str, value: Any, expected: str) -> CheckpointError:
    return CheckpointError(f"config.json: {key}={value!r} is invalid; expected {expected}")


def _int(raw: dict[str, Any], key: str, default: Any = _MISSING, minimum: int = 1, *, where: str = "") -> int:
    """An integer field >= minimum; absent or null takes `default` (required when there is none)."""
    value = raw.get(key)
    name = where + key
    if value is None:
        if default is _MISSING:
            raise CheckpointError(f"config.json has no '{name}', which a {raw.get('model_type', 'this')} model needs")
        return int(default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(name, value, f"an integer >= {minimum}")
    return value


def _number(raw: dict[str, Any], key: str, default: float, *, where: str = "") -> float:
    """A finite number > 0; absent or null takes `default`."""
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _bad(where + key, value, "a finite number > 0")
    return float(value)


def _optional_number(raw: dict[str, Any], key: str) -> float | None:
    """A finite number > 0, or absent / null (e.g. a softcap that is off)."""
    return None if raw.get(key) is None else _number(raw, key, 0.0)


def _bool(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(key, value, "true or false")
    return value


def _dict(raw: dict[str, Any], key: str) -> dict[str, Any] | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, dict):
        raise _bad(key, value, "a JSON object or null")
    return value


def _rope_from_params(params: dict[str, Any] | None, default_theta: float, where: str) -> RopeConfig:
    """One RopeConfig from a `rope_scaling` or `rope_parameters` dict (either may be absent)."""
    if params is not None and not isinstance(params, dict):
        raise _bad(where.rstrip("."), params, "a JSON object or null")
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise CheckpointError(
            f"config.json: unsupported rope type {rope_type!r} in {where.rstrip('.')}; this engine implements "
            "'default', 'linear' and 'llama3'"
        )
    rope = RopeConfig(
        theta=_number(params, "rope_theta", default_theta, where=where),
        rope_type=rope_type,
        factor=_number(params, "factor", 1.0, where=where),
        low_freq_factor=_number(params, "low_freq_factor", 1.0, where=where),
        high_freq_factor=_number(params, "high_freq_factor", 4.0, where=where),
        original_max_position_embeddings=_int(params, "original_max_position_embeddings", 8192, where=where),
    )
    if rope_type == "llama3" and rope.high_freq_factor <= rope.low_freq_factor:
        # llama3 scaling interpolates between the two wavelengths and divides by their difference.
        raise _bad(where + "high_freq_factor", rope.high_freq_factor,
                   f"a value above low_freq_factor ({rope.low_freq_factor}) for llama3 RoPE scaling")
    return rope


def _is_per_layer_type(params: Any) -> bool:
    return isinstance(params, dict) and (FULL_ATTENTION in params or SLIDING_ATTENTION in params)


def _token_ids(raw: dict[str, Any], key: str, vocab_size: int) -> tuple[int, ...]:
    """An int or a list of ints, each a token of the vocabulary (a string never matches a token id)."""
    value = raw.get(key)
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab_size for v in values):
        raise _bad(key, value, f"a token id (an integer in [0, {vocab_size})) or a list of them")
    return tuple(dict.fromkeys(values))


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
    num_layers = _int(raw, "num_hidden_layers")
    num_heads = _int(raw, "num_attention_heads")
    hidden = _int(raw, "hidden_size")
    vocab_size = _int(raw, "vocab_size")
    num_kv_heads = _int(raw, "num_key_value_heads", num_heads)
    if num_heads % num_kv_heads:
        raise CheckpointError(
            f"config.json: num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads "
            f"({num_kv_heads}); every KV head must serve the same number of query heads"
        )
    family = FAMILIES[model_type]
    head_dim = _int(raw, "head_dim", family.head_dim or max(hidden // num_heads, 1))

    # Layer types: transformers 5 writes them; legacy Gemma 3 gives a period instead, legacy Qwen
    # use_sliding_window and max_window_layers.
    layer_types = raw.get("layer_types")
    if layer_types is None:
        if family.sliding_layers == "period":
            pattern = _int(raw, "sliding_window_pattern", 6)
            layer_types = [
                SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)
            ]
        elif family.sliding_layers == "upper" and _bool(raw, "use_sliding_window", False):
            raw = {"sliding_window": UPPER_DEFAULT_SLIDING_WINDOW, **raw}  # an explicit null turns it off
            max_window_layers = _int(raw, "max_window_layers", UPPER_DEFAULT_MAX_WINDOW_LAYERS, minimum=0)
            slides = raw["sliding_window"] is not None
            layer_types = [
                SLIDING_ATTENTION if slides and i >= max_window_layers else FULL_ATTENTION for i in range(num_layers)
            ]
        else:
            layer_types = [FULL_ATTENTION] * num_layers
    if not isinstance(layer_types, list) or any(not isinstance(t, str) for t in layer_types):
        raise _bad("layer_types", layer_types, f"a list of {num_layers} strings")
    layer_types = tuple(layer_types)
    if len(layer_types) != num_layers or set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise CheckpointError(
            f"config.json: layer_types must list {num_layers} entries of '{FULL_ATTENTION}' or '{SLIDING_ATTENTION}', "
            f"got {list(layer_types)}"
        )
    sliding_window = None
    if SLIDING_ATTENTION in layer_types:
        if raw.get("sliding_window") is None:
            raise CheckpointError("config.json has sliding_attention layers but no 'sliding_window' size")
        sliding_window = _int(raw, "sliding_window")

    # RoPE: `rope_parameters` (transformers 5; per layer type for Gemma 3) or the legacy keys.
    rope_params = _dict(raw, "rope_parameters")
    default_theta = family.rope_theta
    local_theta = family.local_rope_theta
    if isinstance(rope_params, dict) and _is_per_layer_type(rope_params):
        rope = _rope_from_params(rope_params.get(FULL_ATTENTION), default_theta, f"rope_parameters.{FULL_ATTENTION}.")
        rope_local = _rope_from_params(rope_params.get(SLIDING_ATTENTION), local_theta or default_theta,
                                       f"rope_parameters.{SLIDING_ATTENTION}.")
    elif rope_params is not None:
        rope = _rope_from_params(rope_params, _number(raw, "rope_theta", default_theta), "rope_parameters.")
        rope_local = None
    else:
        rope = _rope_from_params(_dict(raw, "rope_scaling"), _number(raw, "rope_theta", default_theta), "rope_scaling.")
        rope_local = None
        if local_theta is not None:
            rope_local = RopeConfig(theta=_number(raw, "rope_local_base_freq", local_theta))
    if local_theta is not None and rope_local is None:
        rope_local = RopeConfig(theta=local_theta)

    hidden_act = raw.get("hidden_activation") or raw.get("hidden_act") or family.hidden_act
    if hidden_act not in ("silu", "gelu_pytorch_tanh"):
        raise CheckpointError(f"config.json: unsupported activation {hidden_act!r}; supported are silu and "
                              "gelu_pytorch_tanh")
    return ModelConfig(
        model_type=model_type,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_number(raw, "rms_norm_eps", 1e-6),
        max_position_embeddings=_int(raw, "max_position_embeddings", family.max_position_embeddings),
        tie_word_embeddings=_bool(raw, "tie_word_embeddings", family.tie_word_embeddings),
        attention_bias=_bool(raw, "attention_bias", False),
        mlp_bias=_bool(raw, "mlp_bias", False),
        hidden_act=hidden_act,
        layer_types=layer_types,
        sliding_window=sliding_window,
        rope=rope,
        rope_local=rope_local,
        query_pre_attn_scalar=(None if family.query_pre_attn_scalar is None
                               else _number(raw, "query_pre_attn_scalar", family.query_pre_attn_scalar)),
        final_logit_softcapping=_optional_number(raw, "final_logit_softcapping"),
        attn_logit_softcapping=_optional_number(raw, "attn_logit_softcapping"),
        bos_token_id=(_token_ids(raw, "bos_token_id", vocab_size) or (None,))[0],
        eos_token_ids=_token_ids(raw, "eos_token_id", vocab_size),
    )
