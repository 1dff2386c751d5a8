"""The CPU decode GEMV of `cpu_decode.c`, compiled at first use by the machine's C compiler for its own CPU
(`-march=native`, OpenMP) and called through ctypes.

A one-token decode step streams every weight once; ATen's bf16 `torch.mv` reaches ~85% of a 2-core Xeon's
read bandwidth, this kernel all of it (see cpu_decode.c for why). The build is cached on disk, keyed by the
source, the compiler, its flags and the CPU, so it runs once per machine; where there is no compiler or the
build fails, `native_kernels()` returns None and says why (`unavailable_reason`), and the engine keeps
ATen's forms. `infer.tuning.choose_decode_gemv` takes this kernel only where it measures faster.

`FLAVOURS` build the narrower instruction-set paths too (the tests hold every one the CPU can run to the
formula, so the AVX2 path of an EPYC is checked on a Xeon).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from infer.quant_weights import PackedCodes, QuantizedWeight, pack_codes

SOURCE = Path(__file__).with_name("cpu_decode.c")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
QSCHEMES = {"int8": 0, "int4": 1, "fp4": 2}  # a quantized cache's scheme -> cpu_decode.c's Q_INT8, Q_INT4, Q_FP4
SCALE_CODES = {torch.float32: 0, torch.float16: 2, torch.int8: 3}  # quantized scales: int8 is the factored form (FK)
# QuantizedWeight.kernel_args' format (and PackedCodes' channel form) -> cpu_decode.c's Q8 / Q4 / Q6 / Q8C / Q4C
QFORMATS = {"q8": 0, "q4": 1, "q6": 2, "q8c": 3, "q4c": 4}


HALF_SCALES = 8  # cpu_decode.c's flag in a packed format: the channel form's scales and mins float16
MINS_EIGHT_SCALES = 16  # cpu_decode.c's flag in infer_qgemv's format: q4 mins all -8 x the scales (Q4_0), formed


def packed_format(packed: PackedCodes) -> int:
    """cpu_decode.c's format of codes packed by `pack_codes`: QFORMATS', with HALF_SCALES where the scales are
    float16."""
    return QFORMATS[packed.fmt] | (HALF_SCALES if packed.scales.dtype == torch.float16 else 0)


def point_at_packed_codes(desc: StepProj | BatchProduct, packed: PackedCodes) -> list[torch.Tensor]:
    """Point a product's descriptor (its `w`, `scales`, `mins`, `fmt` and `group`) at codes packed
    by `pack_codes`; the tensors it now points into, for the caller to keep alive."""
    desc.w, desc.scales = packed.codes.data_ptr(), packed.scales.data_ptr()
    desc.mins = None if packed.mins is None else packed.mins.data_ptr()
    desc.fmt, desc.group = packed_format(packed), packed.group
    return [t for t in (packed.codes, packed.scales, packed.mins) if t is not None]


def codes_shape_taken(fmt: str, k: int, group: int) -> bool:
    """Whether cpu_decode.c's kernels on codes (its qshape_ok) take a QuantizedWeight's codes of format `fmt` (its
    `kernel_args`' format) at inner size `k` in groups of `group`: whole runs of 32 inputs, groups of whole runs (or,
    q8 codes, of 16)."""
    return fmt in QFORMATS and k % 32 == 0 and k % group == 0 and (group % 32 == 0 or (group == 16 and fmt != "q4"))

# Compiler flags per flavour: "native" is the widest path the CPU has; the others switch paths off (x86).
FLAVOURS: dict[str, tuple[str, ...]] = {
    "native": (),
    "avx512f": ("-mno-avx512bf16",),
    "avx2": ("-mno-avx512f",),
    "generic": ("-mno-avx512f", "-mno-avx2", "-mno-fma"),
}
# Every build's own flags (-ffp-contract=off: the small ops round where PyTorch's formulas round, no fused
# multiply-adds); then -march and OpenMP where they take, and the flavour's switches.
BUILD_FLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off")
# The CPU flags a flavour's code needs (it is built with -march=native minus the flavour's switches).
FLAVOUR_NEEDS: dict[str, tuple[str, ...]] = {
    "native": (), "avx512f": ("avx512f", "avx512bw", "avx512vl"), "avx2": ("avx2", "fma"), "generic": (),
}

_reasons: dict[str, str] = {}


class StepProj(ctypes.Structure):
    """cpu_decode.c's step_proj: one product of a native decode step (kind 0 dense, 1 q8, 2 q4, 3 Q6_K's q8; 4 codes
    packed by `pack_codes`, their format in `fmt`)."""

    _fields_ = [("kind", ctypes.c_int), ("sdtype", ctypes.c_int), ("w", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("mins", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("group", ctypes.c_int64), ("fmt", ctypes.c_int64)]


class StepLayer(ctypes.Structure):
    """cpu_decode.c's step_layer: one decoder layer of a native decode step (infer/models/native_step.py fills it)."""

    _fields_ = [("qkv", StepProj * 3), ("o", StepProj), ("gate_up", StepProj * 2), ("down", StepProj),
                ("n_qkv", ctypes.c_int64), ("n_gate_up", ctypes.c_int64),
                *((name, ctypes.c_void_p) for name in ("attn_in", "attn_out", "mlp_in", "mlp_out", "q_norm", "k_norm",
                                                       "k", "v")),
                ("slots", ctypes.c_int64), ("ring", ctypes.c_int64), ("window", ctypes.c_int64),
                ("rope", ctypes.c_int64), ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
                *((name, ctypes.c_int64) for name in ("qscheme", "channel_keys", "sinks", "nq_cap", "block",
                                                      "scale_rows", "vslots", "nqv_cap")),
                *((name, ctypes.c_void_p) for name in ("k_sink", "v_sink", "k_codes", "v_codes", "k_scale", "v_scale",
                                                       "k_offset", "v_rot"))]


class BatchProduct(ctypes.Structure):
    """cpu_decode.c's batch_product: a bf16 weight packed by `pack_bf16` (fmt -1) or codes packed by `pack_codes` (fmt
    Q8 / Q4 / Q8C / Q4C, float32 scales and mins), and its bias (or NULL); `rows_w`: the bf16 weight row-major, which
    one-row steps' GEMV reads (or NULL)."""

    _fields_ = [*((name, ctypes.c_void_p) for name in ("w", "bias", "scales", "mins")), ("fmt", ctypes.c_int64),
                ("group", ctypes.c_int64), ("rows_w", ctypes.c_void_p)]


class BatchTables(ctypes.Structure):
    """cpu_decode.c's batch_tables: a ragged batch's slots and tables (int64 tensors' addresses), as the layers
    reading it see them."""

    _fields_ = [*((name, ctypes.c_void_p) for name in ("slot_blocks", "slot_offsets", "fresh", "tables", "lengths",
                                                        "starts")),
                ("n_fresh", ctypes.c_int64), ("nb", ctypes.c_int64)]
    keep: list[torch.Tensor]  # the tensors it points into (not a field: alive as long as the description)


class BatchLayer(ctypes.Structure):
    """cpu_decode.c's batch_layer: one decoder layer of a batched engine step in one call
    (infer/models/native_batch_step.py fills it)."""

    _fields_ = [*((name, ctypes.c_void_p) for name in ("attn_norm", "mlp_norm", "attn_out", "mlp_out", "q_norm",
                                                        "k_norm")),
                ("batch", ctypes.POINTER(BatchTables)),
                *((name, BatchProduct) for name in ("qkv", "o", "gate_up", "down")),
                *((name, ctypes.c_void_p) for name in ("k_blocks", "v_blocks", "cos", "sin")),
                ("window", ctypes.c_int64), ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
                # a quantized pool's layer (NULL codes: an exact pool)
                *((name, ctypes.c_void_p) for name in ("k_codes", "v_codes", "k_scale", "v_scale", "k_offset",
                                                        "rotation", "k_stage", "v_stage", "write_rows", "fresh_rows",
                                                        "fill_rows", "fill_blocks")),
                ("scheme", ctypes.c_int64), ("num_blocks", ctypes.c_int64), ("n_fill", ctypes.c_int64)]


