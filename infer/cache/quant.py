"""Symmetric per-row quantization of K/V rows: int8, int4 and FP4 (E2M1), as pure tensor functions.

A row is one (token, head) vector over `head_dim`; each row gets one scale, `absmax / qmax`, stored
in bfloat16 (fp32's exponent range, so tiny or huge rows keep a usable scale) and rounded *up* to
it, so `|x| / scale <= qmax` and no value clips. An all-zero row gets scale 0 and decodes to zeros.

Layouts (`x`: [..., D]):
- int8: codes int8 [..., D] in -127..127 (symmetric: -128 is never written), scale [...].
- int4: codes -7..7 (symmetric; -8 decodes but is never written), two per uint8 as two's-complement
  nibbles, element 2i in the low nibble and 2i+1 in the high one: [..., D/2].
- fp4: E2M1 codes (bit 3 sign, bits 2-1 exponent, bit 0 mantissa) for ±{0, 0.5, 1, 1.5, 2, 3, 4, 6},
  scale = absmax / 6 (keys by channel: absmax / 4, FP4_KEY_MAX), round to nearest (ties to the smaller
  magnitude), packed like int4.

Where a faster form exists the plain formula sits beside it (`*_reference`) as its check.
This module knows nothing about caches or models.
"""

from __future__ import annotations

import torch

