"""Attention over cached K/V equals attention over the full sequence; the fast path equals the formula."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from infer.attention import (
    attention,
    attention_mask,
    attention_reference,
    decode_attention,
    decode_attention_matmul,
)
from tests.helpers import assert_close


@st.composite
def qkv(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kv_heads = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    seq = draw(st.integers(1, 20))
    dim = draw(st.sampled_from([4, 8, 12]))
    batch = draw(st.integers(1, 2))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(batch, kv_heads * groups, seq, dim, generator=gen)
    k = torch.randn(batch, kv_heads, seq, dim, generator=gen)
    v = torch.randn(batch, kv_heads, seq, dim, generator=gen)
    return q, k, v


def per_head_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query head at a time, each reading KV head h // groups, by the textbook formula."""
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        scores = q[:, h] @ k[:, h // groups].transpose(-1, -2) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        out[:, h] = scores.softmax(-1) @ v[:, h // groups]
    return out


@given(qkv(), st.one_of(st.none(), st.integers(1, 8)))
def test_fast_path_equals_formula_and_per_head(tensors, window) -> None:
    q, k, v = tensors
    positions = torch.arange(q.shape[2])
    mask = attention_mask(positions, positions, window)
    scale = q.shape[-1] ** -0.5
    fast = attention(q, k, v, mask, scale)
    assert_close(fast, attention_reference(q, k, v, mask, scale), 1e-5, "sdpa vs formula")
    assert_close(fast, per_head_attention(q, k, v, mask), 1e-5, "sdpa vs per-head GQA")


@given(qkv(), st.data(), st.one_of(st.none(), st.integers(1, 8)))
def test_chunk_over_cache_equals_full_rows(tensors, data, window) -> None:
    q, k, v = tensors
    seq = q.shape[2]
    cached = data.draw(st.integers(0, seq - 1))
    positions = torch.arange(seq)
    scale = q.shape[-1] ** -0.5
    full = attention(q, k, v, attention_mask(positions, positions, window), scale)
    # Queries of the chunk only, against every key so far; the mask is [q_len, cached + q_len].
    chunk_mask = attention_mask(positions[cached:], positions, window)
    assert chunk_mask.shape == (seq - cached, seq)
    chunk = attention(q[:, :, cached:], k, v, chunk_mask, scale)
    assert_close(chunk, full[:, :, cached:], 1e-5, "chunk vs full")


def test_sliding_window_sees_exactly_window_keys() -> None:
    positions = torch.arange(10)
    mask = attention_mask(positions, positions, 3)
    assert mask.sum(-1).tolist() == [1, 2, 3, 3, 3, 3, 3, 3, 3, 3]
    assert mask[9].nonzero().flatten().tolist() == [7, 8, 9]


def test_empty_slots_are_never_visible() -> None:
    mask = attention_mask(torch.tensor([5]), torch.tensor([3, -1, 4, 5]))
    assert mask.tolist() == [[True, False, True, True]]


@given(qkv(), st.data(), st.one_of(st.none(), st.integers(1, 8)))
def test_decode_attention_equals_formula(tensors, data, window) -> None:
    q, k, v = tensors
    seq = k.shape[2]
    position = torch.tensor([seq - 1])
    mask = attention_mask(position, torch.arange(seq), window) if data.draw(st.booleans()) or window else None
    scale = q.shape[-1] ** -0.5
    one = q[:, :, -1:]
    assert_close(decode_attention(one, k, v, mask, scale), attention_reference(one, k, v, mask, scale), 1e-5,
                 "grouped decode attention vs formula")
    assert_close(decode_attention(one, k, v, mask, scale), per_head_attention(one, k, v, mask if mask is not None
                 else torch.ones(1, seq, dtype=torch.bool)), 1e-5, "grouped decode vs per-head")


@given(qkv(), st.data(), st.one_of(st.none(), st.integers(1, 8)), st.sampled_from([None, 5.0]))
def test_batched_decode_by_matmul_equals_formula_per_row(tensors, data, window, softcap) -> None:
    """The batched engine's matmul form: each row has its own length (a [B, 1, 1, S] mask), as padded rows
    of different sequences do; it must equal the formula and the fused form."""
    q, k, v = tensors
    batch, seq = k.shape[0], k.shape[2]
    lengths = torch.tensor([data.draw(st.integers(1, seq)) for _ in range(batch)])
    k_pos = torch.arange(seq)[None]
    visible = k_pos < lengths[:, None]
    if window is not None:
        visible &= k_pos > lengths[:, None] - 1 - window
    mask = visible[:, None, None, :]
    scale = q.shape[-1] ** -0.5
    one = q[:, :, -1:]
    reference = attention_reference(one, k, v, mask, scale, softcap)
    assert_close(decode_attention_matmul(one, k, v, mask, scale, softcap), reference, 1e-5, "matmul vs formula")
    if softcap is None:
        assert_close(decode_attention(one, k, v, mask, scale), reference, 1e-5, "sdpa vs formula, per-row mask")
