"""GGUF files: dequantization of each block type against llama.cpp's reference (`gguf.quants`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from infer.gguf_quants import BLOCK_TYPES, dequantize

gguf = pytest.importorskip("gguf")

# ---------------------------------------------------------------------------------------------------------------
# Dequantization, block type by block type, bit for bit against gguf.quants (llama.cpp's reference in Python).

# Byte offsets of each block type's fp16 scales (d, and the min or dmin): random bytes there could be inf or NaN.
SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
FLOAT_KINDS = {"F32": np.float32, "F16": np.float16}


def random_blocks(kind: str, n_blocks: int, seed: int) -> np.ndarray:
    """`n_blocks` blocks of `kind`: random bytes, with finite values wherever a float is stored."""
    rng = np.random.default_rng(seed)
    block_size, type_size, _ = BLOCK_TYPES[kind]
    if kind in FLOAT_KINDS:
        values = rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-6, 4, n_blocks)
        return values.astype(FLOAT_KINDS[kind]).view(np.uint8).reshape(n_blocks, type_size)
    if kind == "BF16":
        values = (rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-6, 6, n_blocks)).astype(np.float32)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n_blocks, type_size)
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[kind]:
        scales = (rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-4, 2, n_blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks


@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
@given(n_blocks=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
def test_dequantize_is_llama_cpps_bit_for_bit(kind: str, n_blocks: int, seed: int) -> None:
    blocks = random_blocks(kind, n_blocks, seed)
    block_size = BLOCK_TYPES[kind][0]
    expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]).reshape(-1).astype(np.float32)
    got = dequantize(torch.from_numpy(blocks.copy()), kind, (n_blocks * block_size,))
    assert got.dtype == torch.float32
    # Compared as bits: the same rounding everywhere, the same signed zeros.
    assert np.array_equal(got.numpy().view(np.int32), expected.view(np.int32)), kind


def test_dequantize_keeps_rows_in_order() -> None:
    weight = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    data = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
    got = dequantize(torch.from_numpy(data), "Q8_0", (6, 64))
    assert np.array_equal(got.numpy(), gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q8_0))
    assert (got - weight).abs().max() < weight.abs().max() / 100
