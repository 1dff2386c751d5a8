"""Quantized weights (infer/quant_weights.py): the formats against their definitions, the GGUF re-layout against
llama.cpp's dequantization, the native kernels against dequantize-then-matmul on every instruction-set path, and
whole models against the same model holding the dequantized weights, and that model against transformers."""

from __future__ import annotations

import json
import os
import shutil
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import infer
from infer.errors import CheckpointError
from infer.gguf_quants import dequantize as gguf_dequantize
from infer.kernels.native import FLAVOUR_NEEDS, FLAVOURS, native_kernels
from infer.models.transformer import QuantizedEmbedding, QuantizedLinear
from infer.quant_weights import (
    STORED_KINDS,
    PackedCodes,
    QuantizedWeight,
    from_gguf,
    pack_codes,
    pack_q4,
    quantize,
    quantize_int4,
    quantize_int8,
    unpack_q4,
)
from reference.checkpoints import build_checkpoint
from reference.oracle import Oracle
from tests.helpers import (
    assert_close,
    dequantized_twin,
    env_set,
    fma32,
    fp32_bound,
    on_threads,
    reference_product,
    weight_of,
    with_significant_bits,
)
from tests.test_gguf import random_blocks

ARCHS = ["llama", "qwen2", "qwen3", "gemma3_text"]


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":")[1].split()}


FLAGS = cpu_flags()
RUNNABLE = [f for f in FLAVOURS if all(flag in FLAGS for flag in FLAVOUR_NEEDS[f])]


def kernels_or_skip(flavour: str = "native") -> Any:
    kernels = native_kernels(flavour)
    if kernels is None:
        pytest.skip(f"no native build for {flavour}")
    return kernels


# ---------------------------------------------------------------------------------------------------------------
# The formats.

