"""The native quantizer of a quantized pool's filled blocks (`infer_quantize_blocks` in infer/kernels/cpu_decode.c,
`NativeKernels.quantize_blocks`, which the pool runs on a CPU: infer/cache/paged_quantized.py) held to the torch code
it replaces, the pool's formula (`quant.channel_offsets`, `quant.quantize_channels`, the schemes' row quantizers,
`quant.rotate`): keys by channel over a block's tokens (4-bit: around each channel's midpoint), values one scale per
row (4-bit: rotated). Bit for bit, but for the rotated values, whose fp32 sums PyTorch's matmul orders its own way:
there a code may be its neighbour and a scale one bf16 step away. Rounding ties, all-zero channels and rows, outliers,
tiny and huge values drawn on purpose; only the named blocks are written, the staging never."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infer.cache import quant
from infer.cache.quantized import SCHEMES
from infer.kernels.native import native_kernels, unavailable_reason
from tests.helpers import on_threads

needs_build = pytest.mark.skipif(native_kernels() is None, reason=f"no native build here: {unavailable_reason()}")
QMAX_VALUES = {"int8": quant.INT8_MAX, "int4": quant.INT4_MAX, "fp4": quant.FP4_MAX}
SENTINEL = 0x5A  # what every code byte and scale holds before the call (written blocks must not keep it)


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    scheme = draw(st.sampled_from(["int8", "int4", "fp4"]))
    d = draw(st.sampled_from([2, 6, 8, 20, 64, 130] + ([5, 7] if scheme == "int8" else [])))
    return {"scheme": scheme, "d": d, "kv_heads": draw(st.integers(1, 3)), "bs": draw(st.integers(1, 17)),
            "dtype": draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
            "rows": draw(st.integers(1, 4)), "fills": draw(st.integers(1, 6)), "threads": draw(st.integers(1, 3)),
            "kind": draw(st.sampled_from(["normal", "outliers", "ties", "zeros", "tiny", "huge"])),
            "rotate": scheme != "int8" and draw(st.booleans()), "offsets": scheme != "int8" and draw(st.booleans()),
            "seed": draw(st.integers(0, 2**31 - 1))}


def staged_rows(case: dict[str, Any], generator: torch.Generator) -> torch.Tensor:
    """Staging rows `[rows, Hkv, bs, d]` of the drawn kind. "ties": each value a power of two times a quarter-integer
    or an FP4 midpoint, and each channel's and row's largest qmax times it, so the scales are that power exactly and
    the scaled values land on rounding ties (int: k + 0.5; FP4: the midpoints between grid points)."""
    shape = (case["rows"], case["kv_heads"], case["bs"], case["d"])
    kind, dtype = case["kind"], case["dtype"]
    x = torch.randn(shape, generator=generator)
    if kind == "outliers":  # a channel 30x the rest, one off-centre (as real models' keys)
        x[..., 0] *= 30
        x[..., -1] += 8
    elif kind == "ties":
        power = 2.0 ** torch.randint(-6, 6, (1,), generator=generator).item()
        midpoints = torch.tensor(quant.FP4_MIDPOINTS)
        halves = torch.randint(-12, 12, shape, generator=generator) + 0.5
        picks = midpoints[torch.randint(0, len(midpoints), shape, generator=generator)]
        signs = torch.where(torch.rand(shape, generator=generator) < 0.5, -1.0, 1.0)
        ties = torch.where(torch.rand(shape, generator=generator) < 0.5, halves.clamp(-6.5, 6.5), signs * picks)
        x = ties * power
        qmax = QMAX_VALUES[case["scheme"]] if case["scheme"] != "fp4" else quant.FP4_KEY_MAX
        x[:, :, 0, :] = qmax * power  # every channel's largest, so its scale is `power` (keys)
        x[:, :, :, 0] = QMAX_VALUES[case["scheme"]] * power  # every row's largest (values)
    elif kind == "zeros":  # an all-zero channel and an all-zero row: scale 0, codes 0
        x[..., 1 % case["d"]] = 0
        x[:, :, 0, :] = 0
    elif kind == "tiny":
        x = x * 1e-30 if dtype == torch.float32 else x * 1e-4
    elif kind == "huge":
        x = x * (1e30 if dtype == torch.float32 else 1e3)
    return x.to(dtype)


def torch_quantized(case: dict[str, Any], keys: torch.Tensor, values: torch.Tensor, rotation: torch.Tensor | None
                    ) -> tuple[torch.Tensor, ...]:
    """The pool's torch code (QuantizedPoolLayer.quantize_filled's), blocks `[n, Hkv, bs, d]`."""
    scheme = case["scheme"]
    centres = quant.channel_offsets(keys) if case["offsets"] else None
    k_codes, k_scale = quant.quantize_channels(keys, scheme, centres)
    v_codes, v_scale = SCHEMES[scheme][0](values if rotation is None else quant.rotate(values, rotation))
    return k_codes, k_scale, centres, v_codes, v_scale


def levels(codes: torch.Tensor, scheme: str) -> torch.Tensor:
    """Each code's signed level (int8 and int4: the integer; FP4: the grid point's index, signed)."""
    if scheme == "int8":
        return codes.to(torch.int64)
    nibbles = quant.unpack_nibbles(codes).to(torch.int64)
    if scheme == "int4":
        return torch.where(nibbles >= 8, nibbles - 16, nibbles)
    return torch.where(nibbles >= 8, -(nibbles - 8), nibbles)


@needs_build
@settings(max_examples=150, deadline=None)
@given(case=cases())
def test_the_native_quantizer_is_the_pools_torch_code(case: dict[str, Any]) -> None:
    """Codes, scales and key offsets of the named blocks are the torch code's bit for bit (rotated values: each code
    within one level and each scale within one bf16 step of it); no other block changes; the staging is read only."""
    kernels = native_kernels()
    assert kernels is not None
    generator = torch.Generator().manual_seed(case["seed"])
    scheme, kv_heads, bs, d = case["scheme"], case["kv_heads"], case["bs"], case["d"]
    k_stage, v_stage = staged_rows(case, generator), staged_rows(case, generator)
    before = (k_stage.clone(), v_stage.clone())
    rows = torch.randint(0, case["rows"], (case["fills"],), generator=generator)
    num_blocks = case["fills"] + 3
    blocks = torch.randperm(num_blocks, generator=generator)[: case["fills"]]
    per_byte, code_dtype = SCHEMES[scheme][2], SCHEMES[scheme][3]
    codes = [torch.full((num_blocks, kv_heads, bs, d // per_byte), SENTINEL, dtype=torch.uint8).view(code_dtype)
             for _ in range(2)]
    k_scale = torch.full((num_blocks, kv_heads, d), SENTINEL, dtype=torch.int16).view(torch.bfloat16)
    v_scale = torch.full((num_blocks, kv_heads, bs), SENTINEL, dtype=torch.int16).view(torch.bfloat16)
    offsets = k_scale.clone() if case["offsets"] else None
    rotation = quant.value_rotation(d) if case["rotate"] else None
    outputs = [*codes, k_scale, v_scale] + ([offsets] if offsets is not None else [])
    untouched = [t.clone() for t in outputs]
    with on_threads(case["threads"]):  # (blocks and heads shared over the threads where the work is large enough)
        kernels.quantize_blocks((k_stage, v_stage), rows, blocks, (codes[0], codes[1]), (k_scale, v_scale), offsets,
                                rotation, scheme)

    assert torch.equal(k_stage, before[0]) and torch.equal(v_stage, before[1]), "the staging was written"
    others = torch.tensor([b for b in range(num_blocks) if b not in blocks.tolist()], dtype=torch.long)
    for got, was in zip(outputs, untouched, strict=True):
        assert torch.equal(got[others], was[others]), "a block it was not given changed"
    k_codes, k_scales, centres, v_codes, v_scales = torch_quantized(case, k_stage[rows], v_stage[rows], rotation)
    assert torch.equal(k_scale[blocks].view(torch.int16), k_scales.view(torch.int16)), "key scales"
    assert torch.equal(codes[0][blocks], k_codes), "key codes"
    if offsets is not None:
        assert centres is not None and torch.equal(offsets[blocks].view(torch.int16), centres.view(torch.int16))
    if rotation is None:
        assert torch.equal(v_scale[blocks].view(torch.int16), v_scales.view(torch.int16)), "value scales"
        assert torch.equal(codes[1][blocks], v_codes), "value codes"
    else:  # the rotation's sums in another order: a value on a rounding boundary may take its neighbour
        steps = (v_scale[blocks].view(torch.int16).to(torch.int32) - v_scales.view(torch.int16).to(torch.int32)).abs()
        assert steps.max().item() <= 1, "a rotated row's scale is more than one bf16 step from the torch code's"
        near = steps == 0  # rows of the same scale: codes at most one level apart
        apart = (levels(codes[1][blocks], scheme) - levels(v_codes, scheme)).abs()
        assert apart[near].max().item() <= 1 if near.any() else True, "a rotated value's code is two levels off"


@needs_build
def test_the_native_quantizer_refuses_what_it_cannot_write() -> None:
    """A 4-bit scheme and an odd head size, or codes it cannot write in place (not contiguous): one clear error each,
    nothing written."""
    kernels = native_kernels()
    assert kernels is not None
    stage = torch.randn(2, 1, 4, 5)
    rows, blocks = torch.tensor([0]), torch.tensor([1])
    codes = torch.zeros(3, 1, 4, 2, dtype=torch.uint8)
    scales = (torch.zeros(3, 1, 5, dtype=torch.bfloat16), torch.zeros(3, 1, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="even head_dim"):
        kernels.quantize_blocks((stage, stage), rows, blocks, (codes, codes), scales, None, None, "int4")
    assert not codes.any() and not scales[0].any() and not scales[1].any()
    wide = torch.zeros(3, 1, 4, 10, dtype=torch.int8)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.quantize_blocks((stage, stage), rows, blocks, (wide[..., ::2], wide[..., ::2]), scales, None, None,
                                "int8")
    assert not wide.any()
