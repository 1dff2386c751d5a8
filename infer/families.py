"""The model families this engine runs, and every trait that tells them apart, in one table.

The model (infer/models/transformer.py) and the config reader (infer/config.py) read these traits; neither
checks a `model_type` itself. Adding a family whose layers are built from these parts is one entry here
(plus the test-checkpoint builder in reference/checkpoints.py and, if its tensors are named otherwise, a
weight-name map). `ARCHITECTURES` is the one list every test, the bench and the asv suite import.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """What one `model_type` does differently from the plain Llama block."""

    model_type: str
    # RMSNorm form: Gemma's `(x_norm * (1 + weight)).to(dtype)` instead of Llama's `weight * x_norm.to(dtype)`.
    norm_plus_one: bool = False
    # Each query and key head RMS-normalised before RoPE (`q_norm`, `k_norm`).
    qk_norm: bool = False
    # Four norms per block: a post-norm after attention and after the MLP (Gemma's "sandwich").
    sandwich_norms: bool = False
    # Embeddings multiplied by sqrt(hidden_size), rounded to the model dtype first (as HF does).
    embed_scale: bool = False
    # Biases on q/k/v whatever config.json says (Qwen 2 hard-codes them; o_proj has none). False: the
    # config's `attention_bias` decides for all four projections, as Llama's does.
    qkv_bias: bool = False
    # Defaults for keys config.json may leave out (transformers' own defaults for the family). head_dim None:
    # hidden_size // num_attention_heads.
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    # Sliding-window layers: "period" (Gemma 3: every `sliding_window_pattern`-th layer is global), "upper"
    # (Qwen: layers from `max_window_layers` on slide, when `use_sliding_window`), or None.
    sliding_layers: str | None = None
    # RoPE base of sliding layers when they have their own (`rope_local_base_freq`); None: the global one.
    local_rope_theta: float | None = None
    # Queries scaled by query_pre_attn_scalar ** -0.5 (default given here) instead of head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama"),
        Family("qwen2", qkv_bias=True, sliding_layers="upper", max_position_embeddings=32768),
        Family("qwen3", qk_norm=True, sliding_layers="upper", head_dim=128, max_position_embeddings=32768),
        Family("gemma3_text", norm_plus_one=True, qk_norm=True, sandwich_norms=True, embed_scale=True,
               head_dim=256, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh", rope_theta=1_000_000.0,
               max_position_embeddings=131072,
               sliding_layers="period", local_rope_theta=10000.0, query_pre_attn_scalar=256.0),
    )
}

# Every supported `model_type`, in one order: what tests parametrize over.
ARCHITECTURES: tuple[str, ...] = tuple(FAMILIES)
