"""Weight-only quantization: a weight matrix stored as integer codes with scales, and the ways to make one.

Two storage formats cover every scheme, so one kernel per format runs them all:

  q8  int8 codes `[n, k]`, one scale per group of `group` inputs:          w = scale * q
  q4  4-bit codes packed two to a byte `[n, k // 2]`, a scale and a min
      per group:                                                             w = scale * q + min  (q in 0..15)

Within each run of 32 inputs a q4 row stores byte j's low nibble as element j and its high nibble as element
j + 16 (llama.cpp's Q4_0/Q4_1 order, so those blocks are copied as they are). Scales and mins are float16
where the source stores them so (exact), else float32.

The schemes (`QuantizedWeight.scheme`, recorded when a model is saved):
  "int8"  symmetric per output channel (group = k; the LM head per 32 inputs), float32 scales: made here
  "int4"  asymmetric group-wise (groups of 32, 64 or 128 inputs), float16 scales and mins: made here
  "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q6_K"  a GGUF file's blocks re-laid out without changing a value: Q4_0's
          `d * (q - 8)` is `d * q + (-8 d)`, exact in fp32; Q4_K's per-32 `d * sc` and `dmin * m` are the fp32
          products llama.cpp forms; Q5_0 is q8 codes `q - 16` under its fp16 `d`; Q6_K is q8 codes `q - 32` in
          groups of 16 (its sub-blocks; the one format whose group is not whole runs of 32) under `d * sc`

Q4_K's and Q6_K's scales (and Q4_K's mins) stay factored as the file stores them ("factored" scales, int8): per
row, one int8 multiplier per group (sc, m) then one float16 super-scale per 256 inputs (d, -dmin) as bytes; the
kernels form each group's `super * multiplier` in fp32, the same product, so nothing changes but the bytes: 0.58 and
1.07 bytes a weight with the codes instead of 0.75 and 1.25 with float32 scales per group (`unfactored()` gives
those, for the GPU kernels and the other readers).

`dequantize` is the reference every kernel is held to: `scale * q (+ min)` in fp32, two roundings, as
llama.cpp's dequantization and `infer.gguf_quants` compute them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from infer.gguf_quants import QK_K, _k_scales, _q5_0_codes, _q6_k_codes

CHUNK = 32  # inputs per packed run; groups are whole runs
INT4_GROUPS = (32, 64, 128)
SCHEMES = ("int8", "int4")  # what load_model(..., weights=) makes from float weights
STORED_KINDS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q6_K")  # GGUF block types run as stored
Q8_SCHEMES = ("int8", "Q8_0", "Q5_0", "Q6_K")  # the schemes stored as q8 (int8 codes, no mins); the rest are q4


@dataclass(frozen=True)
class QuantizedWeight:
    """One `[n, k]` weight as codes and per-group scales (and mins, q4). Immutable: slicing rows or moving
    devices makes a new one."""

    scheme: str  # "int8" | "int4" | one of STORED_KINDS: what made the codes
    codes: torch.Tensor  # q8: int8 [n, k]; q4: uint8 [n, k // 2]
    scales: torch.Tensor  # [n, k // group], float16 or float32; factored (int8): [n, k // group + 2 * (k // 256)]
    mins: torch.Tensor | None  # q4: as scales, the scales' dtype; q8: None
    group: int

    @functools.cached_property
    def kernel_args(self) -> tuple[str, int, torch.dtype, int, int | None, int, int, int]:
        """What a native kernel call needs, formed once (the tensors are never changed in place): the kernels'
        format ("q6" for Q6_K's q8 codes, which lie in -32..31: a faster bf16 path takes them), codes, scales' dtype,
        scales, mins (addresses), n, k, group."""
        n, k = self.shape
        mins = None if self.mins is None else self.mins.data_ptr()
        fmt = "q6" if self.scheme == "Q6_K" else self.fmt
        return fmt, self.codes.data_ptr(), self.scales.dtype, self.scales.data_ptr(), mins, n, k, self.group

    @functools.cached_property
    def mins_are_eight_scales(self) -> bool:
        """Whether every min is -8 x its group's scale (GGUF's Q4_0, `d (q - 8)`, as the loader stores it): the
        one-row kernel then forms the mins instead of reading them. Checked on the values, once."""
        return (self.scheme == "Q4_0" and self.mins is not None and not self.factored
                and torch.equal(self.mins, -8 * self.scales))

    @property
    def factored(self) -> bool:
        """Whether the scales (and mins) are a k-quant's factored form (int8 multipliers under float16
        super-scales; see the module docstring)."""
        return self.scales.dtype == torch.int8

    def unfactored(self) -> QuantizedWeight:
        """The same weight with float32 scales (and mins) per group: each `super * multiplier`, the product the
        kernels form. Itself where the scales are not factored."""
        if not self.factored:
            return self
        k = self.shape[1]
        mins = None if self.mins is None else _unfactor(self.mins, k)
        return replace(self, scales=_unfactor(self.scales, k), mins=mins)

    @property
    def fmt(self) -> str:
        """The storage format: "q8" or "q4"."""
        return "q8" if self.codes.dtype == torch.int8 else "q4"

    @property
    def shape(self) -> tuple[int, int]:
        """`(n, k)`: output rows and inputs of the dense weight."""
        n, width = self.codes.shape
        return n, width * (2 if self.fmt == "q4" else 1)

    @property
    def device(self) -> torch.device:
        """Where the codes live."""
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """Bytes of codes, scales and mins."""
        return sum(t.nbytes for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Codes, scales and (q4) mins."""
        return (self.codes, self.scales) if self.mins is None else (self.codes, self.scales, self.mins)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same weight on `device` (off the CPU with float32 scales per group: the GPU kernels read those)."""
        if self.factored and torch.device(device).type != "cpu":
            return self.unfactored().to(device)
        mins = None if self.mins is None else self.mins.to(device)
        return replace(self, codes=self.codes.to(device), scales=self.scales.to(device), mins=mins)

    def rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """The weight of the rows `index` (a slice keeps views; an index tensor copies)."""
        mins = None if self.mins is None else self.mins[index]
        return replace(self, codes=self.codes[index], scales=self.scales[index], mins=mins)

    def clone(self) -> QuantizedWeight:
        """The same weight in tensors of its own (a slice's views would keep the whole alive)."""
        mins = None if self.mins is None else self.mins.clone()
        return replace(self, codes=self.codes.clone(), scales=self.scales.clone(), mins=mins)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense `[n, k]` weight: `scale * q (+ min)` in fp32, then rounded once to `dtype`."""
        if self.factored:
            return self.unfactored().dequantize(dtype)
        n, k = self.shape
        q = unpack_q4(self.codes) if self.fmt == "q4" else self.codes
        q = q.float().reshape(n, k // self.group, self.group)
        w = q * self.scales.float().unsqueeze(-1)
        if self.mins is not None:
            w = w + self.mins.float().unsqueeze(-1)
        return w.reshape(n, k).to(dtype)


@dataclass(frozen=True)
class PackedCodes:
    """A QuantizedWeight laid out for the native packed product (cpu_decode.c's infer_qgemm_packed: the batched
    engine's steps), as `NativeKernels.pack_bf16` lays out a bf16 weight: blocks of 16 rows, each row's pairs of inputs
    interleaved, zero rows filling the last block. A copy; the weight is unchanged."""

    fmt: str  # "q8" (Q6_K's codes too) | "q4" | "q8c" | "q4c" (the channel form: `pack_codes`)
    codes: torch.Tensor  # q8: int8 [blocks, k // 2, 32]; q4: uint8 [blocks, k // 4, 32] (pairs 2j, 2j + 1: nibbles);
    #                      q8c: int8 [blocks, k, 16] (input i's 16 codes side by side); q4c: uint8 [blocks, k,
    #                      8] (input i's rows 0-7 in low nibbles, 8-15 in high ones)
    scales: torch.Tensor  # float32 [blocks, groups, 16]: each group's scale of the block's 16 rows (the channel
    #                       form: float16 where every scale and min is a float16 exactly, `pack_codes`)
    mins: torch.Tensor | None  # q4: as scales; q8: None
    group: int
    shape: tuple[int, int]  # the dense weight's (n, k)

    @property
    def channel_form(self) -> bool:
        """Whether the codes lie in the channel form (AVX2's: multiplied as they are; fp32 rows take only this)."""
        return self.fmt in ("q8c", "q4c")

    @property
    def nbytes(self) -> int:
        """Bytes of codes, scales and mins."""
        return sum(t.nbytes for t in (self.codes, self.scales, self.mins) if t is not None)


def pack_codes(weight: QuantizedWeight, channels: bool = False, half_scales: bool = True) -> PackedCodes:
    """`weight` as `PackedCodes` (the scales widened to float32: factored ones as the kernels form them), so that
    dequantizing a block gives `NativeKernels.pack_bf16(weight.dequantize(torch.bfloat16))`'s values. `channels`
    (AVX2's packed product: `NativeKernels.pack_codes` decides): the channel form instead, each block's codes
    input-major, which that product multiplies without rounding a weight to bf16 (q8: each group's sum times its
    scale; q4: each weight's fp32 scale * code, plus each group's min times x's sum over the group). q4 scales of
    more than 20 significant bits (none that this package makes or reads: float16's have 11, Q4_K's d * sc 17) are
    refused: the product forms scale * q + min by one fused multiply-add, `dequantize`'s two roundings only while
    scale * q is exact. In the channel form, scales and mins that are all float16 exactly (Q4_0's, Q4_1's, Q8_0's,
    int4's) stay float16 (`half_scales`; False: float32): the kernels widen them a block at a time, the same values,
    and a Q4_0 weight's packed copy streams 20 bytes a run of 32 inputs where float32 took 24 (the file: 18)."""
    w = weight.unfactored()
    n, k = w.shape
    if w.fmt == "q4" and bool((w.scales.float().view(torch.int32) & 0xF).any()):  # (see the docstring)
        raise ValueError(f"a q4 weight's scales ({w.scheme}) must have at most 20 significant bits, as float16 "
                         f"scales and Q4_K's d * sc have; these are float32 with more: store them as float16")
    blocks, spare = -(-n // 16), -n % 16
    q = unpack_q4(w.codes) if w.fmt == "q4" else w.codes
    q = torch.cat((q, q.new_zeros(spare, k)))
    if channels:  # input i's 16 codes side by side; q4: rows 0-7's in 8 bytes' low nibbles, rows 8-15's in the high
        q = q.reshape(blocks, 16, k).transpose(1, 2)
        if w.fmt == "q4":
            q = q[:, :, :8] | (q[:, :, 8:] << 4)
    else:  # each row's inputs in pairs; q4: pairs 2j and 2j + 1 in one byte's low and high nibbles
        q = q.reshape(blocks, 16, k // 2, 2).transpose(1, 2).reshape(blocks, k // 2, 32)
        if w.fmt == "q4":
            pairs = q.reshape(blocks, k // 4, 2, 32)
            q = pairs[:, :, 0] | (pairs[:, :, 1] << 4)

    def per_block(t: torch.Tensor) -> torch.Tensor:
        t = torch.cat((t.float(), t.new_zeros(spare, t.shape[1], dtype=torch.float32)))
        return t.reshape(blocks, 16, -1).transpose(1, 2).contiguous()

    scales, mins = per_block(w.scales), None if w.mins is None else per_block(w.mins)
    if channels and half_scales and all(t is None or torch.equal(t.half().float(), t) for t in (scales, mins)):
        scales, mins = scales.half(), None if mins is None else mins.half()
    fmt = w.fmt + "c" if channels else w.fmt
    return PackedCodes(fmt, q.contiguous(), scales, mins, w.group, (n, k))


def quantize_activation_runs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[..., k]` (k whole runs of 32) as llama.cpp quantizes activations for its Q8_0 products: per run,
    `d = max |x| / 127` in fp32 and codes `round(x / d)` (half to even) in -127..127, 0 where d is 0. Returns the
    int8 codes `[..., k]` and d `[..., k // 32]`."""
    runs = x.float().reshape(*x.shape[:-1], -1, CHUNK)
    d = runs.abs().amax(dim=-1) / 127.0
    safe = torch.where(d > 0, d, torch.ones_like(d)).unsqueeze(-1)
    q = torch.where(d.unsqueeze(-1) > 0, torch.round(runs / safe), torch.zeros_like(runs)).clamp_(-127, 127)
    return q.to(torch.int8).reshape(x.shape), d


def int8_activation_product(weight: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """`x @ W.T (+ bias)` with x quantized to int8 per run of 32 (`quantize_activation_runs`), the formula of the
    opt-in int8-activation products (`Transformer.quantize_activations`) and their unoptimised path: each run's
    integer sum of codes times x's codes, times the run's d and its group's scale, plus (q4) each group's min times
    x's exact sum over the group; summed in float64, rounded once to x's dtype. Groups of whole runs only."""
    w = weight.unfactored()
    n, k = w.shape
    if w.group % CHUNK or k % w.group:
        raise ValueError(f"int8 activations take groups of whole runs of {CHUNK} (a {w.scheme} weight has groups of "
                         f"{w.group}): keep this weight's products exact")
    runs, per = k // CHUNK, w.group // CHUNK
    xs = x.reshape(-1, k)
    q, d = quantize_activation_runs(xs)
    codes = (unpack_q4(w.codes) if w.fmt == "q4" else w.codes).double().reshape(n, runs, CHUNK)
    isum = torch.einsum("nrc,mrc->mnr", codes, q.double().reshape(-1, runs, CHUNK))  # exact integers
    scales = w.scales.double().repeat_interleave(per, dim=1)  # [n, runs]
    out = (isum * d.double().unsqueeze(1) * scales.unsqueeze(0)).sum(-1)
    if w.mins is not None:
        out = out + xs.double().reshape(-1, k // w.group, w.group).sum(-1) @ w.mins.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def factor(multipliers: torch.Tensor, supers: torch.Tensor) -> torch.Tensor:
    """Factored scales: per row the int8 `multipliers` `[n, groups]`, then the float16 `supers` `[n, k // 256]` as
    their bytes (int8 `[n, groups + 2 * (k // 256)]`)."""
    n = multipliers.shape[0]
    super_bytes = supers.to(torch.float16).contiguous().view(torch.int8).reshape(n, -1)
    return torch.cat((multipliers.to(torch.int8), super_bytes), dim=1)


def _unfactor(factored: torch.Tensor, k: int) -> torch.Tensor:
    """float32 `[n, groups]`: each group's `super * multiplier` (the kernels' product: exact in fp32)."""
    supers = k // 256
    groups = factored.shape[1] - 2 * supers
    multipliers = factored[:, :groups].float()
    d = factored[:, groups:].contiguous().view(torch.float16).float()
    return d.repeat_interleave(groups // supers, dim=1) * multipliers


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 `[n, k]` from packed `[n, k // 2]` (per run of 32: low nibbles, then high ones)."""
    n = packed.shape[0]
    runs = packed.reshape(n, -1, 1, CHUNK // 2)
    return torch.cat((runs & 0x0F, runs >> 4), dim=2).reshape(n, -1)


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """The inverse of `unpack_q4`: codes 0..15 `[n, k]` (k a multiple of 32) packed two to a byte."""
    n = q.shape[0]
    runs = q.to(torch.uint8).reshape(n, -1, 2, CHUNK // 2)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, -1)


def _check_matrix(weight: torch.Tensor, name: str) -> None:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"{name}: only 2-D float weights are quantized, got {tuple(weight.shape)} {weight.dtype}")
    if weight.shape[1] % CHUNK:
        raise ValueError(f"{name}: {weight.shape[1]} inputs are not a multiple of {CHUNK}; "
                         "keep this model's weights dense (weights=None)")


def quantize_int8(weight: torch.Tensor, name: str = "weight", group: int | None = None) -> QuantizedWeight:
    """Symmetric int8 per output channel (or per `group` inputs, a multiple of 32 dividing them): scale =
    max |w| / 127 in fp32, q = round(w / scale)."""
    _check_matrix(weight, name)
    n, k = weight.shape
    group = group or k
    if group % CHUNK or k % group:
        raise ValueError(f"{name}: an int8 group of {group} must be a multiple of {CHUNK} dividing {k}")
    w = weight.detach().float().reshape(n, k // group, group)
    scale = w.abs().amax(dim=-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    codes = torch.round(w / safe).clamp_(-127, 127).to(torch.int8).reshape(n, k)
    return QuantizedWeight("int8", codes, scale, None, group)


def quantize_int4(weight: torch.Tensor, group: int = 32, name: str = "weight") -> QuantizedWeight:
    """Asymmetric int4 over groups of `group` inputs: min and scale = (max - min) / 15 of each group, stored in
    float16, q = round((w - min) / scale) in 0..15 against the stored (rounded) min and scale."""
    _check_matrix(weight, name)
    if group not in INT4_GROUPS:
        raise ValueError(f"group_size must be one of {INT4_GROUPS}, got {group!r}")
    n, k = weight.shape
    if k % group:
        raise ValueError(f"{name}: {k} inputs are not a multiple of group_size={group}; "
                         f"use a group size dividing {k}")
    w = weight.detach().float().reshape(n, k // group, group)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    mins = lo.to(torch.float16)
    scales = ((hi - mins.float()) / 15.0).to(torch.float16)
    step = scales.float().unsqueeze(-1)
    safe = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.round((w - mins.float().unsqueeze(-1)) / safe).clamp_(0, 15)
    return QuantizedWeight("int4", pack_q4(q.reshape(n, k)), scales, mins, group)


def quantize(weight: torch.Tensor, scheme: str, group: int = 32, name: str = "weight",
             rows: int = 4096) -> QuantizedWeight:
    """`weight` under `scheme`: "int8" per output channel; "int4" in groups of `group` (a matrix whose inputs
    `group` does not divide takes the largest smaller group size that does, as llama.cpp falls back per tensor);
    "int8-g32", int8 per 32 inputs (Q8_0's grain: the LM head's scheme under both). Rows are quantized `rows` at a
    time (each row is its own), so a large LM head needs no fp32 copy of itself."""
    if weight.dim() == 2 and weight.shape[0] > rows:
        parts = [quantize(part, scheme, group, name, rows) for part in weight.split(rows)]
        mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts if p.mins is not None])
        return QuantizedWeight(parts[0].scheme, torch.cat([p.codes for p in parts]),
                               torch.cat([p.scales for p in parts]), mins, parts[0].group)
    if scheme == "int8":
        return quantize_int8(weight, name)
    if scheme == "int8-g32":
        return quantize_int8(weight, name, CHUNK)
    if scheme == "int4":
        if group not in INT4_GROUPS:
            raise ValueError(f"group_size must be one of {INT4_GROUPS}, got {group!r}")
        fits = [g for g in INT4_GROUPS if g <= group and weight.dim() == 2 and weight.shape[1] % g == 0]
        return quantize_int4(weight, max(fits) if fits else group, name)
    raise ValueError(f"weights must be one of {', '.join(map(repr, SCHEMES))}, got {scheme!r}")


# ---- GGUF blocks, re-laid out without changing a value ----

def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start : start + 2].contiguous().view(torch.float16).reshape(-1)


def from_gguf(raw: torch.Tensor, kind: str, shape: tuple[int, int], rows: int = 4096) -> QuantizedWeight:
    """The weight a GGUF tensor of block type `kind` (one of STORED_KINDS) and torch shape `shape` holds, as
    codes and scales: the same values `infer.gguf_quants.dequantize` gives, bit for bit. Re-laid out `rows` rows
    at a time into the final tensors: the unpacking's temporaries of a whole vocabulary-wide table (several times
    its size) would otherwise be the load's peak."""
    n, k = shape
    if n > rows:
        flat = raw.reshape(-1).view(torch.uint8)
        row_bytes = flat.numel() // n
        first = _from_gguf_rows(flat[: rows * row_bytes], kind, (rows, k))
        parts = [t for t in (first.codes, first.scales, first.mins) if t is not None]
        full = [torch.empty(n, *t.shape[1:], dtype=t.dtype) for t in parts]
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            piece = first if start == 0 else _from_gguf_rows(flat[start * row_bytes : stop * row_bytes], kind,
                                                             (stop - start, k))
            for target, t in zip(full, [t for t in (piece.codes, piece.scales, piece.mins) if t is not None],
                                 strict=True):
                target[start:stop] = t
        return QuantizedWeight(kind, full[0], full[1], full[2] if len(full) > 2 else None, first.group)
    return _from_gguf_rows(raw, kind, shape)


def _from_gguf_rows(raw: torch.Tensor, kind: str, shape: tuple[int, int]) -> QuantizedWeight:
    n, k = shape
    sizes = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q5_0": 22, "Q6_K": 210}
    per_block = QK_K if kind in ("Q4_K", "Q6_K") else 32
    if kind not in sizes:
        raise ValueError(f"{kind} is not run as stored; supported: {', '.join(STORED_KINDS)}")
    if k % per_block:
        raise ValueError(f"a {kind} row of {k} values is not whole blocks of {per_block}")
    blocks = raw.reshape(-1).view(torch.uint8).reshape(n * k // per_block, sizes[kind])
    if kind == "Q8_0":
        codes = blocks[:, 2:].contiguous().view(torch.int8).reshape(n, k)
        return QuantizedWeight(kind, codes, _f16(blocks, 0).reshape(n, -1).clone(), None, 32)
    if kind == "Q4_0":
        d = _f16(blocks, 0).float()
        scales, mins = d, -8.0 * d
        if bool(torch.isfinite(mins.half()).all()):  # -8 d fits float16 (always, for real weights): exact there
            scales, mins = scales.half(), mins.half()
        codes = blocks[:, 2:].reshape(n, k // 2).clone()
        return QuantizedWeight(kind, codes, scales.reshape(n, -1), mins.reshape(n, -1), 32)
    if kind == "Q4_1":
        codes = blocks[:, 4:].reshape(n, k // 2).clone()
        return QuantizedWeight(kind, codes, _f16(blocks, 0).reshape(n, -1).clone(),
                               _f16(blocks, 2).reshape(n, -1).clone(), 32)
    if kind == "Q5_0":  # 5-bit codes offset by 16, one fp16 d per 32: q8 codes in -16..15
        codes = _q5_0_codes(blocks).to(torch.int8).reshape(n, k)
        return QuantizedWeight(kind, codes, _f16(blocks, 0).reshape(n, -1).clone(), None, 32)
    if kind == "Q6_K":  # 16 sub-blocks of 16: int8 scales under one fp16 d, 6-bit codes offset by 32
        q = _q6_k_codes(blocks).reshape(n, k)
        sc = blocks[:, 192:208].contiguous().view(torch.int8).reshape(n, -1)
        return QuantizedWeight(kind, q, factor(sc, _f16(blocks, 208).reshape(n, -1)), None, 16)
    # Q4_K: super-blocks of 256 in 8 sub-blocks of 32, 6-bit scales and mins under fp16 d and dmin; each run of
    # 32 bytes holds sub-block 2j in its low nibbles and 2j + 1 in its high ones.
    sc, mn = _k_scales(blocks[:, 4:16])
    packed = blocks[:, 16:].reshape(-1, 4, 32)
    q = torch.stack((packed & 0x0F, packed >> 4), dim=2).reshape(n, k)  # element order restored
    # mins under -dmin (a float16 negation is exact): -(dmin * m), the product llama.cpp subtracts
    return QuantizedWeight(kind, pack_q4(q), factor(sc.reshape(n, -1), _f16(blocks, 0).reshape(n, -1)),
                           factor(mn.reshape(n, -1), -_f16(blocks, 2).reshape(n, -1)), 32)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
    """One weight holding `parts`' rows in order (a fused projection), or None where they differ in scheme,
    group or scale dtype (GGUF files may mix block types across q, k and v)."""
    first = parts[0]
    if any(p.scheme != first.scheme or p.group != first.group or p.scales.dtype != first.scales.dtype
           or p.shape[1] != first.shape[1] for p in parts):
        return None
    mins = None if first.mins is None else torch.cat([p.mins for p in parts if p.mins is not None])
    return QuantizedWeight(first.scheme, torch.cat([p.codes for p in parts]),
                           torch.cat([p.scales for p in parts]), mins, first.group)
