"""The Triton kernels against the PyTorch formula, on shapes Hypothesis draws (head dims 40-256, GQA groups,
block sizes, lengths crossing block and split boundaries, sliding windows, softcap). Without a GPU they run
under Triton's interpreter (`TRITON_INTERPRET=1`, set by tests/conftest.py), so CI checks them on its CPU;
`pytest -m triton` selects them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from infer.attention import attention_reference
from infer.kernels import triton_available
from tests.helpers import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not triton_available(DEVICE), reason="needs Triton (pip install triton), and CUDA or "
                                                           "TRITON_INTERPRET=1"),
]


@st.composite
def paged_problems(draw: st.DrawFn) -> dict:
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    head_dim = draw(st.sampled_from([40, 64, 80, 96, 128, 256]))
    block_size = draw(st.sampled_from([1, 3, 5, 8, 16, 17]))
    lengths = draw(st.lists(st.integers(1, 48), min_size=1, max_size=4))
    return {
        "kv_heads": kv_heads, "group": group, "head_dim": head_dim, "block_size": block_size, "lengths": lengths,
        "window": draw(st.none() | st.integers(1, 20)),
        "softcap": draw(st.none() | st.sampled_from([5.0, 30.0])),
        "blocks_per_split": draw(st.none() | st.integers(1, 5)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def reference(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, tables: torch.Tensor,
              lengths: list[int], scale: float, softcap: float | None, window: int | None) -> torch.Tensor:
    """Gather each sequence's keys in position order, then the textbook formula with its mask."""
    rows = []
    for b, n in enumerate(lengths):
        nb = -(-n // k_blocks.shape[2])
        keys = k_blocks[tables[b, :nb]].transpose(0, 1).flatten(1, 2)[None, :, :n]
        values = v_blocks[tables[b, :nb]].transpose(0, 1).flatten(1, 2)[None, :, :n]
        pos = torch.arange(n, device=q.device)
        visible = pos <= n - 1 if window is None else (pos <= n - 1) & (pos > n - 1 - window)
        rows.append(attention_reference(q[b][None, :, None], keys, values, visible[None], scale, softcap)[0, :, 0])
    return torch.stack(rows)


def build(p: dict, dtype: torch.dtype) -> tuple:
    gen = torch.Generator().manual_seed(p["seed"])
    B, bs = len(p["lengths"]), p["block_size"]
    most = max(-(-n // bs) for n in p["lengths"])
    num_blocks = B * most + 3
    shape = (num_blocks, p["kv_heads"], bs, p["head_dim"])
    # Every slot no sequence owns is NaN: the kernel must never read it into a sum (masked loads).
    k_blocks = torch.full(shape, float("nan"))
    v_blocks = torch.full(shape, float("nan"))
    order = torch.randperm(num_blocks, generator=gen)
    tables = order[: B * most].view(B, most).clone()
    for b, n in enumerate(p["lengths"]):
        for pos in range(n):
            blk, slot = tables[b, pos // bs], pos % bs
            k_blocks[blk, :, slot] = torch.randn(p["kv_heads"], p["head_dim"], generator=gen)
            v_blocks[blk, :, slot] = torch.randn(p["kv_heads"], p["head_dim"], generator=gen)
    q = torch.randn(B, p["kv_heads"] * p["group"], p["head_dim"], generator=gen)
    move = {"device": DEVICE, "dtype": dtype}
    return q.to(**move), k_blocks.to(**move), v_blocks.to(**move), tables.to(DEVICE)


@given(paged_problems())
def test_paged_decode_attention_equals_the_formula(p: dict) -> None:
    from infer.kernels.paged_attention import paged_decode_attention

    q, k_blocks, v_blocks, tables = build(p, torch.float32)
    scale = p["head_dim"] ** -0.5
    lengths = torch.tensor(p["lengths"], device=DEVICE)
    out = paged_decode_attention(q, k_blocks, v_blocks, tables, lengths, scale, p["softcap"], p["window"],
                                 p["blocks_per_split"])
    expected = reference(q, k_blocks, v_blocks, tables, p["lengths"], scale, p["softcap"], p["window"])
    assert not out.isnan().any(), "a masked NaN slot reached the output"
    assert_close(out, expected, 1e-5, "paged Triton kernel vs formula (fp32)")


@given(paged_problems())
def test_paged_decode_attention_in_bf16_is_within_bf16_rounding(p: dict) -> None:
    from infer.kernels.paged_attention import paged_decode_attention

    q, k_blocks, v_blocks, tables = build(p, torch.bfloat16)
    scale = p["head_dim"] ** -0.5
    lengths = torch.tensor(p["lengths"], device=DEVICE)
    out = paged_decode_attention(q, k_blocks, v_blocks, tables, lengths, scale, p["softcap"], p["window"],
                                 p["blocks_per_split"])
    assert out.dtype == torch.bfloat16
    expected = reference(q.float(), k_blocks.float(), v_blocks.float(), tables, p["lengths"], scale, p["softcap"],
                         p["window"])
    # Inputs are exact bf16 values and the kernel computes in fp32 (TF32 on a GPU): only the output's
    # rounding to bf16 (and TF32's) separates them.
    assert_close(out.float(), expected, 2e-2, "paged Triton kernel vs formula (bf16)")


def test_split_count_does_not_change_the_result() -> None:
    """Flash-decoding's combine: one split, a split per block, and the default give the same rows."""
    from infer.kernels.paged_attention import paged_decode_attention

    p = {"kv_heads": 2, "group": 3, "head_dim": 64, "block_size": 4, "lengths": [1, 9, 33], "window": None,
         "softcap": None, "blocks_per_split": None, "seed": 1}
    q, k_blocks, v_blocks, tables = build(p, torch.float32)
    lengths = torch.tensor(p["lengths"], device=DEVICE)
    outs = [paged_decode_attention(q, k_blocks, v_blocks, tables, lengths, 0.125, blocks_per_split=s)
            for s in (None, 1, 100)]
    assert_close(outs[1], outs[2], 1e-5, "split per block vs one split")
    assert_close(outs[0], outs[2], 1e-5, "default split vs one split")