class BatchEnds(ctypes.Structure):
    """cpu_decode.c's batch_ends: the step's rows embedded in the call (`embed` [vocab, hidden] bf16 at each row's id,
    or a quantized table's rows dequantized: `embed_codes`, its scales and mins, QFORMATS format, SCALE_CODES dtype and
    group; times `embed_scale` unless 0), its layers' RoPE tables read at each row's position (`positions`;
    `table_rows` positions a table), the final norm (`final_norm`) on every row; a NULL field: not done in the call."""

    _fields_ = [("embed", ctypes.c_void_p), ("embed_codes", ctypes.c_void_p), ("embed_scales", ctypes.c_void_p),
                ("embed_mins", ctypes.c_void_p), ("embed_fmt", ctypes.c_int64), ("embed_sdtype", ctypes.c_int64),
                ("embed_group", ctypes.c_int64), ("ids", ctypes.c_void_p), ("vocab", ctypes.c_int64),
                ("embed_scale", ctypes.c_float), ("positions", ctypes.c_void_p), ("table_rows", ctypes.c_int64),
                ("final_norm", ctypes.c_void_p)]


# The whole step's call back into Python after a quantized pool's layer staged its rows: quantize the blocks they fill.
QUANTIZE_FILLED = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64)


class NativeKernels:
    """A loaded build of cpu_decode.c: `gemv` for decode products, `read` for the read-bandwidth probe."""

    def __init__(self, path: Path, openmp: bool) -> None:
        lib = ctypes.CDLL(str(path))
        lib.infer_gemv.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int64,
                                                                             ctypes.c_int]
        lib.infer_gemv.restype = ctypes.c_int
        lib.infer_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        lib.infer_read.restype = ctypes.c_double
        lib.infer_isa.restype = ctypes.c_char_p
        lib.infer_supports.argtypes = [ctypes.c_int]
        lib.infer_rms_norm.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [
            ctypes.c_float, ctypes.c_int, ctypes.c_int]
        lib.infer_rope.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2
        lib.infer_rope_rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int]
        lib.infer_gated.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_int]
        p, n = ctypes.c_void_p, ctypes.c_int64
        lib.infer_write_kv.argtypes = [p, n, n, p, n, n, p, p, p, p, n, p, n, n, n, n, n]
        lib.infer_gated_rows.argtypes = [ctypes.c_int, p, n, p, n, p, n, n, ctypes.c_int, ctypes.c_int]
        lib.infer_argmax_rows.argtypes = [ctypes.c_int, p, n, n, n, p, ctypes.c_int]
        lib.infer_argmax_rows.restype = None
        self._argmax_rows = lib.infer_argmax_rows
        lib.infer_top_p_rows.argtypes = [p, n, p, p, n, p, n, n, ctypes.c_double, ctypes.c_int]
        lib.infer_top_p_rows.restype = None
        self._top_p_rows = lib.infer_top_p_rows
        lib.infer_draw_rows.argtypes = [p, n, n, n, p, p, ctypes.c_int]
        lib.infer_draw_rows.restype = None
        self._draw_rows = lib.infer_draw_rows
        for fn in (lib.infer_rms_norm, lib.infer_rope, lib.infer_rope_rows, lib.infer_gated, lib.infer_write_kv,
                   lib.infer_gated_rows):
            fn.restype = None
        lib.infer_qattn.argtypes = ([ctypes.c_int] * 3 + [ctypes.c_void_p] * 12 + [ctypes.c_int64] * 15
                                    + [ctypes.c_float] * 2 + [ctypes.c_int64, ctypes.c_int])
        lib.infer_qattn.restype = ctypes.c_int
        self._qattn = lib.infer_qattn
        lib.infer_qattn_paged.argtypes = ([ctypes.c_int] * 2 + [ctypes.c_void_p] * 13 + [ctypes.c_int64] * 7
                                          + [ctypes.c_float] * 2 + [ctypes.c_int64, ctypes.c_int])
        lib.infer_qattn_paged.restype = ctypes.c_int
        self._qattn_paged = lib.infer_qattn_paged
        self._rms_norm, self._rope, self._gated = lib.infer_rms_norm, lib.infer_rope, lib.infer_gated
        self._rope_rows, self._write_kv = lib.infer_rope_rows, lib.infer_write_kv
        self._gated_rows = lib.infer_gated_rows
        # fmt, codes, scale dtype, scales, mins, dtype, x, bias, y, m, n, k, group, threads
        lib.infer_qgemv.argtypes = ([ctypes.c_int] + [ctypes.c_void_p] + [ctypes.c_int] + [ctypes.c_void_p] * 2
                                    + [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_int])
        lib.infer_qgemv.restype = ctypes.c_int
        # fmt, codes, scale dtype, scales, mins, dtype, out, n, k, group, threads
        lib.infer_qdequant.argtypes = ([ctypes.c_int] + [ctypes.c_void_p] + [ctypes.c_int] + [ctypes.c_void_p] * 2
                                       + [ctypes.c_int] + [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_int])
        lib.infer_qdequant.restype = ctypes.c_int
        self._qgemv, self._qdequant = lib.infer_qgemv, lib.infer_qdequant
        # fmt, codes, scale dtype, scales, mins, dtype, x, bias, y, n, k, group, threads
        lib.infer_qgemv_a8.argtypes = ([ctypes.c_int] + [ctypes.c_void_p] + [ctypes.c_int] + [ctypes.c_void_p] * 2
                                       + [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int])
        lib.infer_qgemv_a8.restype = ctypes.c_int
        self._qgemv_a8 = lib.infer_qgemv_a8
        # dtype, layers, n_layers, heads, kv_heads, d, hidden, inter, eps, gemma, gelu, x, pos, quantized,
        # vquantized, cos, sin, threads
        step_args: list[Any] = [ctypes.c_int, ctypes.POINTER(StepLayer), *[ctypes.c_int64] * 6, ctypes.c_float,
                                ctypes.c_int, ctypes.c_int, ctypes.c_void_p, *[ctypes.c_int64] * 3,
                                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        lib.infer_decode_step.argtypes = step_args
        lib.infer_decode_step.restype = ctypes.c_int
        self._decode_step = lib.infer_decode_step
        # dtype, layers, n_layers, x, rows, heads, kv_heads, d, hidden, inter, eps, gemma, gelu, bs, threads,
        # quantize_filled, ends
        batch_args: list[Any] = [ctypes.c_int, ctypes.POINTER(BatchLayer), ctypes.c_int64, ctypes.c_void_p,
                                 *[ctypes.c_int64] * 6, ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                 ctypes.c_int, QUANTIZE_FILLED, ctypes.POINTER(BatchEnds)]
        lib.infer_batch_step.argtypes = batch_args
        lib.infer_batch_step.restype = ctypes.c_int
        self._batch_step = lib.infer_batch_step
        self._gemv = lib.infer_gemv
        lib.infer_gemm_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        lib.infer_gemm_bf16.restype = ctypes.c_int
        self._gemm_bf16 = lib.infer_gemm_bf16
        lib.infer_gemm_bf16_packed.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        lib.infer_gemm_bf16_packed.restype = ctypes.c_int
        lib.infer_pack_bf16.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
        lib.infer_pack_bf16.restype = None
        self._gemm_bf16_packed, self._pack_bf16 = lib.infer_gemm_bf16_packed, lib.infer_pack_bf16
        lib.infer_gemm_f32_packed.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        lib.infer_gemm_f32_packed.restype = ctypes.c_int
        lib.infer_pack_f32.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
        lib.infer_pack_f32.restype = None
        self._gemm_f32_packed, self._pack_f32 = lib.infer_gemm_f32_packed, lib.infer_pack_f32
        # fmt, codes, scale dtype, scales, mins, x, bias, y, m, n, k, group, threads
        qgemm_args: list[Any] = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, *[ctypes.c_void_p] * 5,
                                 *[ctypes.c_int64] * 4, ctypes.c_int]
        lib.infer_qgemm_bf16.argtypes = qgemm_args
        lib.infer_qgemm_bf16.restype = ctypes.c_int
        self._qgemm_bf16 = lib.infer_qgemm_bf16
        # fmt, codes, scales, mins, x, bias, y, m, n, k, group, threads
        lib.infer_qgemm_packed.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 6, *[ctypes.c_int64] * 4, ctypes.c_int]
        lib.infer_qgemm_packed.restype = ctypes.c_int
        self._qgemm_packed = lib.infer_qgemm_packed
        lib.infer_qgemm_packed_f32.argtypes = lib.infer_qgemm_packed.argtypes
        lib.infer_qgemm_packed_f32.restype = ctypes.c_int
        self._qgemm_packed_f32 = lib.infer_qgemm_packed_f32
        self._read = lib.infer_read
        lib.infer_set_prefetch.argtypes = [ctypes.c_int]
        lib.infer_set_prefetch.restype = None
        self._set_prefetch, self._prefetch_level = lib.infer_set_prefetch, lib.infer_prefetch_level
        lib.infer_packed_code_sums.argtypes = [ctypes.c_int, ctypes.c_int64]
        lib.infer_packed_code_sums.restype = ctypes.c_int
        self._code_sums = lib.infer_packed_code_sums
        lib.infer_q4_code_rows.argtypes = [ctypes.c_int64]
        lib.infer_q4_code_rows.restype = ctypes.c_int
        self._q4_code_rows = lib.infer_q4_code_rows
        lib.infer_amx_takes.argtypes = [ctypes.c_int64]
        lib.infer_amx_takes.restype = ctypes.c_int
        self._amx_takes = lib.infer_amx_takes
        lib.infer_amx_attention_rows.argtypes = []
        lib.infer_amx_attention_rows.restype = ctypes.c_int64
        self._amx_attention_rows = lib.infer_amx_attention_rows
        lib.infer_qattn_run_rows.argtypes = []
        lib.infer_qattn_run_rows.restype = ctypes.c_int64
        self._qattn_run_rows = lib.infer_qattn_run_rows
        lib.infer_quantize_blocks.argtypes = [ctypes.c_int, ctypes.c_int, *[ctypes.c_void_p] * 4, ctypes.c_int64,
                                              *[ctypes.c_void_p] * 6, *[ctypes.c_int64] * 3, ctypes.c_int]
        lib.infer_quantize_blocks.restype = ctypes.c_int
        self._quantize_blocks = lib.infer_quantize_blocks
        lib.infer_set_packed_ahead.argtypes = [ctypes.c_int]
        lib.infer_set_packed_ahead.restype = None
        self._set_packed_ahead, self._packed_ahead = lib.infer_set_packed_ahead, lib.infer_packed_ahead
        self.path = path
        self.isa: str = lib.infer_isa().decode()
        # bf16 norms and rotations of many rows at once (the batched engine's steps) faster than PyTorch's ops
        self.rows_vectorized = bool(lib.infer_rows_vectorized())
        self.openmp = openmp  # without OpenMP a build runs on one thread
        self.dtypes = frozenset(d for d, code in DTYPE_CODES.items() if lib.infer_supports(code))
        # The few-row bf16 product needs the bf16 pair instruction (AVX512-BF16); a call on no rows asks.
        self.gemm_bf16_available = lib.infer_gemm_bf16(None, None, None, None, 0, 0, 0, 1) == 0
        # The packed product runs on the pair instruction, or on AVX2's fp32 FMAs with the weights widened in
        # registers (CPUs without bf16 units).
        self.packed_bf16_available = lib.infer_gemm_bf16_packed(None, None, None, None, 0, 0, 0, 1) == 0
        # The fp32 packed product (an fp32 model's batched products): AVX2 with FMA (AVX512 builds have them too).
        self.packed_f32_available = lib.infer_gemm_f32_packed(None, None, None, None, 0, 0, 0, 1) == 0
        # The packed product on a quantized weight's packed codes: wherever the packed product runs (AVX2 dequantizes
        # each block into bf16 for its fp32 FMAs); a call on no rows of a valid shape asks.
        self.packed_codes_available = lib.infer_qgemm_packed(0, None, None, None, None, None, None, 0, 0, 32, 32,
                                                             1) == 0
        # AVX2's packed product also takes codes in the channel form (no dequantizing), which `pack_codes` lays out
        # unless INFER_PACKED_CHANNEL_CODES=0 (the check against dequantizing into bf16).
        self.channel_codes_available = lib.infer_qgemm_packed(3, None, None, None, None, None, None, 0, 0, 32, 32,
                                                              1) == 0
        self.channel_codes = self.channel_codes_available and os.environ.get("INFER_PACKED_CHANNEL_CODES") != "0"
        # fp32 rows (an fp32 model's) against codes in the channel form, fp32 outputs: AVX2's tiles, in every build
        # with AVX2 and FMA (AVX512-BF16 builds' bf16 rows take codes in the pairs form, for the pair instruction)
        self.packed_codes_f32_available = lib.infer_qgemm_packed_f32(3, None, None, None, None, None, None, 0, 0, 32,
                                                                     32, 1) == 0

    def __repr__(self) -> str:
        return f"NativeKernels({self.isa}{'' if self.openmp else ', one thread'}, {self.path.name})"

    @property
    def prefetch_level(self) -> int:
        """Where this build's streams prefetch ahead of their loads: 1 the L1 cache, 2 the L2 (process-wide; the
        same results either way, only the speed differs: infer.tuning.choose_prefetch times it)."""
        return int(self._prefetch_level())

    @prefetch_level.setter
    def prefetch_level(self, level: int) -> None:
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"prefetch_level must be 1 (L1 cache) or 2 (L2), got {level!r}")
        self._set_prefetch(level)

    @property
    def packed_ahead(self) -> int:
        """How many pairs of blocks ahead of its pass the packed product (`gemm_bf16_packed`) prefetches: 1 (the next
        pair) or 2 (the pair after next), process-wide; the same results either way, only the speed differs
        (infer.tuning.choose_packed_ahead times it)."""
        return int(self._packed_ahead())

    @packed_ahead.setter
    def packed_ahead(self, pairs: int) -> None:
        if isinstance(pairs, bool) or pairs not in (1, 2):
            raise ValueError(f"packed_ahead must be 1 (the next pair of blocks) or 2 (the pair after next), got "
                             f"{pairs!r}")
        self._set_packed_ahead(pairs)

    def supports(self, weight: torch.Tensor) -> bool:
        """Whether `gemv` takes this weight: a contiguous 2-D CPU tensor of a dtype the build computes."""
        return (weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in self.dtypes
                and weight.is_contiguous())

    def gemv(self, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`weight @ x (+ bias)` for one row `x` of `weight.shape[1]` values, in the weights' dtype (fp32
        sums, rounded once). The caller has checked `supports(weight)`; x and bias are made to match."""
        n, k = weight.shape
        x = x.reshape(k)
        if x.dtype != weight.dtype or not x.is_contiguous():
            x = x.to(weight.dtype).contiguous()
        if bias is not None and (bias.dtype != weight.dtype or not bias.is_contiguous()):
            bias = bias.to(weight.dtype).contiguous()
        out = torch.empty(n, dtype=weight.dtype)
        if self._gemv(DTYPE_CODES[weight.dtype], weight.data_ptr(), x.data_ptr(),
                      None if bias is None else bias.data_ptr(), out.data_ptr(), n, k, torch.get_num_threads()):
            raise MemoryError(f"the native GEMV could not allocate its buffers ({4 * k} bytes to widen x, its "
                              f"threads' shares)")
        return out

    def gemm_bf16(self, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ weight.T (+ bias)` for a few rows `x` `[..., k]` of bf16 (the engine's decode steps): fp32 sums,
        rounded once, as F.linear's. Needs `gemm_bf16_available` and a bf16 weight `supports` takes."""
        n, k = weight.shape
        rows, bias, out = _bf16_operands(x, k, n, bias)
        if self._gemm_bf16(weight.data_ptr(), rows.data_ptr(), None if bias is None else bias.data_ptr(),
                           out.data_ptr(), rows.shape[0], n, k, torch.get_num_threads()):
            raise ValueError("the native bf16 product needs the AVX512-BF16 pair instruction; this build is "
                             f"{self.isa}")
        return out.view(*x.shape[:-1], n)

    def pack_bf16(self, weight: torch.Tensor) -> torch.Tensor:
        """A copy of the bf16 weight `[n, k]` (k even) in the layout `gemm_bf16_packed` reads: blocks of 16 rows, each
        row's pairs of inputs interleaved (zero rows fill the last block). The weight is unchanged."""
        n, k = weight.shape
        if weight.dtype != torch.bfloat16 or k % 2 or not self.supports(weight):
            raise ValueError(f"pack_bf16 takes a contiguous bf16 CPU weight [n, k] with k even, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        packed = torch.empty(-(-n // 16) * 16 * k, dtype=torch.bfloat16)
        self._pack_bf16(weight.data_ptr(), packed.data_ptr(), n, k, torch.get_num_threads())
        return packed

    def pack_f32(self, weight: torch.Tensor) -> torch.Tensor:
        """A copy of the fp32 weight `[n, k]` in the layout `gemm_f32_packed` reads: blocks of 16 rows, input-major
        (input i's 16 weights of a block side by side; zero rows fill the last block). The weight is unchanged."""
        if weight.dtype != torch.float32 or weight.dim() != 2 or not self.supports(weight):
            raise ValueError(f"pack_f32 takes a contiguous fp32 CPU weight [n, k], got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        n, k = weight.shape
        packed = torch.empty(-(-n // 16) * 16 * k, dtype=torch.float32)
        self._pack_f32(weight.data_ptr(), packed.data_ptr(), n, k, torch.get_num_threads())
        return packed

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """`pack_bf16` or `pack_f32`, by the weight's dtype: the copy the packed product (`gemm_packed`) reads."""
        return self.pack_f32(weight) if weight.dtype == torch.float32 else self.pack_bf16(weight)

    def code_sums(self, fmt: str, k: int) -> bool:
        """Whether `quantized_gemm_packed` multiplies codes of format `fmt` ("q8", "q6", "q4") with inner size `k`
        in the codes form (q8 codes on AVX512-BF16 off AMX tiles, INFER_PACKED_CODE_SUMS not 0): each code exact as
        a bf16, each group's sum times its scale."""
        return bool(self._code_sums(QFORMATS[fmt], k))

    def q4_code_rows(self, k: int) -> int:
        """Up to how many rows of x `quantized_gemm_packed` multiplies q4 codes with inner size `k` in the codes
        form (AVX512-BF16 off AMX tiles, INFER_Q4_CODES not 0: each code the exact bf16 1 + q / 16, each group's sum
        times 16 scales, plus its min less 16 scales times x's group sum); 0 where it never does (the codes
        dequantized to bf16 for every row count)."""
        return int(self._q4_code_rows(k))

    def amx_takes(self, k: int) -> bool:
        """Whether packed products of inner size `k` run on AMX tiles (an Intel Xeon's AMX-BF16, granted by the
        kernel, k a multiple of 32, INFER_AMX not 0); else the pair instruction's tiles."""
        return bool(self._amx_takes(k))

    def amx_attention_rows(self) -> int:
        """How many query rows of prompt chunks the paged attention has taken on AMX tiles in this process, each
        call's (a model's layers count a row once each): runs of 8 or more rows of one sequence's consecutive
        positions over one table, bf16 (an exact pool or a quantized one), head size a multiple of 32 up to 256, where
        `amx_takes` holds (the rest take the row kernel)."""
        return int(self._amx_attention_rows())

    def qattn_run_rows(self) -> int:
        """How many query rows of prompt chunks over a quantized pool the paged attention has taken as runs in this
        process, each call's: 2 or more rows of one sequence's consecutive positions over one table, each tile of codes
        decoded once for 16 rows (head size a multiple of 32 up to 256, INFER_QATTN_RUNS not 0), where the AMX tiles
        took none of the call's rows."""
        return int(self._qattn_run_rows())

    def gemm_bf16_packed(self, packed: torch.Tensor, x: torch.Tensor, n: int, bias: torch.Tensor | None = None
                         ) -> torch.Tensor:
        """`gemm_bf16` on a weight of `n` outputs that `pack_bf16` packed: 16 outputs a register (no fold of partial
        sums), each its own row's fp32 sum rounded once. Needs `packed_bf16_available` (AVX512-BF16's pair
        instruction, or AVX2 and FMA)."""
        k = x.shape[-1]
        if packed.dtype != torch.bfloat16 or packed.numel() != -(-n // 16) * 16 * k:
            raise ValueError(f"a packed weight of {packed.numel()} {packed.dtype} values is not [{n}, {k}] packed "
                             "by pack_bf16")
        rows, bias, out = _bf16_operands(x, k, n, bias)
        code = self._gemm_bf16_packed(packed.data_ptr(), rows.data_ptr(), None if bias is None else bias.data_ptr(),
                                      out.data_ptr(), rows.shape[0], n, k, torch.get_num_threads())
        if code == -4:
            raise MemoryError(f"the native packed product could not widen {rows.shape[0]} x {k} inputs to fp32")
        if code:
            raise ValueError(f"the native packed product needs AVX512-BF16 or AVX2 with FMA (this build: "
                             f"{self.isa}) and an even k (k={k})")
        return out.view(*x.shape[:-1], n)

    def gemm_f32_packed(self, packed: torch.Tensor, x: torch.Tensor, n: int, bias: torch.Tensor | None = None
                        ) -> torch.Tensor:
        """x [..., k] (fp32) times a weight of `n` outputs that `pack_f32` packed (+ bias): 16 outputs in two
        registers, each its own row's fp32 sum over k in order by fused multiply-adds, then the bias (never
        depending on the call's other rows). Needs `packed_f32_available` (AVX2 and FMA)."""
        k = x.shape[-1]
        if packed.dtype != torch.float32 or packed.numel() != -(-n // 16) * 16 * k:
            raise ValueError(f"a packed weight of {packed.numel()} {packed.dtype} values is not [{n}, {k}] packed "
                             "by pack_f32")
        if x.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
            raise ValueError(f"gemm_f32_packed takes fp32 inputs and bias, got {x.dtype}"
                             + ("" if bias is None else f" and {bias.dtype}"))
        rows = x.reshape(-1, k).contiguous()
        bias = None if bias is None else bias.contiguous()
        out = torch.empty(rows.shape[0], n, dtype=torch.float32)
        code = self._gemm_f32_packed(packed.data_ptr(), rows.data_ptr(), None if bias is None else bias.data_ptr(),
                                     out.data_ptr(), rows.shape[0], n, k, torch.get_num_threads())
        if code:
            raise ValueError(f"the fp32 packed product needs AVX2 with FMA (this build: {self.isa})")
        return out.view(*x.shape[:-1], n)

    def gemm_packed(self, packed: torch.Tensor, x: torch.Tensor, n: int, bias: torch.Tensor | None = None
                    ) -> torch.Tensor:
        """`gemm_f32_packed` for an fp32 packed copy (`pack`), else `gemm_bf16_packed`."""
        if packed.dtype == torch.float32:
            return self.gemm_f32_packed(packed, x, n, bias)
        return self.gemm_bf16_packed(packed, x, n, bias)

    def quantized_gemm_bf16(self, weight: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None = None
                            ) -> torch.Tensor:
        """`x @ W.T (+ bias)` for a few bf16 rows `x` `[..., k]` and the quantized `weight`: each tile of 4 weight
        rows dequantized once to bf16 in cache (the numbers `dequantize(bf16)` gives), then the few-row product's
        tiles; fp32 sums rounded once. Needs `gemm_bf16_available` and a weight `takes` accepts."""
        fmt, codes, sdtype, scales, mins, n, k, group = weight.kernel_args
        rows, bias, out = _bf16_operands(x, k, n, bias)
        code = self._qgemm_bf16(QFORMATS[fmt], codes, SCALE_CODES[sdtype], scales, mins, rows.data_ptr(),
                                None if bias is None else bias.data_ptr(), out.data_ptr(), rows.shape[0], n, k, group,
                                torch.get_num_threads())
        self._check_quantized_product(code, "few-row product", 8 * k, k, group)
        return out.view(*x.shape[:-1], n)

    def pack_codes(self, weight: QuantizedWeight, dtype: torch.dtype = torch.bfloat16) -> PackedCodes:
        """`weight`'s codes laid out for `quantized_gemm_packed` on rows of `dtype` in this build's form: the channel
        form where it takes one (`channel_codes`: AVX2; fp32 rows take only that form, in every build with AVX2 and
        FMA), the pairs form otherwise."""
        if dtype == torch.float32:
            if not self.packed_codes_f32_available:
                raise ValueError(f"the native packed product takes fp32 rows of codes on builds with AVX2 and FMA only "
                                 f"(this build: {self.isa}); pack the codes for bf16 rows or leave them unpacked")
            return pack_codes(weight, channels=True)
        return pack_codes(weight, channels=self.channel_codes)

    def quantized_gemm_packed(self, packed: PackedCodes, x: torch.Tensor, bias: torch.Tensor | None = None
                              ) -> torch.Tensor:
        """`x @ W.T (+ bias)` for bf16 rows `x` `[..., k]` and a quantized weight laid out by `pack_codes`: each pair
        of blocks dequantized once to bf16 in cache, then `gemm_bf16_packed`'s tiles (its values bit for bit, on the
        weight `dequantize(bf16)` gives); q8 codes where `code_sums` holds (AVX512-BF16) without rounding any
        weight: each code exact as a bf16 operand of the pair instruction, each group's sum times its scale added
        into the total in group order by fused multiply-adds, then the bias, rounded once; q4 codes (with mins) up
        to `q4_code_rows` rows of x likewise: each code the exact operand 1 + q / 16, each group's sum times 16
        scales plus its min less 16 scales times x's group sum, in group order, then the bias; codes in the channel
        form (`channel_codes`, AVX2) without rounding any weight to bf16: q8 each group's fp32 sum in order times
        its scale, summed over the groups in order; q4 the same up to 18 rows of x (three tiles), past them each
        weight's fp32 scale * code times x by fused multiply-adds over the row in order; then q4's each group's min
        times x's group sum (+ bias), rounded once.
        Needs `packed_codes_available`. fp32 rows (an fp32 model's), codes in the channel form and
        `packed_codes_f32_available`: the same sums, fp32 outputs (not rounded)."""
        n, k = packed.shape
        if x.dtype == torch.float32:
            return self._quantized_gemm_packed_f32(packed, x, bias)
        rows, bias, out = _bf16_operands(x, k, n, bias)
        code = self._qgemm_packed(packed_format(packed), packed.codes.data_ptr(), packed.scales.data_ptr(),
                                  None if packed.mins is None else packed.mins.data_ptr(), rows.data_ptr(),
                                  None if bias is None else bias.data_ptr(), out.data_ptr(), rows.shape[0], n, k,
                                  packed.group, torch.get_num_threads())
        self._check_quantized_product(code, "packed product", 64 * k, k, packed.group)
        return out.view(*x.shape[:-1], n)

    def _quantized_gemm_packed_f32(self, packed: PackedCodes, x: torch.Tensor, bias: torch.Tensor | None
                                   ) -> torch.Tensor:
        """`quantized_gemm_packed` for fp32 rows `x`."""
        n, k = packed.shape
        if not packed.channel_form or not self.packed_codes_f32_available:
            raise ValueError(f"fp32 rows take codes packed in the channel form on builds with AVX2 and FMA "
                             f"(this build: {self.isa}, codes {packed.fmt}): pack them with "
                             "pack_codes(weight, torch.float32)")
        if x.shape[-1] != k or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,))):
            raise ValueError(f"the packed product takes fp32 rows of {k} inputs and an fp32 bias of {n}, got x of "
                             f"shape {tuple(x.shape)}" + ("" if bias is None else f" and a {bias.dtype} bias of "
                                                          f"shape {tuple(bias.shape)}"))
        rows = x.reshape(-1, k).contiguous()
        bias = None if bias is None else bias.contiguous()
        out = torch.empty(rows.shape[0], n, dtype=torch.float32)
        code = self._qgemm_packed_f32(packed_format(packed), packed.codes.data_ptr(), packed.scales.data_ptr(),
                                      None if packed.mins is None else packed.mins.data_ptr(), rows.data_ptr(),
                                      None if bias is None else bias.data_ptr(), out.data_ptr(), rows.shape[0], n, k,
                                      packed.group, torch.get_num_threads())
        self._check_quantized_product(code, "fp32 packed product", 64 * k, k, packed.group)
        return out.view(*x.shape[:-1], n)

    def _check_quantized_product(self, code: int, what: str, scratch: int, k: int, group: int) -> None:
        """A quantized bf16 product's return code as one clear error: -1 its `scratch` bytes not allocated, other
        non-zero codes a build without the pair instruction or a shape it cannot take."""
        if code == -1:
            raise MemoryError(f"the native quantized {what} could not allocate {scratch} bytes")
        if code:
            raise ValueError(f"the native quantized {what} needs AVX512-BF16 (this build: {self.isa}) and k a multiple "
                             f"of 32 in groups of whole runs (k={k}, group={group})")

    def takes(self, weight: QuantizedWeight) -> bool:
        """Whether `quantized_gemv` and `dequantize` take this quantized weight: contiguous CPU tensors whose
        scales are float16, float32 or factored."""
        return (weight.device.type == "cpu" and weight.scales.dtype in SCALE_CODES
                and (not weight.factored or weight.shape[1] % 256 == 0)
                and all(t.is_contiguous() for t in weight.tensors()))

    def _product_operands(self, x: torch.Tensor, bias: torch.Tensor | None, n: int
                          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """x as the quantized products read it (contiguous, a dtype the kernels take, else fp32), the bias in its
        dtype, and the output `[..., n]`."""
        xs = x if x.is_contiguous() and x.dtype in self.dtypes else x.contiguous().float()
        if bias is not None and (bias.dtype != xs.dtype or not bias.is_contiguous()):
            bias = bias.to(xs.dtype).contiguous()
        return xs, bias, torch.empty(*x.shape[:-1], n, dtype=xs.dtype)

    def quantized_gemv(self, weight: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """`x @ W.T (+ bias)` for the rows of `x` `[..., k]` and the quantized `weight` (infer/quant_weights.py), in
        x's dtype (fp32 sums rounded once); the codes are read once per four rows of x and never dequantized to
        memory. The caller has checked `takes(weight)`."""
        # A decode step makes ~120 of these calls: the weight's arguments are formed once (kernel_args).
        fmt, codes, sdtype, scales, mins, n, k, group = weight.kernel_args
        if x.shape[-1] != k:
            raise ValueError(f"the quantized weight takes rows of {k} inputs, got x of shape {tuple(x.shape)}")
        xs, bias, out = self._product_operands(x, bias, n)
        fmt_code = QFORMATS[fmt] | (MINS_EIGHT_SCALES if weight.mins_are_eight_scales else 0)
        code = self._qgemv(fmt_code, codes, SCALE_CODES[sdtype], scales, mins, DTYPE_CODES[xs.dtype],
                           xs.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), xs.numel() // k,
                           n, k, group, torch.get_num_threads())
        if code == -1:
            raise MemoryError(f"the native quantized GEMV could not allocate its buffers ({4 * xs.numel()} bytes "
                              f"to widen x, its threads' shares)")
        if code:
            raise ValueError(f"the native quantized GEMV takes k a multiple of 32 and groups of whole runs of 32 "
                             f"(or, int8 codes, of 16) dividing it (k={k}, group={group})")
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def quantized_gemv_a8(self, weight: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None = None
                          ) -> torch.Tensor:
        """`x @ W.T (+ bias)` for one row `x` of `k` inputs with x quantized to int8 per run of 32 (lossy, opt-in:
        `Transformer.quantize_activations`): the codes multiplied as integers, llama.cpp's Q8_0 activations;
        `infer.quant_weights.int8_activation_product` is the formula. q8 and q4 codes in groups of whole runs."""
        fmt, codes, sdtype, scales, mins, n, k, group = weight.kernel_args
        if x.numel() != k:
            raise ValueError(f"int8 activations take one row of {k} inputs, got x of shape {tuple(x.shape)}")
        xs, bias, out = self._product_operands(x, bias, n)
        code = self._qgemv_a8(QFORMATS["q8" if fmt == "q6" else fmt], codes, SCALE_CODES[sdtype], scales, mins,
                              DTYPE_CODES[xs.dtype], xs.data_ptr(), None if bias is None else bias.data_ptr(),
                              out.data_ptr(), n, k, group, torch.get_num_threads())
        if code == -1:
            raise MemoryError(f"int8 activations could not allocate the buffers of a row of {k} inputs")
        if code:
            raise ValueError(f"int8 activations take q8 or q4 codes in groups of whole runs of 32 dividing k "
                             f"(k={k}, group={group}, scheme {weight.scheme})")
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def dequantize(self, weight: QuantizedWeight, dtype: torch.dtype, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """The dense weight in `dtype` (a dtype in `dtypes`), bit for bit `weight.dequantize(dtype)`; written into
        `out` (contiguous `[n, k]` of `dtype`) where one is given."""
        n, k = weight.shape
        if out is None:
            out = torch.empty(n, k, dtype=dtype)
        elif out.shape != (n, k) or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous [{n}, {k}] {dtype} tensor, got {tuple(out.shape)} {out.dtype}")
        mins = weight.mins
        if self._qdequant(QFORMATS[weight.kernel_args[0]], weight.codes.data_ptr(), SCALE_CODES[weight.scales.dtype],
                          weight.scales.data_ptr(), None if mins is None else mins.data_ptr(), DTYPE_CODES[dtype],
                          out.data_ptr(), n, k, weight.group, torch.get_num_threads()):
            raise ValueError(f"the native dequantizer takes k a multiple of 32 and groups of whole runs of 32 (or, "
                             f"int8 codes, of 16) dividing it (k={k}, group={weight.group})")
        return out

    # The small ops of a one-token step (see cpu_decode.c): each the PyTorch formula of infer/models/transformer.py
    # in one call. Inputs are contiguous CPU tensors of a dtype in `dtypes`; outputs are new tensors.

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
        """RMSNorm over the last dim of `x` (every row), `weight` of that size."""
        x, weight = _dense(x), _dense(weight.to(x.dtype))
        out = torch.empty_like(x)
        d = x.shape[-1]
        self._rms_norm(DTYPE_CODES[x.dtype], x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // d, d,
                       eps, int(gemma), torch.get_num_threads())
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Every row of the last dim of `x` rotated by one position's `cos`, `sin` (of that size)."""
        x, cos, sin = _dense(x), _dense(cos.to(x.dtype)), _dense(sin.to(x.dtype))
        out = torch.empty_like(x)
        d = x.shape[-1]
        self._rope(DTYPE_CODES[x.dtype], x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                   x.numel() // d, d)
        return out

    def rope_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`rope` of a step's tokens, each by its own position: `x` `[1, H, T, D]` (any view whose last dim is
        dense, as the engine's q and k are) by `cos`, `sin` `[T, D]`; `[1, H, T, D]`, a view of `[T, H, D]` memory
        (the layout the step's next product reads)."""
        _, heads, tokens, d = x.shape
        if x.stride(3) != 1:
            x = x.contiguous()
        cos, sin = _dense(cos.to(x.dtype)), _dense(sin.to(x.dtype))
        out = torch.empty(tokens, heads, d, dtype=x.dtype, device=x.device)
        self._rope_rows(DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(2), x.stride(1), cos.data_ptr(), sin.data_ptr(),
                        out.data_ptr(), tokens, heads, d, torch.get_num_threads())
        return out.transpose(0, 1)[None]

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                 slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, fresh: torch.Tensor) -> None:
        """The engine's `_write_blocks` in one call: blocks `fresh` zeroed, then token n's K/V (`k`, `v` `[1, Hkv, N,
        D]`, any views with a dense last dim, in the blocks' dtype) into `[slot_blocks[n], :, slot_offsets[n]]` of
        the blocks `[num_blocks, Hkv, bs, D]` (dense). The indices are the engine's own, in range."""
        _, kv_heads, tokens, d = k.shape
        if k.stride(3) != 1:
            k = k.contiguous()
        if v.stride(3) != 1:
            v = v.contiguous()
        slot_blocks, slot_offsets, fresh = (_dense(t.to(torch.int64)) for t in (slot_blocks, slot_offsets, fresh))
        self._write_kv(k.data_ptr(), k.stride(2), k.stride(1), v.data_ptr(), v.stride(2), v.stride(1),
                       k_blocks.data_ptr(), v_blocks.data_ptr(), slot_blocks.data_ptr(), slot_offsets.data_ptr(),
                       tokens, fresh.data_ptr(), fresh.numel(), kv_heads, k_blocks.shape[2], d, k.element_size())

    def gated(self, gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
        """act(gate) * up for `gate_up` = [gate | up] along its last dim (one row): SiLU, or tanh-GELU."""
        gate_up = _dense(gate_up)
        n = gate_up.shape[-1] // 2
        out = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype)
        self._gated(DTYPE_CODES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(), n, int(gelu))
        return out

    def gated_rows(self, gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
        """act(gate) * up, row by row, for `gate` and `up` `[..., n]` of one dtype whose rows each lie contiguous
        (the halves of a fused [gate | up] product taken in place), split over PyTorch's threads: SiLU, or
        tanh-GELU, each row as `gated` computes it."""
        n = gate.shape[-1]
        gate, up = (t if t.stride(-1) == 1 else t.contiguous() for t in (gate, up))
        g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)  # views where the rows are evenly spaced, else copies
        out = torch.empty(*gate.shape[:-1], n, dtype=gate.dtype)
        self._gated_rows(DTYPE_CODES[gate.dtype], g2.data_ptr(), g2.stride(0), u2.data_ptr(), u2.stride(0),
                         out.data_ptr(), g2.shape[0], n, int(gelu), torch.get_num_threads())
        return out

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """`x.float().argmax(-1)` of fp32 or bf16 rows `[rows, n]` (each row contiguous): the first of equal
        maxima, a row's first NaN where it has one; int64 `[rows]`, split over PyTorch's threads."""
        if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16) or x.shape[1] == 0:
            raise ValueError(f"argmax_rows takes fp32 or bf16 rows [rows, n >= 1], got {x.dtype} {tuple(x.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._argmax_rows(DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(),
                          torch.get_num_threads())
        return out

    def top_p_rows(self, x: torch.Tensor, ascending: torch.Tensor, probs: torch.Tensor, top_p: float) -> torch.Tensor:
        """`x` (fp32 rows `[rows, n]`) with HF's top-p removed tokens at -inf, given each row's values sorted
        `ascending` and their softmax `probs` (both `[rows, n]` fp32): the first m tokens of a stable ascending
        sort go, m being the positions whose cumulative probability is at most 1 - top_p, never the last. A new
        tensor; rows split over PyTorch's threads."""
        if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] == 0:
            raise ValueError(f"top_p_rows takes fp32 rows [rows, n >= 1], got {x.dtype} {tuple(x.shape)}")
        if ascending.shape != x.shape or probs.shape != x.shape or ascending.dtype != torch.float32 or (
                probs.dtype != torch.float32):
            raise ValueError(f"top_p_rows takes sorted values and probabilities shaped as x {tuple(x.shape)}, fp32")
        x = x if x.stride(1) == 1 else x.contiguous()
        ascending, probs = ascending.contiguous(), probs.contiguous()
        out = torch.empty(x.shape, dtype=torch.float32)
        self._top_p_rows(x.data_ptr(), x.stride(0), ascending.data_ptr(), probs.data_ptr(), ascending.stride(0),
                         out.data_ptr(), x.shape[0], x.shape[1], float(top_p), torch.get_num_threads())
        return out

    def draw_rows(self, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """A token a row of fp32 probabilities `[rows, n]` (each row contiguous): the first whose cumulative
        probability (double sums) exceeds `u` (float64 `[rows]`) times the row's total; -1 for a row whose total is
        NaN or inf. int64 `[rows]`, rows split over PyTorch's threads."""
        if probs.dim() != 2 or probs.dtype != torch.float32 or probs.shape[1] == 0:
            raise ValueError(f"draw_rows takes fp32 rows [rows, n >= 1], got {probs.dtype} {tuple(probs.shape)}")
        if u.shape != probs.shape[:1]:
            raise ValueError(f"draw_rows takes one uniform a row: u {tuple(u.shape)} for {probs.shape[0]} rows")
        probs = probs if probs.stride(1) == 1 else probs.contiguous()
        u = u.to(torch.float64).contiguous()
        out = torch.empty(probs.shape[0], dtype=torch.int64)
        self._draw_rows(probs.data_ptr(), probs.stride(0), probs.shape[0], probs.shape[1], u.data_ptr(),
                        out.data_ptr(), torch.get_num_threads())
        return out

    def quantized_attention(self, q: torch.Tensor, sinks: tuple[torch.Tensor, torch.Tensor], num_sinks: int,
                            codes: tuple[torch.Tensor, torch.Tensor], scales: tuple[torch.Tensor, torch.Tensor],
                            num_quantized: int, block: int, scheme: str, channel_keys: bool,
                            recent: tuple[torch.Tensor, torch.Tensor], num_recent: int, scale: float,
                            softcap: float | None, window: int | None, key_offsets: torch.Tensor | None = None,
                            value_rotation: torch.Tensor | None = None, value_quantized: int | None = None
                            ) -> torch.Tensor:
        """One query row per head `q` `[B, H, D]` attending over one layer of the quantized cache's layout
        (infer/cache/quantized.py): `num_sinks` exact tokens of `sinks` `[B, Hkv, S0, D]`, `num_quantized` tokens of
        `codes` `[B, Hkv, Sq, D or D/2]` with bf16 `scales` (keys `[B, Hkv, Sq / block, D]` by channel or
        `[B, Hkv, Sq]` by row; values `[B, Hkv, Sq]`) and, keys by channel, bf16 `key_offsets` shaped as their
        scales (or None), value rows stored rotated by `value_rotation` `[D, D]` (symmetric; or None), then
        `num_recent` exact tokens of the ring `recent` `[B, Hkv, R, D]`. Values may age on their own count:
        `value_quantized` (default `num_quantized`) of them are codes, the rest exact in `recent[1]` (its own ring
        length). `[B, H, D]` in q's dtype; no dequantized copy of the cache is made."""
        scheme_code = QSCHEMES[scheme]
        q = _dense(q.to(sinks[0].dtype))
        parts = [_dense(t) for t in (*sinks, *codes, *scales, *recent)]
        k_sink, v_sink, k_codes, v_codes, k_scale, v_scale, k_recent, v_recent = parts
        B, H, D = q.shape
        if key_offsets is not None and (not channel_keys or key_offsets.shape != k_scale.shape):
            raise ValueError(f"key_offsets {tuple(key_offsets.shape)} must match channel key scales "
                             f"{tuple(k_scale.shape)}")
        if value_rotation is not None and tuple(value_rotation.shape) != (D, D):
            raise ValueError(f"value_rotation must be [{D}, {D}], got {tuple(value_rotation.shape)}")
        offsets = None if key_offsets is None else _dense(key_offsets.to(torch.bfloat16))
        rotation = None if value_rotation is None else _dense(value_rotation.float())
        out = torch.empty_like(q)
        if self._qattn(DTYPE_CODES[q.dtype], scheme_code, int(channel_keys), q.data_ptr(), k_sink.data_ptr(),
                       v_sink.data_ptr(), k_codes.data_ptr(), v_codes.data_ptr(), k_scale.data_ptr(),
                       v_scale.data_ptr(), None if offsets is None else offsets.data_ptr(),
                       None if rotation is None else rotation.data_ptr(), k_recent.data_ptr(), v_recent.data_ptr(),
                       out.data_ptr(), B, H,
                       k_codes.shape[1], D, num_sinks, k_sink.shape[2], num_quantized, k_codes.shape[2], block,
                       k_scale.shape[2], num_recent, max(k_recent.shape[2], 1),
                       num_quantized if value_quantized is None else value_quantized, v_codes.shape[2],
                       max(v_recent.shape[2], 1), scale, softcap or 0.0, window or 0,
                       torch.get_num_threads()):
            raise MemoryError("the native quantized attention could not allocate its score buffers")
        return out

    def quantized_attention_paged(self, q: torch.Tensor, codes: tuple[torch.Tensor, torch.Tensor],
                                  scales: tuple[torch.Tensor, torch.Tensor], key_offsets: torch.Tensor | None,
                                  value_rotation: torch.Tensor | None, stage: tuple[torch.Tensor, torch.Tensor],
                                  tables: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor, scheme: str,
                                  scale: float, softcap: float | None, window: int | None) -> torch.Tensor:
        """One query row per head `q` `[B, H, D]` of B sequences attending over one layer of the engine's quantized
        pool (infer/cache/paged_quantized.py) through block tables `[B, nb]`: a full block's `codes`
        `[N, Hkv, bs, D or D/2]`, `scales` (keys `[N, Hkv, D]` per channel, values `[N, Hkv, bs]` per row), the keys'
        `key_offsets` `[N, Hkv, D]` or None, value rows stored rotated by `value_rotation` `[D, D]` or None; a table
        entry `N + s` names staging slot s of `stage` `[P, Hkv, bs, D]` (exact). Sequence b's keys are positions
        `starts[b]` .. `lengths[b] - 1`. `[B, H, D]` in the staging dtype."""
        scheme_code = QSCHEMES[scheme]
        k_stage, v_stage = (_dense(t) for t in stage)
        q = _dense(q.to(k_stage.dtype))
        k_codes, v_codes, k_scale, v_scale = (_dense(t) for t in (*codes, *scales))
        offsets = None if key_offsets is None else _dense(key_offsets)
        rotation = None if value_rotation is None else _dense(value_rotation.float())
        tables, lengths, starts = (_dense(t.to(torch.int64)) for t in (tables, lengths, starts))
        B, H, D = q.shape
        out = torch.empty_like(q)
        if self._qattn_paged(DTYPE_CODES[q.dtype], scheme_code, q.data_ptr(), k_codes.data_ptr(), v_codes.data_ptr(),
                             k_scale.data_ptr(), v_scale.data_ptr(), None if offsets is None else offsets.data_ptr(),
                             None if rotation is None else rotation.data_ptr(), k_stage.data_ptr(),
                             v_stage.data_ptr(), tables.data_ptr(), lengths.data_ptr(), starts.data_ptr(),
                             out.data_ptr(), B, H, k_codes.shape[1], D, k_codes.shape[2], tables.shape[1],
                             k_codes.shape[0], scale, softcap or 0.0, window or 0, torch.get_num_threads()):
            raise MemoryError("the native paged quantized attention could not allocate its score buffers")
        return out

    def quantize_blocks(self, stage: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor, blocks: torch.Tensor,
                        codes: tuple[torch.Tensor, torch.Tensor], scales: tuple[torch.Tensor, torch.Tensor],
                        key_offsets: torch.Tensor | None, value_rotation: torch.Tensor | None, scheme: str) -> None:
        """A quantized pool's filled blocks into codes in place (infer/cache/paged_quantized.py; the formulas of
        `QuantizedPoolLayer.quantize_filled`'s torch code, bit for bit but the rotated values' sums): block
        `blocks[f]` of one layer's `codes` `[N, Hkv, bs, D or D/2]`, `scales` (keys `[N, Hkv, D]`, values
        `[N, Hkv, bs]`) and `key_offsets` `[N, Hkv, D]` (or None) from row `rows[f]` of `stage` `[*, Hkv, bs, D]`;
        values rotated by `value_rotation` `[D, D]` fp32 or None."""
        k_stage, v_stage = stage
        outputs = (*codes, *scales) + (() if key_offsets is None else (key_offsets,))
        if not all(t.is_contiguous() for t in (k_stage, v_stage, *outputs)):
            raise ValueError("quantize_blocks writes the pool's codes in place: they and the staging must be "
                             "contiguous")
        rows, blocks = (_dense(t.to(torch.int64)) for t in (rows, blocks))
        rotation = None if value_rotation is None else _dense(value_rotation.float())
        _, kv_heads, bs, d = k_stage.shape
        code = self._quantize_blocks(DTYPE_CODES[k_stage.dtype], QSCHEMES[scheme], k_stage.data_ptr(),
                                     v_stage.data_ptr(), rows.data_ptr(), blocks.data_ptr(), rows.numel(),
                                     codes[0].data_ptr(), codes[1].data_ptr(), scales[0].data_ptr(),
                                     scales[1].data_ptr(), None if key_offsets is None else key_offsets.data_ptr(),
                                     None if rotation is None else rotation.data_ptr(), kv_heads, bs, d,
                                     torch.get_num_threads())
        if code == -1:
            raise MemoryError("the native block quantizer could not allocate its scratch rows")
        if code:
            raise ValueError(f"the {scheme} scheme packs two values per byte and needs an even head_dim, got {d}")

    def exact_paged_attention(self, q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                              tables: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor, scale: float,
                              softcap: float | None, window: int | None) -> torch.Tensor:
        """`quantized_attention_paged` over an exact pool `[N, Hkv, bs, D]`: every block read as a staged one (no
        codes). `[B, H, D]` in the blocks' dtype."""
        k_blocks, v_blocks = _dense(k_blocks), _dense(v_blocks)
        q = _dense(q.to(k_blocks.dtype))
        tables, lengths, starts = (_dense(t.to(torch.int64)) for t in (tables, lengths, starts))
        B, H, D = q.shape
        out = torch.empty_like(q)
        if self._qattn_paged(DTYPE_CODES[q.dtype], 0, q.data_ptr(), None, None, None, None, None, None,
                             k_blocks.data_ptr(), v_blocks.data_ptr(), tables.data_ptr(), lengths.data_ptr(),
                             starts.data_ptr(), out.data_ptr(), B, H, k_blocks.shape[1], D, k_blocks.shape[2],
                             tables.shape[1], 0, scale, softcap or 0.0, window or 0, torch.get_num_threads()):
            raise MemoryError("the native paged attention could not allocate its score buffers")
        return out

    def decode_step(self, layers: ctypes.Array[StepLayer], shape: tuple[int, int, int, int, int], eps: float,
                    gemma: bool, gelu: bool, x: torch.Tensor, position: int, cos: ctypes.Array[ctypes.c_void_p],
                    sin: ctypes.Array[ctypes.c_void_p], quantized: tuple[int, int] = (0, 0)) -> None:
        """Every decoder layer of a one-token step of one sequence in one call (cpu_decode.c's infer_decode_step):
        `x` (contiguous, `hidden` values) becomes the last layer's output and each layer's cache rows get this
        position's K/V. `shape`: heads, KV heads, head size, hidden size, MLP size; `cos`, `sin`: pointers to
        each rope table's row; `quantized`: the positions a quantized cache's layers hold as key and as value codes
        in this step.
        All or nothing: on an error x and the caches are as they were."""
        heads, kv_heads, d, hidden, inter = shape
        code = self._decode_step(DTYPE_CODES[x.dtype], layers, len(layers), heads, kv_heads, d, hidden, inter, eps,
                                 int(gemma), int(gelu), x.data_ptr(), position, *quantized, cos, sin,
                                 torch.get_num_threads())
        if code == -1:
            raise MemoryError("the native decode step could not allocate its scratch buffers")
        if code:
            raise ValueError("the native decode step was handed a product whose shape it cannot take")

    def batch_step(self, layers: ctypes.Array[BatchLayer], shape: tuple[int, int, int, int, int], eps: float,
                   x: torch.Tensor, block_size: int, quantize_filled: Callable[[int], None] | None = None,
                   gemma: bool = False, gelu: bool = False, ends: BatchEnds | None = None) -> None:
        """Every decoder layer of a batched engine step in one call (cpu_decode.c's infer_batch_step): `x` (contiguous
        `[rows, hidden]`, the model's dtype: bf16 or fp32, as every tensor the layers point at) becomes the last
        layer's output; each layer's pool gets the rows' K/V at the slots of its batch (`BatchLayer.batch`; a quantized
        pool's layers: their own staging rows) and every row attends over its table there. `shape`: heads, KV heads,
        head size, hidden size, MLP size; `gemma`, `gelu`: Gemma's norms and activation. `quantize_filled(layer)`:
        called after a quantized pool's layer staged its rows (an exception there stops the call and is raised).
        `ends`: the embedding (x then written, not read), the RoPE tables read at the rows' positions and the final
        norm, in the call (`BatchEnds`)."""
        heads, kv_heads, d, hidden, inter = shape
        rows = x.numel() // hidden
        if x.dtype not in (torch.bfloat16, torch.float32) or not x.is_contiguous():
            raise ValueError(f"the native batched step takes contiguous bf16 or fp32 rows, got {x.dtype}")
        failed: list[BaseException] = []

        def call_back(layer: int) -> int:
            try:
                quantize_filled(layer)  # type: ignore[misc]
            except BaseException as error:  # (ctypes would print it and go on)
                failed.append(error)
                return 1
            return 0

        callback = QUANTIZE_FILLED() if quantize_filled is None else QUANTIZE_FILLED(call_back)  # (): NULL
        code = self._batch_step(DTYPE_CODES[x.dtype], layers, len(layers), x.data_ptr(), rows, heads, kv_heads, d,
                                hidden, inter, eps, int(gemma), int(gelu), block_size, torch.get_num_threads(),
                                callback, None if ends is None else ctypes.byref(ends))
        if failed:
            raise failed[0]
        if code == -5:
            raise ValueError("the native batched step was handed a token id past the vocabulary or a position past its "
                             "RoPE tables")
        if code == -1:
            raise MemoryError("the native batched step could not allocate its scratch buffers")
        if code == -2:
            raise ValueError(f"the native batched step was handed packed codes this build cannot multiply (this build: "
                             f"{self.isa}; fp32 rows take codes in AVX2's channel form) or a product whose shape it "
                             "cannot take")
        if code:
            raise ValueError(f"the native batched step needs a build with AVX512-BF16 or AVX2 (this build: {self.isa})"
                             " and even sizes")

    def read(self, buffer: torch.Tensor) -> float:
        """Read every byte of the contiguous CPU tensor `buffer` once, as `gemv` reads weights (returns their
        float sum, so the read cannot be skipped)."""
        return float(self._read(buffer.data_ptr(), buffer.numel() * buffer.element_size(),
                                torch.get_num_threads()))


def _bf16_operands(x: torch.Tensor, k: int, n: int, bias: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The few-row products' operands: x as contiguous bf16 rows `[m, k]`, the bias likewise, and the output
    `[m, n]`."""
    rows = x.reshape(-1, k)
    if rows.dtype != torch.bfloat16 or not rows.is_contiguous():
        rows = rows.to(torch.bfloat16).contiguous()
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        bias = bias.to(torch.bfloat16).contiguous()
    return rows, bias, torch.empty(rows.shape[0], n, dtype=torch.bfloat16)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """`t` if its elements lie row-major without gaps (what the kernels index), else a contiguous copy."""
    return t if t.is_contiguous() else t.contiguous()


def native_gemv(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`NativeKernels.gemv` of this machine's native build, for a weight it `supports` (Linear's decode path,
    set by Transformer.decode_gemv only where the build loaded)."""
    kernels = native_kernels()
    if kernels is None:
        raise RuntimeError(f"the native GEMV is unavailable: {unavailable_reason()}")
    return kernels.gemv(weight, x, bias)


def cache_dir() -> Path:
    """Where builds are kept: $INFER_KERNEL_DIR, else ~/.cache/infer/kernels."""
    return Path(os.environ.get("INFER_KERNEL_DIR") or Path.home() / ".cache" / "infer" / "kernels")


@functools.cache
def native_kernels(flavour: str = "native") -> NativeKernels | None:
    """The build of cpu_decode.c for `flavour` (once per process; on disk once per machine), or None where it
    cannot be built or loaded here (`unavailable_reason(flavour)` says why)."""
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {sorted(FLAVOURS)}, got {flavour!r}")
    if os.environ.get("INFER_NATIVE", "1") == "0":
        _reasons[flavour] = "turned off by INFER_NATIVE=0"
        return None
    named = os.environ.get("CC")
    compiler = c_compiler()
    if compiler is None:
        _reasons[flavour] = f"CC={named} not found" if named else "no C compiler on PATH (cc, gcc or clang; or set CC)"
        return None
    is_x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
    if flavour != "native" and not is_x86:
        _reasons[flavour] = f"the {flavour} flavour is x86-only"
        return None
    attempts = [("-march=native", "-fopenmp"), ("-fopenmp",), ("-march=native",), ()]
    errors = []
    for extra in attempts:
        flags = (*BUILD_FLAGS, *extra, *FLAVOURS[flavour])
        try:
            path = _build(compiler, flags)
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else type(exc).__name__)
            continue
        try:
            return NativeKernels(path, openmp="-fopenmp" in flags)
        except OSError as exc:
            errors.append(f"built but could not load: {exc}")
    _reasons[flavour] = f"{compiler} could not build {SOURCE.name}: {errors[-1] if errors else 'unknown error'}"
    return None


def c_compiler() -> str | None:
    """The C compiler the builds use: $CC where it names one on PATH, else cc, gcc or clang; None where none is."""
    named = os.environ.get("CC")
    return shutil.which(named) if named else shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def unavailable_reason(flavour: str = "native") -> str | None:
    """Why `native_kernels(flavour)` is None (None when it loaded)."""
    return None if native_kernels(flavour) is not None else _reasons.get(flavour, "unknown")


def _build(compiler: str, flags: tuple[str, ...]) -> Path:
    """The shared library for these flags, compiled unless an identical build is cached; built under a
    temporary name and renamed, so concurrent processes (xdist workers) never load half a file."""
    key = hashlib.sha256("\n".join([SOURCE.read_text(), compiler, _compiler_version(compiler), " ".join(flags),
                                    _cpu_signature()])
                         .encode()).hexdigest()[:16]
    directory = cache_dir()
    target = directory / f"gemv-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, text=True,
                       timeout=120)
        os.replace(tmp, target)
    except subprocess.CalledProcessError as exc:
        raise subprocess.SubprocessError(exc.stderr or f"exit {exc.returncode}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def _compiler_version(compiler: str) -> str:
    """`compiler --version`, asked once per process (every flavour and fallback build keys on it)."""
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout


def _cpu_signature() -> str:
    """The CPU model and flags: a build for -march=native is only valid on the CPU it was made for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(sorted(set(keep)))
