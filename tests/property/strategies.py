"""Hypothesis strategies: model shapes built valid by construction, and prompt splits."""

from __future__ import annotations

from hypothesis import strategies as st

from infer.config import ModelConfig
from infer.families import ARCHITECTURES
from tests.helpers import tiny_config


@st.composite
def model_configs(draw: st.DrawFn, model_types: tuple[str, ...] = ARCHITECTURES) -> ModelConfig:
    """A tiny config: KV heads and a group factor are drawn, so heads are always a multiple of KV heads."""
    model_type = draw(st.sampled_from(model_types))
    num_kv_heads = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    return tiny_config(
        model_type,
        num_layers=draw(st.integers(1, 3)),
        num_heads=num_kv_heads * groups,
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from([4, 6, 8, 10, 16])),
        hidden_size=draw(st.sampled_from([16, 24, 32])),
        vocab_size=draw(st.integers(16, 64)),
        sliding_window=draw(st.integers(1, 6)),
        sliding_pattern=draw(st.integers(2, 3)),
    )


@st.composite
def splits(draw: st.DrawFn, min_total: int = 1, max_total: int = 24) -> list[int]:
    """A sequence cut into segments: a prefill, then any mix of chunks and single-token decodes."""
    total = draw(st.integers(min_total, max_total))
    segments: list[int] = []
    remaining = total
    while remaining:
        n = draw(st.one_of(st.just(1), st.integers(1, remaining)))
        n = min(n, remaining)
        segments.append(n)
        remaining -= n
    return segments
