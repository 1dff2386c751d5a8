"""The cache holds exactly the K/V written, per layer and batch row, whatever the split."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from infer import create_cache
from infer.errors import CacheFullError
from tests.helpers import TEST_DEVICE, tiny_config
from tests.property.strategies import splits


@given(split=splits(), batch=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_contiguous_returns_everything_written(split: list[int], batch: int, seed: int) -> None:
    config = tiny_config(num_layers=2, num_kv_heads=2, head_dim=4)
    total = sum(split)
    cache = create_cache("contiguous", config, max_seq_len=total, batch_size=batch)
    gen = torch.Generator().manual_seed(seed)
    # Distinct K/V per layer, row, head and position, so a misplaced write cannot go unseen.
    k_all = torch.randn(2, batch, 2, total, 4, generator=gen).to(TEST_DEVICE)
    v_all = torch.randn(2, batch, 2, total, 4, generator=gen).to(TEST_DEVICE)
    start = 0
    for n in split:
        for layer in range(2):
            k, v = cache.update(layer, k_all[layer, :, :, start : start + n], v_all[layer, :, :, start : start + n])
            assert torch.equal(k, k_all[layer, :, :, : start + n])
            assert torch.equal(v, v_all[layer, :, :, : start + n])
            positions = cache.key_positions(layer, 0)
            assert positions.tolist() == list(range(start))  # before advance: the old tokens only
        cache.advance(n)
        start += n
    assert cache.offset == total


def test_write_past_capacity_raises_and_keeps_contents() -> None:
    config = tiny_config(num_layers=1, num_kv_heads=1, head_dim=4)
    cache = create_cache("contiguous", config, max_seq_len=5)
    k = torch.randn(1, 1, 4, 4, device=TEST_DEVICE)
    cache.update(0, k, k)
    cache.advance(4)
    before = cache.k_cache.clone()  # type: ignore[attr-defined]
    more = torch.ones(1, 1, 2, 4, device=TEST_DEVICE)
    with pytest.raises(CacheFullError, match="max_seq_len=5"):
        cache.update(0, more, more)
    assert torch.equal(cache.k_cache, before)  # type: ignore[attr-defined]
    assert cache.offset == 4


def test_shape_mismatch_is_a_clear_error() -> None:
    config = tiny_config(num_layers=1, num_kv_heads=2, head_dim=4)
    cache = create_cache("contiguous", config, max_seq_len=8, batch_size=2)
    with pytest.raises(ValueError, match="kv_heads=2"):
        wrong = torch.zeros(2, 3, 1, 4, device=TEST_DEVICE)
        cache.update(0, wrong, wrong)


def test_reset_empties() -> None:
    config = tiny_config(num_layers=1)
    cache = create_cache("contiguous", config, max_seq_len=8)
    k = torch.randn(1, 2, 3, 8, device=TEST_DEVICE)
    cache.update(0, k, k)
    cache.advance(3)
    cache.reset()
    assert cache.offset == 0
    out, _ = cache.update(0, k[:, :, :1], k[:, :, :1])
    assert out.shape[2] == 1


def test_unknown_kind_names_the_kinds() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        create_cache("nope", tiny_config(), max_seq_len=4)
