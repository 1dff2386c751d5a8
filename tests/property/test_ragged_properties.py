"""The ragged batch (infer/ragged.py) and the paged attention over it (infer/backends.py), for chunk orders the
scheduler seldom produces: prefill chunks ahead of, between and behind decode chunks, sequences whose blocks are
scattered through a pool of stale values, windows. Each sequence's queries must attend to exactly its own keys,
as dense attention over its history and its new tokens does, whatever the order and the decode kernel."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from infer.attention import attention_mask, attention_reference
from infer.backends import paged_attention
from infer.kernels import triton_available
from infer.kernels.native import native_kernels
from infer.ragged import DECODE_KERNELS, SeqChunk, build_ragged_batch
from tests.helpers import assert_close

KERNELS = [k for k in DECODE_KERNELS if k != "triton" or triton_available("cpu")]


# every_token: the prompt chunks' tokens too as rows of the native or Triton kernel (the engine's chunk_attention
# "native" / "triton").
@pytest.mark.parametrize("every_token", [False, True])
@given(data=st.data(), kv_heads=st.integers(1, 2), groups=st.integers(1, 3), head_dim=st.sampled_from([4, 8]),
       block_size=st.integers(1, 5), window=st.none() | st.integers(1, 9), kernel=st.sampled_from(KERNELS),
       seed=st.integers(0, 2**16))
def test_any_chunk_order_attends_each_sequence_to_its_own_keys(
        every_token: bool, data: st.DataObject, kv_heads: int, groups: int, head_dim: int, block_size: int,
        window: int | None, kernel: str, seed: int) -> None:
    if every_token:
        in_place = [k for k in ("native", "triton") if k in KERNELS and (k != "native" or native_kernels())]
        if not in_place:
            pytest.skip("no native build here, and no Triton")
        kernel = data.draw(st.sampled_from(in_place))
    seqs = data.draw(st.lists(st.tuples(st.integers(0, 14), st.one_of(st.just(1), st.integers(2, 7))),
                              min_size=1, max_size=5))  # (cached history, new tokens)
    order = data.draw(st.permutations(range(len(seqs))))
    gen = torch.Generator().manual_seed(seed)
    heads = kv_heads * groups
    need = [-(-(h + n) // block_size) for h, n in seqs]
    num_blocks = sum(need) + 2
    # A pool full of stale values from earlier owners; each sequence's blocks scattered through it.
    k_blocks = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen) * 50
    v_blocks = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen) * 50
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, history = [], []
    for (h, _), count in zip(seqs, need, strict=True):
        table, ids = ids[:count], ids[count:]
        k_hist = torch.randn(kv_heads, h, head_dim, generator=gen)
        v_hist = torch.randn(kv_heads, h, head_dim, generator=gen)
        for p in range(h):
            k_blocks[table[p // block_size], :, p % block_size] = k_hist[:, p]
            v_blocks[table[p // block_size], :, p % block_size] = v_hist[:, p]
        tables.append(table)
        history.append((k_hist, v_hist))
    chunks = [SeqChunk(seqs[i][0], seqs[i][1], tables[i]) for i in order]
    total = sum(c.num_tokens for c in chunks)
    q = torch.randn(1, heads, total, head_dim, generator=gen)
    k = torch.randn(1, kv_heads, total, head_dim, generator=gen)
    v = torch.randn(1, kv_heads, total, head_dim, generator=gen)
    batch = build_ragged_batch(chunks, [True] * len(chunks), block_size=block_size, windows=[window],
                               device=torch.device("cpu"), decode_kernel=kernel, every_token=every_token)
    out = paged_attention(q, k, v, k_blocks, v_blocks, batch, window, scale=0.3)
    row = 0
    for i in order:
        h, n = seqs[i]
        keys = torch.cat((history[i][0], k[0, :, row : row + n]), dim=1)[None]
        values = torch.cat((history[i][1], v[0, :, row : row + n]), dim=1)[None]
        mask = attention_mask(torch.arange(h, h + n), torch.arange(h + n), window)
        expected = attention_reference(q[:, :, row : row + n], keys, values, mask, 0.3)
        assert_close(out[:, :, row : row + n], expected, 1e-5, f"sequence {i} (history {h}, {n} new) in order {order}")
        row += n
    assert torch.equal(batch.sample_rows, torch.tensor([sum(seqs[j][1] for j in order[: p + 1]) - 1
                                                       for p in range(len(order))]))