@given(n=st.integers(1, 6), runs=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_q4_packing_round_trips_in_llama_cpps_order(n: int, runs: int, seed: int) -> None:
    q = torch.randint(0, 16, (n, 32 * runs), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_q4(q)
    assert packed.shape == (n, 16 * runs) and torch.equal(unpack_q4(packed), q)
    # byte j of a run: element j in the low nibble, element j + 16 in the high one (ggml's Q4_0 order)
    assert torch.equal(packed[:, :16] & 0x0F, q[:, :16]) and torch.equal(packed[:, :16] >> 4, q[:, 16:32])


@given(n=st.integers(1, 8), runs=st.integers(1, 6), seed=st.integers(0, 2**31), spread=st.floats(1e-3, 1e3))
def test_int8_is_symmetric_per_channel_within_half_a_step(n: int, runs: int, seed: int, spread: float) -> None:
    w = torch.randn(n, 32 * runs, generator=torch.Generator().manual_seed(seed)) * spread
    q = quantize_int8(w)
    assert q.fmt == "q8" and q.group == w.shape[1] and q.mins is None and q.scales.dtype == torch.float32
    assert int(q.codes.abs().max()) <= 127
    assert (q.codes.abs().amax(dim=1) == 127).all()  # each row's largest weight uses the full range
    step = q.scales.float()
    assert ((w - q.dequantize()).abs() <= step / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("group", [32, 64, 128])
@given(n=st.integers(1, 6), seed=st.integers(0, 2**31), shift=st.floats(-5, 5))
def test_int4_is_asymmetric_per_group_within_half_a_step(group: int, n: int, seed: int, shift: float) -> None:
    w = torch.randn(n, 256, generator=torch.Generator().manual_seed(seed)) + shift
    q = quantize_int4(w, group)
    assert q.fmt == "q4" and q.group == group and q.scales.shape == (n, 256 // group)
    assert q.scales.dtype == q.mins.dtype == torch.float16  # type: ignore[union-attr]
    codes = unpack_q4(q.codes)
    assert int(codes.max()) <= 15
    err = (w - q.dequantize()).abs().reshape(n, -1, group)
    step = q.scales.float().unsqueeze(-1)
    # half a step, plus the float16 rounding of the stored min and scale (relative 2^-11 of the group's values)
    slack = 2**-10 * w.abs().reshape(n, -1, group).amax(dim=-1, keepdim=True) + 1e-6
    assert (err <= step / 2 + slack).all()


def test_quantizers_refuse_what_they_cannot_hold() -> None:
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize_int4(torch.randn(4, 96), 48)
    with pytest.raises(ValueError, match="q_proj.weight: 96 inputs are not a multiple of group_size=64"):
        quantize_int4(torch.randn(4, 96), 64, "q_proj.weight")
    with pytest.raises(ValueError, match="40 inputs are not a multiple of 32"):
        quantize_int8(torch.randn(4, 40))
    with pytest.raises(ValueError, match="only 2-D float weights"):
        quantize_int8(torch.randn(64))


@pytest.mark.parametrize("kind", STORED_KINDS)
@given(rows=st.integers(1, 5), blocks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_gguf_blocks_kept_as_stored_dequantize_as_llama_cpp(kind: str, rows: int, blocks: int, seed: int) -> None:
    per_block = 256 if kind in ("Q4_K", "Q6_K") else 32
    raw = torch.from_numpy(random_blocks(kind, rows * blocks, seed).copy())
    weight = from_gguf(raw, kind, (rows, blocks * per_block))
    expected = gguf_dequantize(raw, kind, (rows, blocks * per_block))
    assert weight.scheme == kind and weight.group == (16 if kind == "Q6_K" else 32)
    chunked = from_gguf(raw, kind, (rows, blocks * per_block), rows=2)  # re-laid out two rows at a time
    assert all(torch.equal(a, b) for a, b in zip(chunked.tensors(), weight.tensors(), strict=True)), kind
    # Equal values (Q4_0's d * q + (-8 d) gives +0 where llama.cpp's (q - 8) * d gives -0 for a negative d).
    assert np.array_equal(weight.dequantize().numpy(), expected.numpy()), kind
    if kind in ("Q4_K", "Q6_K"):  # the k-quants keep their scales factored: a few bytes a super-block over the file's
        file_bytes = {"Q4_K": 144, "Q6_K": 210}[kind] * rows * blocks
        # the file packs Q4_K's 6-bit scales and mins in 12 bytes (we keep a byte each: 16) and Q6_K's 6-bit codes
        # (a byte each: 64 more)
        extra = {"Q4_K": 4, "Q6_K": 64}[kind] * rows * blocks
        assert weight.factored and weight.nbytes == file_bytes + extra, (kind, weight.nbytes, file_bytes)
        assert np.array_equal(weight.unfactored().dequantize().numpy(), expected.numpy()), kind


# ---------------------------------------------------------------------------------------------------------------
# The native kernels, every path this CPU runs, against dequantize-then-matmul.

@pytest.mark.parametrize("flavour", RUNNABLE)
# INFER_QGEMV_FOUR_RUNS, INFER_QGEMV_Q6_PAIRS, INFER_QGEMV_Q8_PAIRS, INFER_QGEMV_WIDEN_SCALES, INFER_QGEMV_ROWS and
# INFER_QGEMV_ROW_PAIRS: the bf16 q4, Q6_K and q8 fast paths, Q8_0's float32 copy of a row's scales, AVX2's rows of
# codes four at once and AVX512-BF16's q4 rows two at once, and their checks
@pytest.mark.parametrize("four_runs", ["1", "0"])
@given(scheme=st.sampled_from(["int8", "int4", "Q8_0", "Q4_K", "Q6_K", "Q4_K-factored", "Q6_K-factored"]),
       n=st.integers(1, 40), runs=st.integers(1, 13),
       group=st.sampled_from([32, 64, 128]), m=st.integers(1, 9), dtype=st.sampled_from(["float32", "bfloat16"]),
       with_bias=st.booleans(), threads=st.integers(1, 3), seed=st.integers(0, 2**31))
@example(scheme="int4", n=17, runs=8, group=32, m=2, dtype="bfloat16", with_bias=False, threads=1, seed=0)
@settings(max_examples=40, deadline=None)  # (the example: q4 codes' four-run path, which random draws can miss)
def test_native_quantized_gemv_is_dequantize_then_matmul(flavour: str, four_runs: str, scheme: str, n: int,
                                                         runs: int, group: int, m: int, dtype: str, with_bias: bool,
                                                         threads: int, seed: int) -> None:
    kernels = kernels_or_skip(flavour)
    os.environ["INFER_QGEMV_FOUR_RUNS"] = four_runs  # read by the kernel on each call; restored below
    os.environ["INFER_QGEMV_Q6_PAIRS"] = four_runs
    os.environ["INFER_QGEMV_Q8_PAIRS"] = four_runs
    os.environ["INFER_QGEMV_WIDEN_SCALES"] = four_runs
    os.environ["INFER_QGEMV_ROWS"] = four_runs
    os.environ["INFER_QGEMV_ROW_PAIRS"] = four_runs
    group = group if scheme == "int4" else 16 if scheme.startswith("Q6_K") else 32
    k = max(runs * 32 // group, 1) * group
    if scheme.endswith("-factored"):  # a k-quant's rows are whole super-blocks of 256
        k = 256 * (1 + runs % 2)
    weight = weight_of(scheme, n, k, group, seed)
    torch_dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g).to(torch_dtype)
    bias = torch.randn(n, generator=g).to(torch_dtype) if with_bias else None
    with on_threads(threads):  # rows split in 16-row ranges per thread
        got = kernels.quantized_gemv(weight, x, bias)
    os.environ.pop("INFER_QGEMV_FOUR_RUNS")
    os.environ.pop("INFER_QGEMV_Q6_PAIRS")
    os.environ.pop("INFER_QGEMV_Q8_PAIRS")
    os.environ.pop("INFER_QGEMV_WIDEN_SCALES")
    os.environ.pop("INFER_QGEMV_ROWS")
    os.environ.pop("INFER_QGEMV_ROW_PAIRS")
    assert_product_within_rounding(got, weight, x, bias, f"{flavour} {scheme}")


def gemv_off_and_on(kernels: Any, switch: str, weight: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None,
                    threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantized_gemv` on `threads` threads with the kernels' `switch` off, then on (read at each call)."""
    with on_threads(threads):
        with env_set(switch, "0"):
            off = kernels.quantized_gemv(weight, x, bias)
        with env_set(switch, "1"):
            on = kernels.quantized_gemv(weight, x, bias)
    return off, on


@pytest.mark.parametrize("flavour", RUNNABLE)
@given(scheme=st.sampled_from(["int4", "Q8_0", "Q4_K", "Q4_K-factored", "int8-g32"]), n=st.integers(1, 70),
       runs=st.integers(1, 30), dtype=st.sampled_from(["float32", "bfloat16"]), with_bias=st.booleans(),
       threads=st.integers(1, 3), seed=st.integers(0, 2**31))
@example(scheme="int4", n=37, runs=24, dtype="bfloat16", with_bias=True, threads=2, seed=0)
@settings(max_examples=30, deadline=None)
def test_one_row_products_on_rows_of_codes_four_at_once_are_the_row_by_row_sums(
        flavour: str, scheme: str, n: int, runs: int, dtype: str, with_bias: bool, threads: int, seed: int) -> None:
    """One row of x against codes with a scale per run of 32 (int4 in groups of 32; Q4_0 / Q4_1 / Q8_0 / Q4_K files;
    int8 in groups of 32, the LM head's): AVX2 takes each thread's rows four at once (`INFER_QGEMV_ROWS`, the rest
    one by one), each row's sums in the one-row order, so bit for bit the row-by-row product; elsewhere the switch
    changes nothing. Row counts that leave 0-3 rows over per thread, with and without a bias."""
    kernels = kernels_or_skip(flavour)
    k = 256 * (1 + runs % 2) if scheme.endswith("-factored") else runs * 32
    g = torch.Generator().manual_seed(seed + 1)
    weight = (quantize(torch.randn(n, k, generator=g), "int8-g32") if scheme == "int8-g32"
              else weight_of(scheme, n, k, 32, seed))
    x = torch.randn(1, k, generator=g).to(getattr(torch, dtype))
    bias = torch.randn(n, generator=g).to(x.dtype) if with_bias else None
    row_by_row, four_at_once = gemv_off_and_on(kernels, "INFER_QGEMV_ROWS", weight, x, bias, threads)
    assert torch.equal(four_at_once, row_by_row), f"{scheme} n={n} k={k}"
    assert_product_within_rounding(four_at_once, weight, x, bias, f"{flavour} {scheme}")


@pytest.mark.parametrize("flavour", RUNNABLE)
@given(scheme=st.sampled_from(["int4", "Q4_K"]), group=st.sampled_from([32, 64, 128]), n=st.integers(1, 70),
       runs=st.integers(4, 30), with_bias=st.booleans(), threads=st.integers(1, 3), seed=st.integers(0, 2**31))
@example(scheme="int4", group=32, n=37, runs=18, with_bias=True, threads=2, seed=0)  # (k = 576: a last 64 codes)
@settings(max_examples=30, deadline=None)
def test_one_row_q4_products_on_rows_of_codes_two_at_once_are_the_row_by_row_sums(
        flavour: str, scheme: str, group: int, n: int, runs: int, with_bias: bool, threads: int, seed: int) -> None:
    """One bf16 row of x against q4 codes (int4 in groups of 32-128, Q4_K's 32; k of 128 and more, with a last 64
    or 32 codes past the whole 128s): AVX512-BF16 takes each thread's rows of codes two at once
    (`INFER_QGEMV_ROW_PAIRS`, an odd row left one by one), each row's sums in the one-row order, so bit for bit the
    row-by-row product, and within rounding of dequantize-then-matmul; elsewhere the switch changes nothing."""
    kernels = kernels_or_skip(flavour)
    group = group if scheme == "int4" else 32
    k = max(runs * 32 // group, 1) * group
    weight = weight_of(scheme, n, k, group, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    before, x_before = [t.clone() for t in weight.tensors()], x.clone()
    row_by_row, two_at_once = gemv_off_and_on(kernels, "INFER_QGEMV_ROW_PAIRS", weight, x, bias, threads)
    assert torch.equal(two_at_once, row_by_row), f"{scheme} n={n} k={k} group={group}"
    assert_product_within_rounding(two_at_once, weight, x, bias, f"{flavour} {scheme}")
    assert torch.equal(x, x_before) and all(torch.equal(a, b) for a, b in zip(weight.tensors(), before, strict=True))


@pytest.mark.parametrize("flavour", RUNNABLE)
@given(n=st.integers(1, 40), runs=st.integers(1, 30), m=st.integers(1, 6),
       dtype=st.sampled_from(["float32", "bfloat16"]), with_bias=st.booleans(), threads=st.integers(1, 3),
       seed=st.integers(0, 2**31))
@example(n=37, runs=24, m=1, dtype="bfloat16", with_bias=True, threads=2, seed=0)  # (q4 rows two at once)
@settings(max_examples=30, deadline=None)
def test_q4_0_mins_formed_from_the_scales_are_the_stored_mins_bit_for_bit(
        flavour: str, n: int, runs: int, m: int, dtype: str, with_bias: bool, threads: int, seed: int) -> None:
    """A Q4_0 file's weight as loaded (codes, float16 d, mins -8 d): the one-row kernel forms each min from its scale
    instead of reading the mins (`INFER_QGEMV_FORMED_MINS`; -8 d is exact) and gives bit for bit what reading them
    gives, on every instruction-set path, row count and dtype, within rounding of dequantize-then-matmul. A Q4_0
    weight whose mins are not -8 d (a stored file cannot make one, a caller can), or the same tensors under another
    scheme, are read as they are."""
    kernels = kernels_or_skip(flavour)
    k = runs * 32
    weight = from_gguf(torch.from_numpy(random_blocks("Q4_0", n * k // 32, seed).copy()), "Q4_0", (n, k))
    assert weight.mins_are_eight_scales and weight.mins is not None
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g).to(getattr(torch, dtype))
    bias = torch.randn(n, generator=g).to(x.dtype) if with_bias else None
    read, formed = gemv_off_and_on(kernels, "INFER_QGEMV_FORMED_MINS", weight, x, bias, threads)
    odd = QuantizedWeight("Q4_0", weight.codes, weight.scales, weight.mins + 1, 32)
    with on_threads(threads):
        shifted = kernels.quantized_gemv(odd, x, bias)
    assert torch.equal(formed, read), f"n={n} k={k} m={m}"
    assert_product_within_rounding(formed, weight, x, bias, f"{flavour} Q4_0")
    assert not odd.mins_are_eight_scales
    assert_product_within_rounding(shifted, odd, x, bias, f"{flavour} Q4_0, mins not -8 d")
    assert not QuantizedWeight("Q4_1", weight.codes, weight.scales, weight.mins, 32).mins_are_eight_scales


@pytest.mark.real_model
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_real_models_products_on_rows_of_codes_four_at_once_are_the_row_by_row_sums(dtype: torch.dtype) -> None:
    """SmolLM2's own Q4_1 and Q8_0 products (every layer's and the head's, as stored in its file) against one row of
    x: bit for bit the row-by-row product with AVX2's four rows at once (`INFER_QGEMV_ROWS`) and AVX512-BF16's q4
    rows two at once (`INFER_QGEMV_ROW_PAIRS`; k = 576: a last 64 codes past the whole 128s) on and off."""
    kernels = kernels_or_skip()
    model = infer.load_model(None, dtype=str(dtype).removeprefix("torch."), weights="stored")
    products = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert {p.qweight.scheme for p in products} == {"Q4_1", "Q8_0"}
    g = torch.Generator().manual_seed(0)
    for product in products:
        x = torch.randn(1, product.in_features, generator=g).to(dtype)
        with env_set("INFER_QGEMV_ROWS", "0"), env_set("INFER_QGEMV_ROW_PAIRS", "0"):
            row_by_row = kernels.quantized_gemv(product.qweight, x)
        with env_set("INFER_QGEMV_ROWS", "1"), env_set("INFER_QGEMV_ROW_PAIRS", "1"):
            assert torch.equal(kernels.quantized_gemv(product.qweight, x), row_by_row), product.qweight.scheme


def assert_product_within_rounding(got: torch.Tensor, weight: QuantizedWeight, x: torch.Tensor,
                                   bias: torch.Tensor | None, what: str) -> None:
    """`got` is dequantize-then-matmul within fp32 sums in another order (and, the bf16 pair paths of q4 and Q6_K,
    codes offset by 128 or 160): a few fp32 ulps of the summed magnitudes; then one rounding to the output dtype."""
    assert got.dtype == x.dtype and got.shape == (x.shape[0], weight.shape[0])
    exact = reference_product(weight, x, bias)
    offset = 160 if weight.scheme == "Q6_K" else 128 if weight.mins is not None else 0
    scales = weight.unfactored().scales
    magnitude = x.double().abs() @ (weight.dequantize().double().abs() + offset * scales.double().abs()
                                    .repeat_interleave(weight.group, dim=1)).T
    ulp = 2.0**-8 if x.dtype == torch.bfloat16 else 2.0**-24  # the one rounding to the output dtype
    bound = 1e-6 * magnitude + ulp * exact.abs() + 1e-30
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), f"{what}: max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("scheme,group", [("int8", None), ("int8", 64), ("int8", 128), ("int8", 32), ("Q8_0", 32)])
@pytest.mark.parametrize("runs", [1, 3, 8, 20])
def test_q8_codes_against_bf16_rows_are_dequantize_then_matmul(scheme: str, group: int | None, runs: int) -> None:
    """The q8 pair path (int8 codes packed to bf16 operands, two sums by run parity; groups of 64 inputs or more)
    at every row count of its four-row tiles, odd and even group counts, against dequantize-then-matmul; and its
    check, the widening path (which groups of 32 always take; Q8_0's float16 scales made float32 a row at a time,
    16 at a time and the rest one by one)."""
    kernels = kernels_or_skip()
    k = runs * (group or 32)  # runs groups (per channel: runs runs)
    g = torch.Generator().manual_seed(runs)
    weight = weight_of("Q8_0", 37, k, 32, runs) if scheme == "Q8_0" else quantize_int8(torch.randn(37, k, generator=g),
                                                                                     group=group)
    for m in (1, 2, 4, 6):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        bias = torch.randn(37, generator=g).to(torch.bfloat16)
        for pairs in ("1", "0"):  # the fast paths (pairs; Q8_0's scales widened per row) and their checks
            os.environ["INFER_QGEMV_Q8_PAIRS"] = os.environ["INFER_QGEMV_WIDEN_SCALES"] = pairs
            try:
                got = kernels.quantized_gemv(weight, x, bias)
            finally:
                os.environ.pop("INFER_QGEMV_Q8_PAIRS")
                os.environ.pop("INFER_QGEMV_WIDEN_SCALES")
            assert_product_within_rounding(got, weight, x, bias, f"{scheme} group {group} m {m} pairs {pairs}")


@pytest.mark.parametrize("flavour", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_dequantize_is_the_reference_bit_for_bit(flavour: str, dtype: torch.dtype) -> None:
    kernels = kernels_or_skip(flavour)
    if dtype not in kernels.dtypes:
        pytest.skip(f"{flavour} computes no {dtype}")
    for scheme in ("int8", "int4", "Q8_0", "Q4_K", "Q6_K", "Q4_K-factored", "Q6_K-factored"):
        weight = weight_of(scheme, 19, 512, 64, 7)
        assert torch.equal(kernels.dequantize(weight, dtype), weight.dequantize(dtype)), scheme


@pytest.mark.parametrize("flavour", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows_dequantized_natively_are_the_formulas(flavour: str, dtype: torch.dtype) -> None:
    """A one-token step's quantized embedding (its native small ops given) dequantizes the looked-up rows by the
    native dequantizer: every stored variant's rows bit for bit the formula's (`native` absent), repeated ids
    and the first and last rows among them; codes the dequantizer cannot take keep the formula."""
    kernels = kernels_or_skip(flavour)
    ids = torch.tensor([[0, 18, 7, 7]])
    for scheme in ("int8", "int4", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q4_K-factored", "Q6_K-factored"):
        weight = from_gguf(torch.from_numpy(random_blocks("Q4_0", 19 * 512 // 32, 3)), "Q4_0", (19, 512)) \
            if scheme == "Q4_0" else weight_of(scheme, 19, 512, 64, 7)
        table = QuantizedEmbedding(weight, dtype)
        want = weight.dequantize(dtype)[ids]
        for rows in (ids[:, :1], ids):
            assert torch.equal(table(rows, kernels), want[:, : rows.shape[1]]), scheme
            assert torch.equal(table(rows), want[:, : rows.shape[1]]), scheme
    plain = weight_of("int4", 5, 64, 32, 1)  # bfloat16 scales, which the native kernels do not read: the formula
    odd = QuantizedWeight("int4", plain.codes, plain.scales.bfloat16(), plain.mins.bfloat16(), 32)
    assert torch.equal(QuantizedEmbedding(odd, dtype)(ids[:, :2] % 5, kernels), odd.dequantize(dtype)[[0, 3]][None])


@pytest.mark.parametrize("slab_rows", [None, 1, 5, 19])
def test_multi_row_products_through_the_reused_buffer_are_the_gemm_on_the_dequantized_weight(
        slab_rows: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill path dequantizes into a per-thread buffer, whole or (a weight larger than the buffer) in slabs of
    rows: every output column equals F.linear on the reference dequantization within fp32 rounding, bias included,
    and a buffer filled by a larger weight or another dtype serves the next call unchanged."""
    from infer.models import transformer

    kernels = kernels_or_skip()
    if slab_rows is not None:
        monkeypatch.setattr(transformer, "DEQUANTIZE_BUFFER", slab_rows * 256)
    monkeypatch.setattr(transformer, "_buffers", __import__("threading").local())
    gen = torch.Generator().manual_seed(11)
    for scheme, dtype in (("int4", torch.float32), ("Q8_0", torch.bfloat16), ("int8", torch.float32)):
        weight = weight_of(scheme, 19, 256, 64, 12)
        x = torch.randn(3, 7, 256, generator=gen).to(dtype)
        bias = torch.randn(19, generator=gen).to(dtype)
        got = transformer.dequantized_product(kernels, x, weight, bias).float()
        want = F.linear(x.float(), weight.dequantize(dtype).float(), bias.float())
        assert got.shape == (3, 7, 19)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        assert (got - want).abs().max().item() <= tolerance * max(1.0, want.abs().max().item()), (scheme, slab_rows)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.dequantize(weight_of("int8", 4, 64, 32, 1), torch.float32, torch.empty(4, 32))


def test_native_quantized_gemv_refuses_a_bad_shape() -> None:
    kernels = kernels_or_skip()
    weight = quantize_int8(torch.randn(4, 64))
    odd = QuantizedWeight("int8", weight.codes[:, :48].contiguous(), weight.scales, None, 48)
    with pytest.raises(ValueError, match="k a multiple of 32 and groups of whole runs"):
        kernels.quantized_gemv(odd, torch.randn(1, 48))


# ---------------------------------------------------------------------------------------------------------------
# Whole models: the quantized model is the model holding the dequantized weights.

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("form", ["linear", "native", "native, one row", "native, packed"])
def test_quantized_model_is_the_model_with_dequantized_weights(arch: str, scheme: str, form: str) -> None:
    """"linear": the reference dequantization into F.linear; "native": the kernel on the codes up to the measured
    rows; "native, one row": the kernel for one-token steps only, the native dequantizer into the GEMM beyond;
    "native, packed": every product, one-token steps' too, on the codes packed at load (`packed_products`)."""
    if form != "linear":
        kernels = kernels_or_skip()
        if form == "native, packed" and not kernels.packed_codes_f32_available:
            pytest.skip(f"fp32 rows of packed codes are AVX2's channel form (this build: {kernels.isa})")
    path = build_checkpoint(arch)
    model = infer.load_model(path, weights=scheme, decode_gemv=form.split(",")[0],
                             packed_products=None if form == "linear" else form == "native, packed")
    assert model.packed_products == (form == "native, packed")
    if form == "native, packed":
        assert all(p.takes_packed(1) for p in model.packable_products()), "one-row products on the packed codes"
    if form == "native, one row":
        model.quantized_rows = 1
    assert model.quantized and all(isinstance(m, QuantizedLinear) for m in
                                   (model.lm_head, model.layers[0].self_attn.q_proj, model.layers[0].mlp.down_proj))
    twin = dequantized_twin(model, path)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    cache, twin_cache = (infer.create_cache("contiguous", model.config, max_seq_len=40) for _ in range(2))
    with torch.inference_mode():
        # prefill chunks on both sides of the native kernel's row limit, then one-token steps
        for start, end in ((0, 5), (5, 25), (25, 30), *((t, t + 1) for t in range(30, 36))):
            got = model(ids[:, start:end], cache, all_logits=True)
            expected = twin(ids[:, start:end], twin_cache, all_logits=True)
            assert_close(got, expected, fp32_bound(expected), f"{arch}/{scheme}/{form} tokens {start}:{end}")
    if scheme == "int4":
        assert not torch.equal(twin.lm_head.weight, infer.load_model(path).lm_head.weight)  # it did quantize


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
def test_quantized_model_equals_transformers_on_the_dequantized_checkpoint(arch: str, tmp_path: Path) -> None:
    """The oracle: transformers on a checkpoint whose matrices are our int4 dequantization."""
    path = build_checkpoint(arch)
    for item in path.iterdir():
        if item.suffix != ".safetensors" and item.is_file():
            shutil.copy(item, tmp_path / item.name)
    state = load_file(str(path / "model.safetensors"))
    tied = json.loads((path / "config.json").read_text()).get("tie_word_embeddings")
    # The projections in int4 (groups of 32); the LM head, and the embedding tied to it, int8 per 32 inputs.
    head = {"lm_head.weight", *(["model.embed_tokens.weight"] if tied else [])}
    body = {n for n, t in state.items() if t.dim() == 2 and "embed_tokens" not in n} - head
    save_file({n: quantize_int4(t, 32).dequantize() if n in body else quantize_int8(t, group=32).dequantize()
               if n in head and n in state else t for n, t in state.items()},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = infer.load_model(path, weights="int4", group_size=32)
    ids = torch.randint(0, model.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        ours = model(ids)
    expected = Oracle(tmp_path).logits(ids)
    assert_close(ours, expected, fp32_bound(expected), f"{arch} int4 vs transformers")
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_fused_quantized_projections_are_bit_exact_under_the_native_kernel() -> None:
    kernels_or_skip()
    model = infer.load_model(build_checkpoint("qwen2"), weights="int4", decode_gemv="native")
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    steps = []
    for fused in (False, True):
        model.fused_projections = fused
        cache = infer.create_cache("contiguous", model.config, max_seq_len=9)
        with torch.inference_mode():
            steps.append(torch.cat([model(ids[:, t : t + 1], cache) for t in range(9)]))
    assert isinstance(model.layers[0].self_attn.__dict__["qkv"], QuantizedLinear)
    assert torch.equal(steps[0], steps[1])


def test_greedy_generation_is_the_dequantized_models() -> None:
    path = build_checkpoint("llama")
    model = infer.load_model(path, weights="int4")
    twin = dequantized_twin(model, path)
    params = infer.SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [1, 5, 9, 12, 7]
    ours = infer.generate(model, None, prompt, params).token_ids  # type: ignore[arg-type]
    assert ours == infer.generate(twin, None, prompt, params).token_ids  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------------
# GGUF files run as stored, and quantized checkpoints saved and read back.

@pytest.fixture(scope="module")
def q_gguf(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from reference.gguf_convert import hf_to_gguf

    made: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("qgguf")

    def make(kind: str) -> tuple[Path, Path]:
        # Q4_K needs rows of 256: a wider tiny Llama.
        path = build_checkpoint("qwen3", hidden_size=256, intermediate_size=256, num_attention_heads=4, head_dim=64,
                                num_key_value_heads=2)
        if kind not in made:
            made[kind] = hf_to_gguf(path, root / f"{kind}.gguf", kind)
        return path, made[kind]

    return make


@pytest.mark.parametrize("kind", STORED_KINDS)
def test_a_gguf_runs_as_stored_and_equals_its_dequantization(kind: str, q_gguf: Any) -> None:
    pytest.importorskip("gguf")
    _, file = q_gguf(kind)
    stored = infer.load_model(file)
    dense = infer.load_model(file, dtype="float32", decode_gemv="linear")  # dtype= dequantizes
    assert stored.layers[0].self_attn.q_proj.scheme == kind and not dense.quantized
    for name, module in stored.named_modules():
        if isinstance(module, QuantizedLinear) and name != "lm_head":
            assert torch.equal(module.qweight.dequantize(), dense.get_submodule(name).weight), name
    ids = torch.randint(0, stored.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        got, expected = stored(ids), dense(ids)
    assert_close(got, expected, fp32_bound(expected), kind)
    cache = infer.create_cache("contiguous", stored.config, max_seq_len=31)
    with torch.inference_mode():
        stored(ids, cache)
        step = stored(ids[:, :1], cache)
        full = dense(torch.cat([ids, ids[:, :1]], 1))[:, -1:]
    assert_close(step, full, fp32_bound(full), f"{kind} decode step")


@pytest.mark.parametrize("source", ["int8", "int4", "Q4_K", "Q6_K"])
def test_a_quantized_model_saves_and_loads_in_one_step(source: str, q_gguf: Any, tmp_path: Path) -> None:
    if source in ("Q4_K", "Q6_K"):
        pytest.importorskip("gguf")
        model = infer.load_model(q_gguf(source)[1])
    else:
        model = infer.load_model(build_checkpoint("gemma3_text"), weights=source, group_size=64)
    out = infer.save_quantized(model, tmp_path / "saved")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "infer"
    assert set(config["quantization_config"]["schemes"]) == ({source, "int8"} if source == "int4" else {source})
    loaded = infer.load_model(out)
    assert loaded.quantized and loaded.layers[0].mlp.up_proj.scheme == source
    for name, module in model.named_modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            back = loaded.get_submodule(name)
            assert isinstance(back, type(module)) and back.group == module.group, name
            assert all(torch.equal(a, b) for a, b in zip(back.qweight.tensors(), module.qweight.tensors(),
                                                         strict=True)), name
    loaded.quantized_rows = model.quantized_rows  # timed at each load: the same kernels for the same bits
    ids = torch.randint(0, model.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        assert torch.equal(loaded(ids), model(ids))
        dense = infer.load_model(out, weights="dense")
        assert not dense.quantized
        assert_close(dense(ids), model(ids), fp32_bound(model(ids)), "dense load of a quantized checkpoint")
    assert infer.Tokenizer(out).encode("hello there") == infer.Tokenizer(model.source).encode("hello there")
    with pytest.raises(FileExistsError, match="not an empty folder"):
        infer.save_quantized(model, out)


def test_a_damaged_quantized_checkpoint_is_named(tmp_path: Path) -> None:
    model = infer.load_model(build_checkpoint("llama"), weights="int4")
    out = infer.save_quantized(model, tmp_path / "saved")
    tensors = load_file(str(out / "model.safetensors"))
    save_file(tensors, str(out / "model.safetensors"))  # the layout metadata dropped
    with pytest.raises(CheckpointError, match="need the 'infer.quantized' metadata"):
        infer.load_model(out)
    layouts = {"layers.0.mlp.up_proj": {"scheme": "int4", "group": 32, "shape": [128, 64]}}
    del tensors["model.layers.0.mlp.up_proj.mins"]
    others = {n: t for n, t in tensors.items() if not n.endswith(".codes") or "layers.0.mlp.up_proj" in n}
    save_file(others, str(out / "model.safetensors"), metadata={"infer.quantized": json.dumps(layouts)})
    with pytest.raises(CheckpointError, match="layers.0.mlp.up_proj lacks layers.0.mlp.up_proj.mins"):
        infer.load_model(out)


def test_q6_k_codes_outside_six_bits_are_refused(q_gguf: Any, tmp_path: Path) -> None:
    """The Q6_K kernels take its codes as 6-bit: a saved checkpoint holding others is named, not run."""
    pytest.importorskip("gguf")
    out = infer.save_quantized(infer.load_model(q_gguf("Q6_K")[1]), tmp_path / "saved")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(out / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.codes"][0, 5] = 40
    save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
    with pytest.raises(CheckpointError, match="Q6_K weight layers.1.mlp.down_proj has codes outside -32..31"):
        infer.load_model(out)


def test_bad_weight_options_are_named() -> None:
    path = build_checkpoint("llama")
    with pytest.raises(ValueError, match="weights must be one of"):
        infer.load_model(path, weights="int5")
    with pytest.raises(ValueError, match="group_size must be one of"):
        infer.load_model(path, weights="int4", group_size=48)


def test_a_group_size_that_does_not_divide_a_matrix_falls_back_for_that_matrix() -> None:
    model = infer.load_model(build_checkpoint("gemma3_text"), weights="int4", group_size=128)
    o_proj = model.layers[0].self_attn.o_proj  # 96 inputs in the tiny Gemma: 32 divides them, 64 and 128 do not
    assert o_proj.in_features == 96 and o_proj.group == 32
    assert model.layers[0].mlp.down_proj.group == 128


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_batched_engine_runs_quantized_weights_as_solo_generation_does(scheme: str) -> None:
    from infer.engine import Engine

    path = build_checkpoint("qwen3")
    model, tok = infer.load_model(path, weights=scheme), infer.Tokenizer(path)
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 45)), [3, 4]]
    params = [infer.SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 5, 12)]
    results = Engine(model, tok, num_blocks=64, block_size=4, max_num_batched_tokens=24).generate(prompts, params)
    for prompt, p, result in zip(prompts, params, results, strict=True):
        assert result.token_ids == infer.generate(model, tok, prompt, p).token_ids


# The draws of the quantized bf16 products' cases (`bf16_product_case`), beside each test's own row count n.
BF16_PRODUCT_DRAWS = {
    "scheme": st.sampled_from(["int8", "int4", "Q8_0", "Q4_K", "Q6_K", "Q4_K-factored", "Q6_K-factored"]),
    "runs": st.integers(1, 13), "group": st.sampled_from([32, 64, 128]), "m": st.integers(1, 21),
    "with_bias": st.booleans(), "threads": st.integers(1, 3), "seed": st.integers(0, 2**31),
}


@pytest.mark.skipif(native_kernels() is None or not native_kernels().gemm_bf16_available,
                    reason="the quantized tile kernel needs AVX512-BF16 (and a native build)")
@given(n=st.integers(1, 40), **BF16_PRODUCT_DRAWS)
@settings(max_examples=40, deadline=None)
def test_the_quantized_tile_kernel_is_the_gemm_on_the_bf16_dequantized_weight(
        scheme: str, n: int, runs: int, group: int, m: int, with_bias: bool, threads: int, seed: int) -> None:
    """`quantized_gemm_bf16` (each tile of 4 weight rows dequantized once to bf16 in cache) computes what the
    dequantize-then-GEMM path multiplies, `x @ dequantize(bf16).T`, within fp32 summation and one bf16 rounding; and
    each output row is what that input row gives alone."""
    kernels = native_kernels()
    assert kernels is not None
    weight, x, bias = bf16_product_case(scheme, n, runs, group, m, with_bias, seed)
    with on_threads(threads):
        got = kernels.quantized_gemm_bf16(weight, x, bias)
        alone = [kernels.quantized_gemm_bf16(weight, x[j : j + 1], bias)[0] for j in range(m)]
    assert_within_the_bf16_dequantized_gemm(got, x, weight, bias)
    assert all(torch.equal(got[j], alone[j]) for j in range(m)), "a row depends on the other rows of the call"


def bf16_product_case(scheme: str, n: int, runs: int, group: int, m: int, with_bias: bool, seed: int
                      ) -> tuple[QuantizedWeight, torch.Tensor, torch.Tensor | None]:
    """A quantized weight of `scheme` (`weight_of`: its own group where the scheme fixes one; k from `runs`, whole
    super-blocks for the factored k-quants), `m` bf16 input rows and maybe a bias."""
    group = group if scheme == "int4" else 16 if scheme.startswith("Q6_K") else 32
    k = 256 * (1 + runs % 2) if scheme.endswith("-factored") else max(runs * 32 // group, 1) * group
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g).bfloat16()
    return weight_of(scheme, n, k, group, seed), x, torch.randn(n, generator=g).bfloat16() if with_bias else None


def assert_within_rounding_of(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                              what: str, magnitudes: torch.Tensor | None = None) -> None:
    """`got` is `x @ w.T (+ bias)` (`w` float64) within fp32 summation and one rounding to x's dtype (bf16; none for
    fp32) (the summation's error scaled by `magnitudes`, `|w|` unless given)."""
    exact = x.double() @ w.T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ (w.abs() if magnitudes is None else magnitudes).T
    magnitude = magnitude + (0 if bias is None else bias.double().abs())
    rounding = 2.0**-8 if x.dtype == torch.bfloat16 else 0.0
    bound = (x.shape[1] + 2) * 2.0**-24 * magnitude + rounding * exact.abs() + 1e-30
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w.shape[0])
    assert ((got.double() - exact).abs() <= bound).all(), f"beyond rounding of {what}"


def assert_within_the_bf16_dequantized_gemm(got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight,
                                            bias: torch.Tensor | None) -> None:
    """`got` is `x @ dequantize(bf16).T (+ bias)` within fp32 summation and one bf16 rounding."""
    assert_within_rounding_of(got, x, weight.dequantize(torch.bfloat16).double(), bias,
                              f"{weight.scheme}'s dequantized GEMM")


# (every flavour with the packed product on codes: the pair instruction's, and AVX2's on bf16-dequantized blocks)
PACKED_CODES = [f for f in RUNNABLE if getattr(native_kernels(f), "packed_codes_available", False)]


@pytest.mark.skipif(not PACKED_CODES, reason="the quantized packed product needs AVX512-BF16 or AVX2 (and a build)")
@given(n=st.integers(1, 80), flavour=st.sampled_from(PACKED_CODES or ["native"]),
       balance=st.sampled_from(["1", "2", "0"]), **BF16_PRODUCT_DRAWS)
@settings(max_examples=40, deadline=None)
def test_the_quantized_packed_product_is_the_packed_product_on_the_bf16_dequantized_weight(
        scheme: str, n: int, flavour: str, balance: str, runs: int, group: int, m: int, with_bias: bool,
        threads: int, seed: int) -> None:
    """`quantized_gemm_packed` on `pack_codes`' layout (each block of 16 weight rows dequantized once to bf16 in cache;
    q8 and q4 codes too with their codes forms off, INFER_PACKED_CODE_SUMS=0, INFER_Q4_CODES=0) is the bf16 packed
    product on the weight
    `dequantize(bf16)` gives, bit for bit (last blocks part-filled, threads splitting the blocks unevenly and taking
    each other's, INFER_BALANCE 1 / 2 / 0; every flavour that has it), and so within fp32 summation and one bf16
    rounding of `x @ dequantize(bf16).T`; the weight and x are left as they were."""
    kernels = native_kernels(flavour)
    assert kernels is not None
    weight, x, bias = bf16_product_case(scheme, n, runs, group, m, with_bias, seed)
    before, x_before = [t.clone() for t in weight.tensors()], x.clone()
    fmt = weight.unfactored().fmt  # (q8 codes where they take the codes form: that form off; q4 codes as they run)
    code_sums = fmt in ("q8", "q6") and kernels.code_sums(fmt, x.shape[1])
    with on_threads(threads), env_set("INFER_BALANCE", balance), \
            env_set("INFER_PACKED_CODE_SUMS", "0" if code_sums else "1"), env_set("INFER_Q4_CODES", "0"):
        got = kernels.quantized_gemm_packed(pack_codes(weight), x, bias)
    with on_threads(threads):
        want = kernels.gemm_bf16_packed(kernels.pack_bf16(weight.dequantize(torch.bfloat16)), x, n, bias)
    assert torch.equal(got, want), f"{scheme}: not the packed product on the bf16-dequantized weight"
    assert_within_the_bf16_dequantized_gemm(got, x, weight, bias)
    assert torch.equal(x, x_before) and all(torch.equal(a, b) for a, b in zip(weight.tensors(), before, strict=True))


@pytest.mark.skipif(not PACKED_CODES, reason="the quantized packed product needs AVX512-BF16 or AVX2 (and a build)")
@pytest.mark.parametrize("flavour", PACKED_CODES or ["native"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_quantized_packed_product_passes_many_rows_in_groups(flavour: str, scheme: str) -> None:
    """Rows past what one pass keeps in cache (AVX2's widened rows, 192 KiB: 16 rows of k = 3072) go through the
    blocks in groups, each block dequantized again for each: still the bf16 packed product on the dequantized weight,
    bit for bit (q8 codes with the codes form off)."""
    kernels = native_kernels(flavour)
    assert kernels is not None
    weight, x, bias = bf16_product_case(scheme, 37, 96, 32, 70, True, 5)
    fmt = weight.unfactored().fmt  # (q8 codes where they take the codes form: that form off; q4 codes as they run)
    code_sums = fmt in ("q8", "q6") and kernels.code_sums(fmt, x.shape[1])
    with env_set("INFER_PACKED_CODE_SUMS", "0" if code_sums else "1"):
        got = kernels.quantized_gemm_packed(pack_codes(weight), x, bias)
    want = kernels.gemm_bf16_packed(kernels.pack_bf16(weight.dequantize(torch.bfloat16)), x, 37, bias)
    assert x.shape[1] == 3072 and torch.equal(got, want), f"{scheme}: rows past the first group parted"


# (the flavours whose packed product takes q4 codes in the pairs form, dequantized to bf16: AVX512-BF16's)
PAIRS_FORM = [f for f in PACKED_CODES if not getattr(native_kernels(f), "channel_codes", True)]


@pytest.mark.skipif(not PAIRS_FORM, reason="q4 codes dequantized in the tile need AVX512-BF16 (and a build)")
@given(n=st.integers(1, 60), m=st.integers(1, 9), scheme=st.sampled_from(["int4", "Q4_K", "Q4_K-factored"]),
       runs=st.integers(1, 13), group=st.sampled_from([32, 64, 128]), with_bias=st.booleans(),
       threads=st.integers(1, 3), seed=st.integers(0, 2**31), flavour=st.sampled_from(PAIRS_FORM or ["native"]))
@example(n=17, m=8, scheme="int4", runs=4, group=32, with_bias=True, threads=2, seed=1, flavour="native")
@example(n=16, m=1, scheme="Q4_K", runs=8, group=32, with_bias=False, threads=1, seed=2, flavour="native")
@settings(max_examples=30, deadline=None)
def test_q4_codes_dequantized_in_the_tile_are_the_buffers_bit_for_bit(
        n: int, m: int, scheme: str, runs: int, group: int, with_bias: bool, threads: int, seed: int,
        flavour: str) -> None:
    """With the codes form off (INFER_Q4_CODES=0), up to a tile's 8 rows q4 codes (int4's, Q4_K's) are dequantized
    in the tile, each pair's weights in registers (INFER_Q4_IN_TILES, the default): the product equals, bit for bit,
    the same product with each pair of blocks dequantized into the buffer first (INFER_Q4_IN_TILES=0) and the bf16
    packed product on `dequantize(bf16)` (last pairs of blocks part-filled, groups of 32-128, threads sharing the
    blocks); 9 rows take the buffer either way."""
    kernels = native_kernels(flavour)
    if kernels is None or flavour not in PAIRS_FORM:
        pytest.skip(f"{flavour}: no pairs form of q4 codes here")
    weight, x, bias = bf16_product_case(scheme, n, runs, group, m, with_bias, seed)
    packed = pack_codes(weight)
    with on_threads(threads), env_set("INFER_Q4_CODES", "0"):
        got = kernels.quantized_gemm_packed(packed, x, bias)
        with env_set("INFER_Q4_IN_TILES", "0"):
            buffered = kernels.quantized_gemm_packed(packed, x, bias)
        want = kernels.gemm_bf16_packed(kernels.pack_bf16(weight.dequantize(torch.bfloat16)), x, n, bias)
    assert torch.equal(buffered, want), f"{scheme}: the buffer's product is not the dequantized weight's"
    assert torch.equal(got, buffered), f"{scheme}, {m} rows: dequantized in the tile, not the buffer's bits"


def q4_weight_with_scale_bits(n: int, k: int, bits: int, seed: int) -> QuantizedWeight:
    """A q4 weight (groups of 32) whose float32 scales, of either sign and spread over 2^-20 .. 2^4, have `bits`
    significant bits (the first one's last kept bit set) and whose mins are any float32."""
    g = torch.Generator().manual_seed(seed)
    codes = pack_q4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8))
    magnitude = torch.exp2(torch.randint(-20, 5, (n, k // 32), generator=g).float())
    sign = torch.randint(0, 2, (n, k // 32), generator=g) * 2 - 1
    raw = (torch.rand(n, k // 32, generator=g) + 1) * magnitude * sign
    kept = with_significant_bits(raw, bits).view(torch.int32)
    kept[0, 0] |= 1 << (24 - bits)
    mins = torch.randn(n, k // 32, generator=g) * 3
    return QuantizedWeight("int4", codes, kept.view(torch.float32), mins, 32)


@pytest.mark.skipif(not PACKED_CODES, reason="the quantized packed product needs AVX512-BF16 or AVX2 (and a build)")
@given(n=st.integers(1, 40), runs=st.integers(1, 6), m=st.integers(1, 21), bits=st.integers(11, 20),
       seed=st.integers(0, 2**31), flavour=st.sampled_from(PACKED_CODES or ["native"]))
@settings(max_examples=30, deadline=None)
def test_q4_scale_times_code_plus_min_rounds_as_dequantize_up_to_20_bit_scales(
        n: int, runs: int, m: int, bits: int, seed: int, flavour: str) -> None:
    """A q4 block's scale * q + min, formed in the packed product's dequantizing (the codes form off,
    INFER_Q4_CODES=0) by one fused multiply-add, is `dequantize`'s two roundings for scales of up to 20 significant
    bits (scale * q then exact, q < 16): the product is the bf16 packed product on `dequantize(bf16)`, bit for bit,
    with any float32 mins; scales of 21 or more bits are refused by `pack_codes`, naming them."""
    kernels = native_kernels(flavour)
    assert kernels is not None
    k = 32 * runs
    weight = q4_weight_with_scale_bits(n, k, bits, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    with env_set("INFER_Q4_CODES", "0"):
        got = kernels.quantized_gemm_packed(pack_codes(weight), x)
    want = kernels.gemm_bf16_packed(kernels.pack_bf16(weight.dequantize(torch.bfloat16)), x, n)
    assert torch.equal(got, want), f"{bits}-bit scales: not dequantize's two roundings"
    with pytest.raises(ValueError, match="scales .* at most 20 significant bits"):
        pack_codes(q4_weight_with_scale_bits(n, k, 21 + bits % 4, seed))


# (AVX512-BF16 builds: q8 codes multiplied as exact bf16 operands, each group's sum times its scale)
CODE_SUMS = [f for f in PACKED_CODES if native_kernels(f).code_sums("q8", 64)]  # type: ignore[union-attr]
Q8_SCHEMES = ["int8", "Q8_0", "Q6_K", "Q6_K-factored"]


@pytest.mark.skipif(not CODE_SUMS, reason="the codes form of q8 codes is AVX512-BF16's (and needs a build)")
@given(n=st.integers(1, 80), runs=st.integers(1, 13), m=st.integers(1, 40), with_bias=st.booleans(),
       threads=st.integers(1, 3), balance=st.sampled_from(["1", "0"]), scheme=st.sampled_from(Q8_SCHEMES),
       seed=st.integers(0, 2**31), flavour=st.sampled_from(CODE_SUMS or ["native"]))
@example(scheme="Q8_0", n=40, runs=4, m=11, with_bias=True, threads=2, balance="1", seed=3,
         flavour=(CODE_SUMS or ["native"])[0])  # (9-16 rows: one tall tile a block, against each row's 1-row tile)
@settings(max_examples=50, deadline=None)
def test_q8_codes_in_the_codes_form_are_the_unrounded_product_row_by_row(
        scheme: str, n: int, runs: int, m: int, with_bias: bool, threads: int, balance: str, seed: int,
        flavour: str) -> None:
    """`quantized_gemm_packed` on q8 codes where `code_sums` holds (int8 per channel, GGUF's Q8_0 in groups of 32,
    Q6_K's in 16, factored scales): no weight rounded to bf16, so every output is within fp32 summation and one
    bf16 rounding of the quantized model's unrounded product (scale * q: what the dequantizing path misses by a bf16
    rounding of each weight); each row bit for bit what it gives alone (up to 8 rows the codes widen in the tile,
    9-16 rows in one tall tile a block, past that once into a buffer: all give the same sums), whatever the
    threads and their split (last blocks part-filled); the weight and x are left as they were."""
    kernels = native_kernels(flavour)
    assert kernels is not None
    weight, x, bias = bf16_product_case(scheme, n, runs, 32, m, with_bias, seed)
    k = x.shape[1]
    assert kernels.code_sums(weight.unfactored().fmt, k)
    before, x_before = [t.clone() for t in weight.tensors()], x.clone()
    got = product_row_by_row_and_on_one_thread(kernels, pack_codes(weight), x, bias, threads, balance)
    dense, magnitudes = unrounded_weight(weight)
    assert_within_rounding_of(got, x, dense, bias, f"{scheme}'s unrounded product", magnitudes)
    assert torch.equal(x, x_before) and all(torch.equal(a, b) for a, b in zip(weight.tensors(), before, strict=True))


def product_row_by_row_and_on_one_thread(kernels: Any, packed: PackedCodes, x: torch.Tensor,
                                         bias: torch.Tensor | None, threads: int, balance: str) -> torch.Tensor:
    """`quantized_gemm_packed` of all of x's rows on `threads` (INFER_BALANCE `balance`), asserted equal, bit for bit,
    to each row alone and to the product on one thread (no row depends on the others, nor on the threads' split)."""
    with on_threads(threads), env_set("INFER_BALANCE", balance):
        got = kernels.quantized_gemm_packed(packed, x, bias)
        alone = [kernels.quantized_gemm_packed(packed, x[j : j + 1], bias)[0] for j in range(x.shape[0])]
    with on_threads(1):
        serial = kernels.quantized_gemm_packed(packed, x, bias)
    assert all(torch.equal(got[j], alone[j]) for j in range(x.shape[0])), "a row depends on the other rows of the call"
    assert torch.equal(got, serial), "the threads' split moved a value"
    return got


@pytest.mark.skipif(not CODE_SUMS, reason="the codes form of q8 codes is AVX512-BF16's (and needs a build)")
@pytest.mark.parametrize("m", [3, 12, 16, 17, 40])
@pytest.mark.parametrize("group", [16, 32, 256])
def test_q8_codes_in_the_codes_form_are_exact_where_every_sum_is(m: int, group: int) -> None:
    """Where no sum can round (small integer inputs, codes of 8 bits, power-of-two scales that differ by group and
    row, a bias of quarters: every partial sum well inside float32's 24 bits), the codes form's output is the exact
    product rounded once to bf16, bit for bit, for codes in one group and in several, rows widened in every tile
    (of up to 8 rows, or one tall tile of 9-16) and through the buffer: the codes, the scales and the rows each reach
    the right output."""
    kernels = native_kernels(CODE_SUMS[0])
    assert kernels is not None
    g = torch.Generator().manual_seed(m * 1000 + group)
    n, k = 37, 512
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    if group == k:
        codes[:, 0] = 127  # (one group a row: the int8 quantizer's form)
    scales = 2.0 ** -torch.randint(1, 5, (n, k // group), generator=g).float()
    weight = QuantizedWeight("q8", codes, scales, None, group)
    x = torch.randint(-4, 5, (m, k), generator=g).bfloat16()
    bias = (torch.randint(-64, 65, (n,), generator=g) / 4).bfloat16()
    got = kernels.quantized_gemm_packed(pack_codes(weight), x, bias)
    dense = codes.double() * scales.double().repeat_interleave(group, dim=1)
    exact = x.double() @ dense.T + bias.double()
    assert torch.equal(got, exact.float().bfloat16()), "not the exact product rounded once"


# (AVX512-BF16 builds off AMX tiles: q4 codes of up to 16 rows multiplied as exact bf16 operands, 1 + q / 16)
Q4_CODES = [f for f in PACKED_CODES if native_kernels(f).q4_code_rows(64)]  # type: ignore[union-attr]
Q4_SCHEMES = ["int4", "Q4_K", "Q4_K-factored"]


@pytest.mark.skipif(not Q4_CODES, reason="the codes form of q4 codes is AVX512-BF16's off AMX (and needs a build)")
@given(n=st.integers(1, 80), runs=st.integers(1, 13), m=st.integers(1, 21), group=st.sampled_from([32, 64, 128]),
       with_bias=st.booleans(), threads=st.integers(1, 3), balance=st.sampled_from(["1", "0"]),
       scheme=st.sampled_from(Q4_SCHEMES), seed=st.integers(0, 2**31), flavour=st.sampled_from(Q4_CODES or ["native"]))
@example(scheme="int4", n=40, runs=4, m=16, group=32, with_bias=True, threads=2, balance="1", seed=3,
         flavour=(Q4_CODES or ["native"])[0])
@settings(max_examples=50, deadline=None)
def test_q4_codes_in_the_codes_form_are_the_unrounded_product_row_by_row(
        scheme: str, n: int, runs: int, m: int, group: int, with_bias: bool, threads: int, balance: str, seed: int,
        flavour: str) -> None:
    """`quantized_gemm_packed` on q4 codes (int4 in groups of 32-128, Q4_K's fp32 scales and mins, factored ones) at
    up to `q4_code_rows` rows: no weight rounded to bf16, so every output is within fp32 summation and one bf16
    rounding of the quantized model's unrounded product (scale * q + min), the summation's error counted on 16 scales
    per weight (each code's operand is 1 + q / 16, the offset taken out by each group's min less 16 scales times x's
    group sum); each row bit for bit what it gives alone, whatever the threads and their split (last blocks
    part-filled); past those rows (17-21) the dequantizing path's product, bit for bit (the form off,
    INFER_Q4_CODES=0); the weight and x are left as they were."""
    kernels = native_kernels(flavour)
    assert kernels is not None
    weight, x, bias = bf16_product_case(scheme, n, runs, group, m, with_bias, seed)
    before, x_before = [t.clone() for t in weight.tensors()], x.clone()
    packed = pack_codes(weight)
    if m > kernels.q4_code_rows(x.shape[1]):
        assert kernels.q4_code_rows(x.shape[1]) == 16
        with on_threads(threads), env_set("INFER_BALANCE", balance):
            got = kernels.quantized_gemm_packed(packed, x, bias)
            with env_set("INFER_Q4_CODES", "0"):
                buffered = kernels.quantized_gemm_packed(packed, x, bias)
        assert torch.equal(got, buffered), "past 16 rows: not the dequantizing path's product"
        return
    got = product_row_by_row_and_on_one_thread(kernels, packed, x, bias, threads, balance)
    dense, magnitudes = unrounded_weight(weight)
    w = weight.unfactored()  # (each term of a group's sum is at most (16 + 15) |scale x|, plus the offset's)
    offsets = 32 * w.scales.double().abs().repeat_interleave(w.group, dim=1)
    assert_within_rounding_of(got, x, dense, bias, f"{scheme}'s unrounded product", magnitudes + offsets)
    assert torch.equal(x, x_before) and all(torch.equal(a, b) for a, b in zip(weight.tensors(), before, strict=True))


@pytest.mark.skipif(not Q4_CODES, reason="the codes form of q4 codes is AVX512-BF16's off AMX (and needs a build)")
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("group", [32, 128])
def test_q4_codes_in_the_codes_form_are_exact_where_every_sum_is(m: int, group: int) -> None:
    """Where no sum can round (small integer inputs, power-of-two scales and quarter mins that differ by group and
    row, a bias of quarters), the codes form's output is the exact product rounded once to bf16, bit for bit, and with
    the form off (the tiles' or the buffer's bf16 weights: here exact too) the same: the codes (both nibbles of each
    byte), the scales, the mins and each row's group sums reach the right outputs."""
    kernels = native_kernels(Q4_CODES[0])
    assert kernels is not None
    g = torch.Generator().manual_seed(m * 1000 + group)
    n, k = 37, 512
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = 2.0 ** -torch.randint(0, 4, (n, k // group), generator=g).float()
    mins = torch.randint(-32, 33, (n, k // group), generator=g).float() / 4
    weight = QuantizedWeight("int4", pack_q4(q), scales, mins, group)
    x = torch.randint(-4, 5, (m, k), generator=g).bfloat16()
    bias = (torch.randint(-64, 65, (n,), generator=g) / 4).bfloat16()
    dense = q.double() * scales.double().repeat_interleave(group, dim=1) + mins.double().repeat_interleave(group, 1)
    want = (x.double() @ dense.T + bias.double()).float().bfloat16()
    assert m <= kernels.q4_code_rows(k)
    got = kernels.quantized_gemm_packed(pack_codes(weight), x, bias)
    with env_set("INFER_Q4_CODES", "0"):
        assert kernels.q4_code_rows(k) == 0
        dequantized = kernels.quantized_gemm_packed(pack_codes(weight), x, bias)
    assert torch.equal(got, want), "the codes form: not the exact product rounded once"
    assert torch.equal(dequantized, want), "the dequantizing path: not the exact product rounded once"


@pytest.mark.skipif(not CODE_SUMS, reason="the codes form of q8 codes is AVX512-BF16's (and needs a build)")
@given(n=st.integers(1, 60), runs=st.integers(1, 12), m=st.integers(1, 40), scheme=st.sampled_from(["int4", "Q8_0"]),
       group=st.sampled_from([32, 64, 128]), threads=st.integers(1, 3), seed=st.integers(0, 2**31),
       flavour=st.sampled_from(CODE_SUMS or ["native"]))
@example(scheme="int4", n=40, runs=8, m=16, group=128, threads=2, seed=5, flavour=(CODE_SUMS or ["native"])[0])
@example(scheme="int4", n=20, runs=12, m=5, group=128, threads=2, seed=6,  # (the shared split: 96 of 192 pairs,
         flavour=(CODE_SUMS or ["native"])[0])                           # not at a group's end)
@settings(max_examples=40, deadline=None)
def test_x_laid_out_in_registers_and_by_each_thread_gives_the_plain_layouts_bits(
        scheme: str, n: int, runs: int, m: int, group: int, threads: int, seed: int, flavour: str) -> None:
    """The codes tiles' x, laid out pair-major by 16 x 16 transposes in registers with q4's group sums added there
    (INFER_PAIRS_IN_REGISTERS) and, up to 16 rows, by each thread into its own buffer (INFER_PAIRS_EACH_THREAD), gives
    the plain layout's product bit for bit (a scalar copy a pair and row, the sums a row at a time, one buffer shared
    after a barrier): q8 codes (tiles of 8 rows, the tall tile, past 16 rows) and q4 codes (the codes form up to 16
    rows in groups of 32-128, the buffer past), every combination of the two switches, on 1-3 threads."""
    kernels = native_kernels(flavour)
    assert kernels is not None
    weight, x, bias = bf16_product_case(scheme, n, runs, group, m, True, seed)
    packed = pack_codes(weight)
    got = {}
    with on_threads(threads):
        for registers in ("1", "0"):
            for each in ("1", "0"):
                with env_set("INFER_PAIRS_IN_REGISTERS", registers), env_set("INFER_PAIRS_EACH_THREAD", each):
                    got[registers, each] = kernels.quantized_gemm_packed(packed, x, bias)
    plain = got["0", "0"]
    for switches, out in got.items():
        assert torch.equal(out, plain), f"x laid out with {switches}: not the plain layout's bits"


# Rows of x up to which q4 codes in the channel form sum as q8 codes do (cpu_decode.c's Q4_SUMS_ROWS: three tiles)
Q4_GROUP_SUMS_ROWS = 18


def scaled_sums(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None,
                group_sums: bool = True) -> torch.Tensor:
    """The channel form's numbers, in x's dtype (bf16 or fp32). q8 codes: each group's fp32 sum of code times x over its
    inputs in order by fused multiply-adds (`fma32`; for bf16 x each product is exact, a bf16 value times a code of at
    most 8 bits having at most 16 significant bits, so a separate multiply and add give the same sum), times the
    group's scale, summed over the groups in order (the first group's product the total); q4 codes of up to
    Q4_GROUP_SUMS_ROWS rows of x the same. q4 codes of more rows (or every count, `group_sums` False): each weight
    scale * code in fp32, multiplied by x over the whole row in order by fused multiply-adds (the products need not be
    exact in fp32). Then for q4 with mins, each group's min times x's fp32 sum over the group (in order) added in group
    order. Then the bias: each product and sum rounded once in fp32, then the whole rounded to x's dtype (bf16) or
    kept (fp32)."""
    w = weight.unfactored()
    q, xf = (unpack_q4(w.codes) if w.fmt == "q4" else w.codes).float(), x.float()
    groups = q.shape[1] // w.group
    total = torch.zeros(x.shape[0], q.shape[0])
    if w.fmt == "q4" and (x.shape[0] > Q4_GROUP_SUMS_ROWS or not group_sums):
        scaled = q * w.scales.float().repeat_interleave(w.group, dim=1)
        for i in range(q.shape[1]):
            total = fma32(total, xf[:, i, None], scaled[None, :, i])
    else:
        for g in range(groups):
            sums = torch.zeros(x.shape[0], q.shape[0])
            for i in range(g * w.group, (g + 1) * w.group):
                sums = fma32(sums, xf[:, i, None], q[None, :, i])
            scaled = sums * w.scales.float()[None, :, g]
            total = scaled if g == 0 else total + scaled
    for g in range(groups if w.fmt == "q4" and w.mins is not None else 0):
        xsum = torch.zeros(x.shape[0], 1)
        for i in range(g * w.group, (g + 1) * w.group):
            xsum = xsum + xf[:, i, None]
        total = total + w.mins.float()[None, :, g] * xsum  # type: ignore[union-attr]
    return (total if bias is None else total + bias.float()).to(x.dtype)


def rounded_once(exact: Fraction) -> float:
    """The float32 nearest `exact` (ties to the even significand), found among float64's rounding and its float32
    neighbours by exact comparison: no floating-point sum involved."""
    near = np.float32(float(exact))
    candidates = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
    return float(min(candidates, key=lambda f: (abs(Fraction(float(f)) - exact),
                                                int(np.array(f, dtype=np.float32).view(np.int32)) & 1)))


# Products a * b (a 24-bit, b a bf16's 8-bit significand) a hair off half a float32 step of numbers in [1, 2):
# 13944699 * 77 = 2^30 - 1 and 16519105 * 65 = 2^30 + 1, so a * b = 2^-24 -+ 2^-54, whose sum with such a number
# float64 rounds onto the tie between two float32 neighbours.
NEAR_TIES = [(13944699 * 2.0**-30, 77 * 2.0**-24), (16519105 * 2.0**-30, 65 * 2.0**-24)]


@given(c=st.floats(-1e6, 1e6, width=32), a=st.floats(-1e3, 1e3, width=32), b=st.floats(-1e3, 1e3, width=32),
       mantissa=st.integers(0, 2**23 - 1), exponent=st.integers(-20, 20), near=st.sampled_from([0, 1]),
       signs=st.sampled_from([1.0, -1.0]))
@settings(max_examples=300, deadline=None)
def test_fma32_rounds_once_as_a_fused_multiply_add(c: float, a: float, b: float, mantissa: int, exponent: int,
                                                   near: int, signs: float) -> None:
    """`fma32` (the channel form's formula) is a * b + c rounded once to float32, against exact rational arithmetic:
    on drawn operands, and on sums a hair off a float32 tie, where rounding the float64 sum to float32 (double
    rounding) picks the wrong neighbour."""
    ta, tb = NEAR_TIES[near]
    tc = (1 + (2 * (mantissa // 2) + 1 - near) * 2.0**-23) * 2.0**exponent  # an odd significand below 2^30 - 1's tie
    cases = [(c, a, b), (signs * tc, signs * ta * 2.0**exponent, tb)]
    for cc, aa, bb in cases:
        want = rounded_once(Fraction(cc) + Fraction(aa) * Fraction(bb))
        got = fma32(torch.tensor([cc]), torch.tensor([aa]), torch.tensor([bb]))
        assert got.dtype == torch.float32 and got.item() == want, f"fma32({aa!r}, {bb!r}, {cc!r})"
    cc, aa, bb = cases[1]
    double_rounded = float(np.float32(cc + aa * bb))
    assert double_rounded != rounded_once(Fraction(cc) + Fraction(aa) * Fraction(bb)), "not a hard case"


def unrounded_weight(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight`'s dense values in float64 (scale * q (+ min), no rounding to a dtype), and the magnitudes its
    products' rounding scales with (|scale * q| + |min|: a group's min and codes may cancel in the weight, not in the
    sums the channel form keeps)."""
    w = weight.unfactored()
    n, k = w.shape
    q = (unpack_q4(w.codes) if w.fmt == "q4" else w.codes).double().reshape(n, k // w.group, w.group)
    scaled = q * w.scales.double().unsqueeze(-1)
    mins = torch.zeros_like(scaled) if w.mins is None else w.mins.double().unsqueeze(-1).expand_as(scaled)
    return (scaled + mins).reshape(n, k), (scaled.abs() + mins.abs()).reshape(n, k)


# (AVX2 builds: codes in the channel form, multiplied without dequantizing; AVX512-BF16 builds for fp32 rows alone)
CHANNEL_CODES = [f for f in PACKED_CODES if native_kernels(f).channel_codes_available]  # type: ignore[union-attr]
CHANNEL_F32 = [f for f in PACKED_CODES if native_kernels(f).packed_codes_f32_available]  # type: ignore[union-attr]
F32_ONLY = [f for f in CHANNEL_F32 if f not in CHANNEL_CODES]
CHANNEL_SCHEMES = ["int8", "int4", "Q8_0", "Q4_K", "Q6_K", "Q4_K-factored", "Q6_K-factored"]


@pytest.mark.skipif(not CHANNEL_F32, reason="the channel form of codes is AVX2's (and needs a build)")
@given(n=st.integers(1, 80), runs=st.integers(1, 13), m=st.one_of(st.integers(1, 3), st.integers(1, 21)),
       with_bias=st.booleans(), threads=st.integers(1, 3), flavour=st.sampled_from(CHANNEL_F32 or ["native"]),
       seed=st.integers(0, 2**31), scheme=st.sampled_from(CHANNEL_SCHEMES), group=st.sampled_from([32, 64, 128]),
       balance=st.sampled_from(["1", "2", "0"]), few=st.sampled_from(["1", "0"]),
       fp32=st.booleans(), sums=st.sampled_from(["1", "0"]))
@settings(max_examples=80, deadline=None)
# int4 on 7 rows: two tiles of the scaled form's buffer (the group sums switched off), 4 rows and 3 (the
# remainder's row); on 19 rows, the first count past the group sums' rows, four tiles of it; on 18, three of sums
@example(scheme="int4", n=20, runs=4, group=32, m=7, with_bias=True, threads=1,
         flavour=(CHANNEL_CODES or ["native"])[0], seed=1, balance="1", few="1", fp32=False, sums="0")
@example(scheme="int4", n=40, runs=9, group=32, m=19, with_bias=True, threads=2,
         flavour=(CHANNEL_CODES or ["native"])[0], seed=5, balance="1", few="1", fp32=True, sums="1")
@example(scheme="Q4_K", n=40, runs=9, group=32, m=18, with_bias=False, threads=2,
         flavour=(CHANNEL_CODES or ["native"])[0], seed=6, balance="1", few="1", fp32=True, sums="1")
# one row over four blocks a tile, the last item three blocks (one part-filled); two rows over two, grouped codes
@example(scheme="int8", n=100, runs=3, group=32, m=1, with_bias=True, threads=2,
         flavour=(CHANNEL_CODES or ["native"])[0], seed=2, balance="1", few="1", fp32=False, sums="1")
@example(scheme="Q8_0", n=40, runs=4, group=32, m=2, with_bias=False, threads=1,
         flavour=(CHANNEL_CODES or ["native"])[0], seed=3, balance="0", few="1", fp32=False, sums="1")
@example(scheme="int4", n=40, runs=9, group=32, m=1, with_bias=True, threads=2,
         flavour=(CHANNEL_CODES or ["native"])[0], seed=4, balance="1", few="1", fp32=False, sums="1")
@example(scheme="int4", n=40, runs=9, group=32, m=1, with_bias=True, threads=2,
         flavour=(CHANNEL_CODES or ["native"])[0], seed=4, balance="1", few="1", fp32=False, sums="0")
# a build whose bf16 rows take codes in pairs (AVX512-BF16): fp32 rows on the channel form's tiles, one row of q4
# over four blocks a tile by group sums, 19 rows by the scaled form's buffer, 7 rows of grouped q8 codes
@example(scheme="int4", n=100, runs=9, group=32, m=1, with_bias=True, threads=2,
         flavour=(F32_ONLY or CHANNEL_F32 or ["native"])[0], seed=7, balance="1", few="1", fp32=True, sums="1")
@example(scheme="int4", n=40, runs=9, group=32, m=19, with_bias=False, threads=2,
         flavour=(F32_ONLY or CHANNEL_F32 or ["native"])[0], seed=8, balance="1", few="1", fp32=True, sums="1")
@example(scheme="Q8_0", n=40, runs=4, group=32, m=7, with_bias=True, threads=2,
         flavour=(F32_ONLY or CHANNEL_F32 or ["native"])[0], seed=9, balance="2", few="1", fp32=True, sums="1")
def test_codes_in_the_channel_form_give_each_groups_scaled_sums(scheme: str, n: int, runs: int, group: int, m: int,
                                                                with_bias: bool, threads: int, flavour: str,
                                                                seed: int, balance: str, few: str, fp32: bool,
                                                                sums: str) -> None:
    """`quantized_gemm_packed` on a weight packed in the channel form (no dequantizing; int8 per channel, int4 in
    groups with mins, GGUF's grouped q8 and q4 codes, factored scales) is `scaled_sums`' formula bit for bit (last
    blocks part-filled, threads splitting the blocks unevenly and taking each other's, INFER_BALANCE 1 / 2 / 0, q4's
    group sums up to three tiles of rows and its scaled form past them or at every count (INFER_Q4_GROUP_SUMS 1 / 0:
    one tile scaled in registers, more through the buffer, k past its 256-input stretches), one or two rows
    over several blocks a tile or one, INFER_FEW_ROWS_BLOCKS 1 / 0), and so within fp32 summation and one bf16
    rounding of the quantized model's unrounded product; for fp32 rows and bias (an fp32 model's: values of 24
    significant bits, whose products with the codes round) the same formula in fp32, not rounded; the weight and x
    are left as they were; float16 scales and mins (every one a float16 exactly) kept so, the same values as
    float32's. Builds whose bf16 rows take codes in pairs (AVX512-BF16) take fp32 rows alone."""
    kernels = native_kernels(flavour)
    assert kernels is not None
    fp32 = fp32 or not kernels.channel_codes_available
    weight, x, bias = bf16_product_case(scheme, n, runs, group, m, with_bias, seed)
    if fp32:
        x, bias = full_fp32(x, seed), None if bias is None else full_fp32(bias, seed + 1)
    packed = pack_codes(weight, channels=True)
    k, fmt = x.shape[1], weight.unfactored().fmt
    assert packed.fmt == fmt + "c"
    assert packed.codes.shape == (-(-n // 16), k, 16 if fmt == "q8" else 8)
    before, x_before = [t.clone() for t in weight.tensors()], x.clone()
    wide = pack_codes(weight, channels=True, half_scales=False)  # (float32 scales and mins: the check)
    if weight.scales.dtype == torch.float16 and not weight.factored:  # float16 scales and mins kept as they are
        assert packed.scales.dtype == torch.float16 and (packed.mins is None or packed.mins.dtype == torch.float16)
        assert packed.nbytes < wide.nbytes
    with (on_threads(threads), env_set("INFER_BALANCE", balance), env_set("INFER_FEW_ROWS_BLOCKS", few),
          env_set("INFER_Q4_GROUP_SUMS", sums)):
        got = kernels.quantized_gemm_packed(packed, x, bias)
        assert torch.equal(kernels.quantized_gemm_packed(wide, x, bias), got), f"{scheme}: float16 scales changed it"
    assert torch.equal(got, scaled_sums(x, weight, bias, sums == "1")), f"{scheme}: not each group's scaled fp32 sums"
    dense, magnitudes = unrounded_weight(weight)
    assert_within_rounding_of(got, x, dense, bias, f"{scheme}'s unrounded product", magnitudes)
    assert torch.equal(x, x_before) and all(torch.equal(a, b) for a, b in zip(weight.tensors(), before, strict=True))


def full_fp32(t: torch.Tensor, seed: int) -> torch.Tensor:
    """`t` widened to fp32 and moved off bf16's values by a small random part: fp32 values of 24 significant bits."""
    g = torch.Generator().manual_seed(seed)
    return t.float() * (1 + torch.rand(t.shape, generator=g) * 2.0**-9) + torch.randn(t.shape, generator=g) * 2.0**-12


@pytest.mark.skipif(not CHANNEL_CODES, reason="the channel form of codes is AVX2's (and needs a build)")
@pytest.mark.parametrize("fp32", [False, True])
@pytest.mark.parametrize(("scheme", "rows", "runs"), [("int8", 70, 96), ("int4", 200, 16)])
def test_codes_in_the_channel_form_pass_many_rows_in_groups(scheme: str, rows: int, runs: int, fp32: bool) -> None:
    """Rows past what one pass keeps in cache go through the blocks in groups (int8: 70 rows of k = 3072, 16 a pass;
    int4's scaled form: 200 rows, 192 a pass, each reading 256 inputs at a time): each row still its scaled sums,
    bit for bit (int4: x's group sums of the later rows too), bf16 rows or fp32 ones."""
    kernels = native_kernels(CHANNEL_CODES[0])
    assert kernels is not None
    weight, x, bias = bf16_product_case(scheme, 37, runs, 32, rows, True, 5)
    if fp32:
        x, bias = full_fp32(x, 6), full_fp32(bias, 7)  # type: ignore[arg-type]
    got = kernels.quantized_gemm_packed(pack_codes(weight, channels=True), x, bias)
    assert x.shape[1] == 32 * runs, "not the k asked for"
    assert torch.equal(got, scaled_sums(x, weight, bias)), "rows past the first group parted"


@pytest.mark.skipif(not CHANNEL_CODES, reason="the channel form of codes is AVX2's (and needs a build)")
def test_fp32_rows_of_packed_codes_refuse_what_they_cannot_take() -> None:
    """fp32 rows take codes in the channel form alone (the pairs form dequantizes into bf16 weights), with an fp32 bias
    of the outputs' length; each refusal one ValueError naming the fix, the output never half-written. A build
    without AVX2's channel form refuses to pack codes for fp32 rows, naming the build."""
    kernels = native_kernels(CHANNEL_CODES[0])
    assert kernels is not None and kernels.packed_codes_f32_available
    weight, x, _ = bf16_product_case("int4", 20, 4, 32, 3, False, 1)
    x = x.float()
    with pytest.raises(ValueError, match=r"pack_codes\(weight, torch.float32\)"):
        kernels.quantized_gemm_packed(pack_codes(weight), x)  # (the pairs form)
    packed = kernels.pack_codes(weight, torch.float32)
    assert packed.fmt == "q4c"
    with pytest.raises(ValueError, match="an fp32 bias of 20"):
        kernels.quantized_gemm_packed(packed, x, torch.zeros(20, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="an fp32 bias of 20"):
        kernels.quantized_gemm_packed(packed, x, torch.zeros(21))
    with pytest.raises(ValueError, match="rows of 128 inputs"):
        kernels.quantized_gemm_packed(packed, x[:, :64])
    for flavour in PACKED_CODES:  # (every build with AVX2 and FMA, AVX512-BF16's included)
        built = native_kernels(flavour)
        assert built is not None and built.packed_codes_f32_available == built.packed_f32_available
    generic = native_kernels("generic") if "generic" in FLAVOURS else None
    if generic is not None:
        assert not generic.packed_codes_f32_available
        with pytest.raises(ValueError, match=r"AVX2 and FMA only \(this build: generic\)"):
            generic.pack_codes(weight, torch.float32)


@pytest.mark.parametrize("scheme", CHANNEL_SCHEMES)
def test_the_channel_form_holds_the_pairs_forms_codes_and_scales(scheme: str) -> None:
    """The channel form is a layout of the same codes, scales and mins as the pairs form (each block's codes
    input-major: q8 input i's 16 side by side, q4 rows 0-7 in 8 bytes' low nibbles and 8-15 in their high ones);
    the kernels lay a weight out in their build's form."""
    weight = weight_of(scheme, 40, 256, 32, 3)
    pairs, channel = pack_codes(weight), pack_codes(weight, channels=True)
    assert channel.fmt == pairs.fmt + "c" and torch.equal(channel.scales, pairs.scales)
    assert (channel.mins is None) == (pairs.mins is None)
    assert channel.mins is None or pairs.mins is None or torch.equal(channel.mins, pairs.mins)
    w = weight.unfactored()
    q = unpack_q4(w.codes) if w.fmt == "q4" else w.codes  # [40, 256]: blocks of 16 rows, the last part-filled
    rows = torch.cat((q, q.new_zeros(8, 256))).reshape(3, 16, 256).transpose(1, 2)  # [block, input, row]
    if w.fmt == "q4":
        assert torch.equal(channel.codes & 0x0F, rows[:, :, :8]) and torch.equal(channel.codes >> 4, rows[:, :, 8:])
    else:
        assert torch.equal(channel.codes, rows)
    for flavour in PACKED_CODES:  # (every build this host runs: AVX2's lays out the channel form, AVX512-BF16's pairs)
        kernels = native_kernels(flavour)
        assert kernels is not None
        assert kernels.pack_codes(weight).fmt == (channel.fmt if kernels.channel_codes else pairs.fmt)
        assert kernels.pack_codes(weight, torch.float32).fmt == channel.fmt  # (fp32 rows: the channel form alone)