SCALE_DTYPE = torch.bfloat16
INT8_MAX = 127
INT4_MAX = 7
FP4_MAX = 6.0
# E2M1 magnitudes by 3-bit code, and the midpoints between neighbours that decide rounding.
FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def row_scale(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """One scale per row, `absmax / qmax` over the last dim rounded up to `SCALE_DTYPE`: [..., D] -> [...]."""
    exact = x.float().abs().amax(dim=-1) / qmax
    scale = exact.to(SCALE_DTYPE)
    # Rounding down would push |x| / scale past qmax and clip the row's largest value.
    too_small = scale.float() < exact
    return torch.where(too_small, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)


def _divide_by_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x / scale` per row in fp32; a zero scale (all-zero row) divides by 1 so no NaN appears."""
    s = scale.float().unsqueeze(-1)
    return x.float() / torch.where(s == 0, torch.ones_like(s), s)


def _times_scale(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (values.float() * scale.float().unsqueeze(-1)).to(dtype)


def _check_even(x: torch.Tensor, what: str) -> None:
    if x.shape[-1] % 2:
        raise ValueError(
            f"{what} packs two values per byte, so the last dim must be even, got {x.shape[-1]}; "
            "use int8 for an odd head_dim"
        )


# --- nibble packing -------------------------------------------------------------------------------


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes uint8 [..., D] (each 0..15) -> bytes uint8 [..., D/2]; element 2i in the low nibble."""
    _check_even(codes, "4-bit packing")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes uint8 [..., D/2] -> 4-bit codes uint8 [..., D], the inverse of `pack_nibbles`."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


# --- int8 -----------------------------------------------------------------------------------------


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes int8 [..., D] in -127..127, scale [...]); x ≈ codes * scale."""
    scale = row_scale(x, INT8_MAX)
    codes = torch.round(_divide_by_scale(x, scale)).clamp(-INT8_MAX, INT8_MAX)
    return codes.to(torch.int8), scale


def dequantize_int8(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """codes int8 [..., D], scale [...] -> values [..., D] in `dtype`."""
    return _times_scale(codes, scale, dtype)


# --- int4 -----------------------------------------------------------------------------------------


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (D even) -> (packed uint8 [..., D/2] of codes -7..7, scale [...])."""
    _check_even(x, "int4")
    scale = row_scale(x, INT4_MAX)
    codes = torch.round(_divide_by_scale(x, scale)).clamp(-INT4_MAX, INT4_MAX).to(torch.int16)
    return pack_nibbles((codes & 0x0F).to(torch.uint8)), scale


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed uint8 [..., D/2], scale [...] -> values [..., D] in `dtype`."""
    nibbles = unpack_nibbles(packed).to(torch.int16)
    codes = (nibbles ^ 0x08) - 0x08  # sign-extend the 4-bit two's complement
    return _times_scale(codes, scale, dtype)


# --- fp4 (E2M1) -----------------------------------------------------------------------------------


def e2m1_value(code: int) -> float:
    """The value of one 4-bit E2M1 code by the format's definition (exponent bias 1, one mantissa bit)."""
    sign = -1.0 if code & 0x8 else 1.0
    exponent, mantissa = (code >> 1) & 0x3, code & 0x1
    if exponent == 0:  # subnormal: 0 or 0.5
        return sign * mantissa * 0.5
    return sign * 2.0 ** (exponent - 1) * (1.0 + mantissa / 2)


_CODE_TABLES: dict[torch.device, torch.Tensor] = {}


def fp4_code_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 code values as fp32 [16], indexed by code: what `dequantize_fp4` looks up. Made once per device (a
    host-to-device copy cannot run inside a CUDA graph's capture: a quantized pool's gathers in replayed steps);
    do not write to it."""
    device = torch.device(device)
    table = _CODE_TABLES.get(device)
    if table is None:
        table = _CODE_TABLES[device] = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float32,
                                                    device=device)
    return table


def fp4_codes_reference(v: torch.Tensor) -> torch.Tensor:
    """Scaled values [...] (|v| <= 6) -> E2M1 codes uint8 [...]: the nearest grid point by distance."""
    grid = torch.tensor(FP4_GRID, device=v.device)
    # argmin keeps the first of two equal distances: ties go to the smaller magnitude.
    magnitude_code = (v.float().abs().unsqueeze(-1) - grid).abs().argmin(dim=-1)
    return (magnitude_code | ((v < 0).long() << 3)).to(torch.uint8)


_MIDPOINTS: dict[torch.device, torch.Tensor] = {}


def fp4_codes(v: torch.Tensor) -> torch.Tensor:
    """Same as `fp4_codes_reference`, by binary search over the midpoints instead of 8 distances."""
    # Made once per device: a host-to-device copy cannot run inside a CUDA graph's capture (the quantized pool's
    # graph-replayed decode steps quantize the blocks they fill).
    midpoints = _MIDPOINTS.get(v.device)
    if midpoints is None:
        midpoints = _MIDPOINTS[v.device] = torch.tensor(FP4_MIDPOINTS, device=v.device)
    # right=False: a value equal to a midpoint stays in the lower bucket, as argmin's tie-break does.
    magnitude_code = torch.bucketize(v.float().abs(), midpoints, right=False)
    return (magnitude_code | ((v < 0).long() << 3)).to(torch.uint8)


def quantize_fp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (D even) -> (packed uint8 [..., D/2] of E2M1 codes, scale [...]), scale = absmax / 6."""
    _check_even(x, "fp4")
    scale = row_scale(x, FP4_MAX)
    return pack_nibbles(fp4_codes(_divide_by_scale(x, scale))), scale


def dequantize_fp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed uint8 [..., D/2], scale [...] -> values [..., D] in `dtype`."""
    values = fp4_code_table(packed.device)[unpack_nibbles(packed).long()]
    return _times_scale(values, scale, dtype)


# --- per-channel scales (keys) --------------------------------------------------------------------

# A channel's extreme maps to this code (scale = absmax / it). FP4 keys: to 4, not E2M1's largest 6. A centred key
# channel spreads over its whole range, and E2M1's top step (4 -> 6) spans a third of it; mapped to 4 the levels 0,
# 0.5, ..., 3, 4 cover the range with steps of at most a quarter, and the extreme itself stays exact (mapped
# anywhere off the grid, as at 4.5 or 5, every channel's extreme rounds away: KL 2-6x worse). On
# SmolLM2-135M-Instruct (fp4 cache, 512 tokens, prose / code) mean KL 3.4e-3 -> 2.9e-3 and 8.8e-3 -> 7.1e-3, top-1
# 0.968 / 0.966 -> 0.974 / 0.982; mapped to 3, 4.1e-3 / 9.6e-3. Values (rotated rows, near-Gaussian) keep 6.
FP4_KEY_MAX = 4.0
QMAX = {"int8": INT8_MAX, "int4": INT4_MAX, "fp4": FP4_KEY_MAX}


def channel_offsets(x: torch.Tensor) -> torch.Tensor:
    """A block of keys x [..., S, D] -> one offset per channel [..., D], the midpoint of the channel's range over
    the block in `SCALE_DTYPE`. Keys after RoPE sit off-centre within a block (a channel's values drift with
    position), and a symmetric code around zero spends half its levels on values that never occur."""
    return ((x.float().amax(dim=-2) + x.float().amin(dim=-2)) / 2).to(SCALE_DTYPE)


def quantize_channels(x: torch.Tensor, scheme: str, offsets: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """A block of keys x [..., S, D] -> (codes laid out as `scheme`'s rows [..., S, D or D/2], scale [..., D]):
    one scale per channel over the block's S tokens (KIVI), so a channel of outliers keeps its own range instead
    of rounding the rest of its row to zero. With `offsets` [..., D] (`channel_offsets`) the codes hold
    `x - offsets`."""
    if offsets is not None:
        x = x.float() - offsets.float().unsqueeze(-2)
    by_channel = x.transpose(-1, -2)  # [..., D, S]: a channel's values as one row
    scale = row_scale(by_channel, QMAX[scheme])
    scaled = _divide_by_scale(by_channel, scale).transpose(-1, -2)
    if scheme == "int8":
        return torch.round(scaled).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale
    _check_even(x, scheme)
    if scheme == "int4":
        codes = torch.round(scaled).clamp(-INT4_MAX, INT4_MAX).to(torch.int16)
        return pack_nibbles((codes & 0x0F).to(torch.uint8)), scale
    return pack_nibbles(fp4_codes(scaled)), scale


def dequantize_channels(codes: torch.Tensor, scale: torch.Tensor, scheme: str,
                        dtype: torch.dtype = torch.float32, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """codes [..., S, D or D/2] as `quantize_channels` writes them, scale [..., D] (and the `offsets` [..., D]
    they were written with) -> values [..., S, D]."""
    ones = torch.ones(codes.shape[:-1], dtype=SCALE_DTYPE, device=codes.device)
    decode = {"int8": dequantize_int8, "int4": dequantize_int4, "fp4": dequantize_fp4}[scheme]
    values = decode(codes, ones, torch.float32) * scale.float().unsqueeze(-2)
    if offsets is not None:
        values = values + offsets.float().unsqueeze(-2)
    return values.to(dtype)


# --- rotated values -------------------------------------------------------------------------------


def value_rotation(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """An orthonormal, symmetric [d, d] fp32 matrix H (so H @ H = I): a normalised Walsh-Hadamard matrix on
    blocks of the largest power of two dividing d (QuaRot). A value row v is stored as codes of `v @ H` and read
    back as `decoded @ H`: rotated, a row's few large channels spread over all of them, so one scale per row
    fits the rest better."""
    n = d & -d  # the largest power of two dividing d
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return torch.block_diag(*[h / n**0.5] * (d // n)).to(device)


def rotate(x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """`x @ rotation` over the last dim in fp32 (`x` in fp32 as is when `rotation` is None)."""
    return x.float() if rotation is None else x.float() @ rotation
