"""The decoder-only transformer for Llama 3, Qwen 2/2.5, Qwen 3 and Gemma 3 (text), read top to bottom.

The families differ in a handful of places, each a trait of the family table (infer/families.py) that the
layers read, never a `model_type` check: QK-norm (Qwen 3, Gemma 3), q/k/v biases (Qwen 2), Gemma's
`(1 + weight)` RMSNorm, four norms per block, embedding scale and query scale; the config carries the rest
(activation, softcaps, sliding layers and their RoPE base).

One forward serves every caller: where K/V are stored and read is the attention backend it is handed
(infer/backends.py: a KVCache for one request, the engine's paged pool, static slots for graph capture).
Module names are Hugging Face's, so checkpoint keys load without renaming.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from infer.attention import sdpa_backends
from infer.backends import AttentionBackend, CacheBackend, PagedBackend, StaticBackend, StepKernels
from infer.cache.base import KVCache
from infer.cache.paged_quantized import QuantizedPoolLayer, StepPlan
from infer.config import SLIDING_ATTENTION, ModelConfig, RopeConfig
from infer.families import FAMILIES
from infer.kernels import triton_available
from infer.kernels.native import NativeKernels, codes_shape_taken, native_gemv, native_kernels, unavailable_reason
from infer.memory import empty_on_huge_pages, on_huge_pages, release_freed_memory
from infer.models.native_batch_step import NativeBatchStep, batch_step_unavailable, describe_batch
from infer.models.native_step import NativeStep, codes_cache, takes_model
from infer.quant_weights import PackedCodes, QuantizedWeight, concat_rows, int8_activation_product
from infer.rope import apply_rope, inverse_frequencies, rope_cos_sin
from infer.tensor_parallel import Shards

# Kernels of one-row (decode) products; "linear" is the unoptimised form, the others are chosen by measurement.
GEMV_FORMS = ("linear", "mv", "native", "triton")
# Layouts of the engine's packed copies (Transformer.pack_products): oneDNN's GEMM, or the native packed product.
PACKED_LAYOUTS = ("onednn", "native")
_FEW_ROW_PRODUCTS: ContextVar[bool] = ContextVar("few_row_products", default=False)


@contextlib.contextmanager
def few_row_products() -> Iterator[None]:
    """Inside, bf16 products of 2 to `Transformer.gemm_rows` rows take the native few-row kernel: the batched
    engine's steps, held to their solo runs within rounding. Outside, a multi-row product stays `F.linear`'s, bit
    for bit the bf16 logits Hugging Face computes (the single-request paths' oracle)."""
    token = _FEW_ROW_PRODUCTS.set(True)
    try:
        yield
    finally:
        _FEW_ROW_PRODUCTS.reset(token)


class ProjectionTraits:
    """What Linear and QuantizedLinear share: the prefill dtype, the decode kernel and the fused-product rule."""

    in_features: int
    upcast: torch.dtype | None = None
    gemv: str = "linear"  # "linear" | "mv" | "native" | "triton": the kernel of a one-row product
    # A fused Linear (fuse_linears) computes its parts' products: all of them, or only one-row native ones.
    all_rows: bool = True
    # A copy of the weight packed for the engine's steps (Transformer.pack_products), or None: in oneDNN's blocked
    # layout (`pack_weight`) or in the native packed product's (`packed_layout` "native", NativeKernels.pack: bf16 or
    # fp32; a quantized weight's codes: `pack_codes`); the rows of input past which the engine's steps take it (up to
    # them, the native few-row kernel), and up to which (None: every count; past them the unpacked form, where the
    # choice measured the packed product slower: infer.tuning.choose_packed_products).
    packed: torch.Tensor | PackedCodes | None = None
    packed_layout = "onednn"
    packed_from = 1
    packed_upto: int | None = None

    def takes_packed(self, rows: int) -> bool:
        """Whether a product of `rows` rows of input is in the packed copy's range (`packed_from`, `packed_upto`)."""
        return self.packed is not None and rows > self.packed_from and (self.packed_upto is None
                                                                         or rows <= self.packed_upto)

    def one_row(self, x: torch.Tensor) -> bool:
        """Whether `x` is one row for the decode kernel (an inference input of `in_features` values)."""
        return x.numel() == self.in_features and not x.requires_grad

    def fuses(self, x: torch.Tensor) -> bool:
        """For a fused Linear: whether it computes `x` rather than its parts. Fused for every product
        (`all_rows`, not bit-exact: a GEMM over more rows may block its sums differently), or only where the
        native kernel takes one row: there every output is its own row's sum, so fusing changes no bit."""
        if self.all_rows or (self.gemv == "native" and self.one_row(x)):
            return True
        # Packed for the engine's steps: one product of every row count there (exact for the native few-row
        # kernel's rows, where each output is its own row's sum; within rounding past them, as the engine is);
        # packed codes everywhere (each output its own sum over the codes, as the parts' products compute it).
        return (self.packed is not None and (_FEW_ROW_PRODUCTS.get() or isinstance(self.packed, PackedCodes))
                and not self.one_row(x))


class Linear(ProjectionTraits, nn.Linear):
    """nn.Linear with an optional wider dtype for multi-token matmuls (`upcast`) and a choice of kernel for
    the one-row decode product (`gemv`).

    CPUs without bf16 matrix units run a bf16 GEMM several times slower than an fp32 one, so prefill
    can upcast; a one-token decode GEMV is bandwidth-bound and stays in the weights' dtype. For that one
    row, `F.linear` may take a GEMM kernel that streams the weights slower than `torch.mv` does (oneDNN's
    AMX path with a single row), and both stream slower than the native kernel (infer/kernels/cpu_decode.c):
    `gemv` is chosen by measurement (infer.tuning); "linear" is the unoptimised form and the check. With "native",
    inside `few_row_products()` (the batched engine's steps), bf16 inputs of 2 to `native_rows` rows take the native
    few-row product, which streams the weights once where ATen's GEMM repacks them on every call
    (infer.tuning.choose_gemm_rows).
    """

    native_rows = 1  # rows up to which "native" runs the compiled kernels: one the GEMV, more the few-row product
    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.packed is not None and x.dtype == self.weight.dtype and not x.requires_grad
                and self.takes_packed(x.numel() // self.in_features) and _FEW_ROW_PRODUCTS.get()):
            # The engine's products past the native kernel's rows: oneDNN's GEMM on the weight it packed once, where
            # F.linear packs it again on every call (as long as the product itself at a few dozen rows); or the
            # native packed product (16 outputs a register), which takes every row count from 2.
            if self.packed_layout == "native" and self.upcast in (None, torch.float32):
                # (fp32 sums of the bf16 operands rounded once: what the products upcast to fp32 compute too; an fp32
                # weight's copy: its fp32 sums)
                return native_kernels_or_raise().gemm_packed(self.packed, x, self.out_features, self.bias)
            if self.packed_layout == "onednn" and self.packed.dtype == self.weight.dtype and self.upcast is None:
                return packed_linear(x, self.packed, self.bias)
            if self.packed_layout == "onednn" and self.packed.dtype == self.upcast:
                # Packed in the dtype the products upcast to (a CPU without bf16 units): the upcast product below
                # without widening and repacking the whole weight on every call (at 48 rows that was most of it).
                bias = None if self.bias is None else self.bias.to(self.upcast)
                return packed_linear(x.to(self.upcast), self.packed, bias).to(x.dtype)
        if (self.gemv == "native" and self.native_rows > 1 and x.dtype == torch.bfloat16 == self.weight.dtype
                and not x.requires_grad and self.in_features < x.numel() <= self.native_rows * self.in_features
                and _FEW_ROW_PRODUCTS.get()):
            return native_kernels_or_raise().gemm_bf16(self.weight, x, self.bias)
        if self.gemv != "linear" and self.one_row(x):
            # One row: the matrix-vector product itself, without the GEMM machinery.
            if self.gemv == "native":
                out = native_gemv(self.weight, x, self.bias)
            elif self.gemv == "triton":
                from infer.kernels.gemv import triton_gemv  # imported where Triton is (decode_gemv's setter)

                out = triton_gemv(self.weight, x.reshape(-1))
                out = out if self.bias is None else out + self.bias
            else:
                out = torch.mv(self.weight, x.reshape(-1))
                out = out if self.bias is None else out + self.bias
            return out.view(*x.shape[:-1], self.out_features)
        if self.upcast is None or x.shape[-2] == 1 or x.dtype == self.upcast:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.to(self.upcast)
        return F.linear(x.to(self.upcast), self.weight.to(self.upcast), bias).to(x.dtype)


def _not_bf16_on_the_cpu(weights: list[torch.Tensor]) -> str | None:
    """What oneDNN's packed layout first needs of the weights: some, bf16, on the CPU (None: they are)."""
    if not weights:
        return "no dense projections"
    if any(w.device.type != "cpu" for w in weights):
        return "the weights are not on the CPU"
    if any(w.dtype != torch.bfloat16 for w in weights):
        return "the weights are not bf16"
    return None


def packing_unavailable(weights: list[torch.Tensor], upcast: torch.dtype | None = None) -> str | None:
    """Why oneDNN cannot pack these weights for `Linear.packed` (None: it can): bf16 on the CPU, a PyTorch built
    with oneDNN, and a CPU its bf16 kernels run on (not emulated); or, where the products upcast (`upcast`, the
    model's compute dtype: float32 on a CPU without bf16 units), packed in float32, which oneDNN runs everywhere."""
    if (why := _not_bf16_on_the_cpu(weights)) is not None:
        return why
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch has no oneDNN"
    if not all(hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise")):
        return "this PyTorch lacks oneDNN's packed linear ops"
    if upcast is not None and upcast != torch.float32:
        return f"the products upcast to {upcast}, and oneDNN's packed copies are bf16 or float32"
    if upcast is None and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN has no bf16 kernels for this CPU"
    return None


def native_packing_unavailable(weights: list[torch.Tensor], coded: list[QuantizedLinear] | None = None,
                               dtype: torch.dtype | None = None) -> str | None:
    """Why the native packed product cannot take these weights and quantized projections (`coded`) for a model of
    `dtype` (its activations'; None: the weights', bf16 without any) (None: it can): CPU weights of that dtype, bf16
    ones of even inputs, CPU codes whose scales the native kernels take (`NativeKernels.takes`), and a native build
    with the product for them: bf16 rows on the bf16 pair instruction (AVX512-BF16) or AVX2 with FMA; fp32 rows
    (`NativeKernels.pack_f32`, and codes in the channel form) on AVX2 with FMA (AVX512 builds included)."""
    coded = coded or []
    dtype = dtype if dtype is not None else weights[0].dtype if weights else torch.bfloat16
    if not weights and not coded:
        return "no dense projections"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"the activations are {dtype}, not bf16 or float32"
    if any(w.device.type != "cpu" for w in weights) or any(m.codes.device.type != "cpu" for m in coded):
        return "the weights are not on the CPU"
    fp32 = dtype == torch.float32
    if any(w.dtype != dtype for w in weights):
        return f"the weights are not {'float32' if fp32 else 'bf16'}"
    if not fp32 and any(w.shape[1] % 2 for w in weights):
        return "a projection has an odd number of inputs"
    kernels = native_kernels()
    if kernels is None:
        return f"no native kernels: {unavailable_reason()}"
    if fp32 and ((weights and not kernels.packed_f32_available) or (coded and not kernels.packed_codes_f32_available)):
        return (f"this build ({kernels.isa}) has no AVX2 with FMA" if not kernels.packed_f32_available else
                f"this build ({kernels.isa}) has no product of fp32 rows on codes (AVX2's channel form)")
    if not fp32 and ((weights and not kernels.packed_bf16_available)
                     or (coded and not kernels.packed_codes_available)):
        return f"this build ({kernels.isa}) has neither AVX512-BF16 nor AVX2 with FMA"
    if not all(kernels.takes(m.qweight) for m in coded):
        return "a quantized projection's scales are not float16, float32 or factored over whole runs of 256"
    return None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` `[n, k]` in oneDNN's blocked layout, for `torch.ops.mkldnn._linear_pointwise` (what
    `torch.compile`'s CPU freezing does to linear weights); a copy, the weight is unchanged."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear of `x` by a weight `pack_weight` packed, without packing it again."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def fuse_linears(parts: list[Linear], huge_pages: bool = False) -> Linear:
    """One Linear computing all of `parts` in one product: its weight (and bias) is their rows concatenated,
    and each part's weight becomes a view into it, so memory is unchanged and the parts stay usable.
    `huge_pages`: the fused weight on transparent huge pages, as the loader places weights."""
    weights = [p.weight.detach() for p in parts]
    shape = (sum(w.shape[0] for w in weights), weights[0].shape[1])
    weight = empty_on_huge_pages(shape, weights[0].dtype) if huge_pages and weights[0].device.type == "cpu" \
        else torch.empty(shape, dtype=weights[0].dtype, device=weights[0].device)
    torch.cat(weights, out=weight)
    bias = torch.cat([p.bias.detach() for p in parts]) if parts[0].bias is not None else None
    with torch.device("meta"):
        fused = Linear(parts[0].in_features, weight.shape[0], bias=bias is not None)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    fused.upcast, fused.gemv, fused.native_rows = parts[0].upcast, parts[0].gemv, parts[0].native_rows
    start = 0
    for p in parts:
        rows = p.out_features
        p.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
        if bias is not None:
            p.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return fused


# Bytes of packed codes copied onto huge pages between trims of the C heap (`pack_products`): the copies they were
# made from stay in the process until trimmed (SmolLM2's load, fp32, packed: the peak resident set 593 -> 517-530 MiB
# with the file unmapped first and a trim every 16 MiB of copies, 0.06-0.08 s of the load; after every copy, 0.2 s).
_TRIM_EVERY = 16 * 2**20


class QuantizedLinear(ProjectionTraits, nn.Module):
    """A Linear whose weight is stored as codes and scales (infer/quant_weights.py), beside Linear: the same
    traits (`upcast`, `gemv`, `all_rows`), outputs in the activations' dtype.

    "linear", the unoptimised form and the check, dequantizes the weight (`QuantizedWeight.dequantize`) and
    calls F.linear. "native" runs the compiled kernel on the codes for up to `native_rows` rows of input (decode
    steps, the engine's batches, short chunks): codes read once, widened in registers, fp32 sums; longer inputs
    dequantize with the native dequantizer (bit-equal to the reference) into the GEMM, except that inside
    `few_row_products()` (the batched engine's steps) bf16 inputs of up to `tile_rows` rows take the native tile
    kernel (each tile of 4 weight rows dequantized to bf16 in cache: the GEMM's numbers, the weight never written
    out whole). Packed (`Transformer.pack_products(layout="native")`: `packed`, the codes in the native packed
    product's layout; by the engine, or at load for one request's products: infer.tuning.choose_one_request_packing),
    every bf16 input of 2 rows or more in the copy's range (an fp32 model's fp32 ones too, its codes in the channel
    form; of one row too where packed with `one_row`: `packed_from` 0) takes the native packed product on them (each
    block of 16 weight rows dequantized to bf16 in cache once per call, or multiplied as codes), inside the engine's
    steps or not: no oracle computes a quantized product's bits, and every form is held to the unrounded product
    within rounding. "triton" runs the Triton kernel (infer/kernels/qgemv.py) on as many rows."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    native_rows = 16  # rows up to which the native kernel beats dequantize + GEMM (infer.tuning times it)
    tile_rows = 1  # rows up to which the tile kernel runs past native_rows (Transformer.gemm_rows; 1: never)
    packed: PackedCodes | None = None
    packed_layout = "native"
    int8_activations = False  # one-row products with x quantized to int8 (Transformer.quantize_activations)

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.scheme, self.group = weight.scheme, weight.group
        self.register_buffer("codes", weight.codes)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("mins", weight.mins)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def qweight(self) -> QuantizedWeight:
        """The stored weight (this module's buffers; rebuilt when they are replaced: fusing, moving devices)."""
        cached = self.__dict__.get("_qweight")
        if (cached is None or cached.codes is not self.codes or cached.scales is not self.scales
                or cached.mins is not self.mins or cached.scheme != self.scheme):
            cached = QuantizedWeight(self.scheme, self.codes, self.scales, self.mins, self.group)
            self.__dict__["_qweight"] = cached
        return cached

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.int8_activations and rows == 1 and not x.requires_grad:  # (lossy, opt-in: x quantized per run)
            kernels = native_kernels() if self.gemv == "native" else None
            if kernels is not None and kernels.takes(self.qweight):
                return kernels.quantized_gemv_a8(self.qweight, x, self.bias)
            return int8_activation_product(self.qweight, x, self.bias)
        if (self.packed is not None and self.takes_packed(rows)
                and (x.dtype == torch.bfloat16 or x.dtype == torch.float32 and self.packed.channel_form)
                and self.upcast in (None, torch.float32) and not x.requires_grad):
            # (an fp32 model's rows: its codes packed in the channel form, its fp32 sums unrounded)
            return native_kernels_or_raise().quantized_gemm_packed(self.packed, x, self.bias)
        if self.gemv == "native" and rows <= self.native_rows and not x.requires_grad:
            return native_kernels_or_raise().quantized_gemv(self.qweight, x, self.bias)
        if (self.gemv == "native" and rows <= self.tile_rows and x.dtype == torch.bfloat16 and not x.requires_grad
                and _FEW_ROW_PRODUCTS.get()):
            return native_kernels_or_raise().quantized_gemm_bf16(self.qweight, x, self.bias)
        if self.gemv == "triton" and rows <= self.native_rows and not x.requires_grad:
            from infer.kernels.qgemv import triton_qgemm  # imported where Triton is (decode_gemv's setter)

            out = triton_qgemm(self.qweight, x)
            return out if self.bias is None else out + self.bias.to(out.dtype)
        dtype = x.dtype if self.upcast is None or rows == 1 else self.upcast
        bias = None if self.bias is None else self.bias.to(dtype)
        kernels = native_kernels() if self.gemv == "native" else None
        if kernels is not None and kernels.takes(self.qweight) and dtype in kernels.dtypes:
            return dequantized_product(kernels, x.to(dtype), self.qweight, bias).to(x.dtype)
        return F.linear(x.to(dtype), self.qweight.dequantize(dtype), bias).to(x.dtype)


# Elements of the per-thread buffer that multi-row quantized products dequantize into (64 MiB in bf16): a weight that
# fits is dequantized whole, a larger one (a vocabulary-wide head asked for every position) in slabs of rows.
DEQUANTIZE_BUFFER = 32 * 2**20
_buffers = threading.local()


def dequantized_product(kernels: NativeKernels, x: torch.Tensor, weight: QuantizedWeight,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T (+ bias)` through the GEMM on `weight` dequantized natively (bit-equal to the reference) into a
    buffer kept per thread: a fresh tensor the size of a 1B model's projection costs more in page faults at first
    touch (9.5 ms for 8192 x 2048 bf16, 2-core EPYC) than the dequantizing (0.6 ms) and most of the GEMM."""
    n, k = weight.shape
    slab = max(1, min(n, DEQUANTIZE_BUFFER // k))
    buffer = getattr(_buffers, "buffer", None)
    if buffer is None or buffer.dtype != x.dtype or buffer.numel() < slab * k:
        buffer = _buffers.buffer = torch.empty(slab * k, dtype=x.dtype)
    if slab == n:
        return F.linear(x, kernels.dequantize(weight, x.dtype, buffer[: n * k].view(n, k)), bias)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    for start in range(0, n, slab):
        rows = slice(start, min(n, start + slab))
        dense = kernels.dequantize(weight.rows(rows), x.dtype, buffer[: (rows.stop - start) * k].view(-1, k))
        out[..., rows] = F.linear(x, dense, None if bias is None else bias[rows])
    return out


_CACHE_TYPES: set[type] = set()  # this library's KVCache kinds met so far (Transformer._backend_for)


class QuantizedEmbedding(nn.Module):
    """Token embeddings read from a quantized weight (the tied LM head's, or a GGUF file's): each looked-up row
    dequantized (`QuantizedWeight.dequantize`'s formula) to the model's dtype."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.scheme, self.group, self.dtype = weight.scheme, weight.group, dtype
        self.register_buffer("codes", weight.codes)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("mins", weight.mins)

    @property
    def qweight(self) -> QuantizedWeight:
        """The stored weight (views of this module's buffers)."""
        return QuantizedWeight(self.scheme, self.codes, self.scales, self.mins, self.group)

    def forward(self, input_ids: torch.Tensor, native: NativeKernels | None = None) -> torch.Tensor:
        """The rows of `input_ids`; with `native` (a one-token step's native small ops), dequantized by its
        dequantizer where it takes the codes (bit for bit the formula's ~10 PyTorch ops: a 150M Llama's Q4_0 row
        27 us against 55, warm, on a 2-core Zen 4)."""
        rows = self.qweight.rows(input_ids.reshape(-1))
        if (native is not None and self.dtype in native.dtypes and native.takes(rows)
                and codes_shape_taken(rows.kernel_args[0], rows.shape[1], rows.group)):
            dense = native.dequantize(rows, self.dtype)
        else:
            dense = rows.dequantize(self.dtype)
        return dense.view(*input_ids.shape, dense.shape[-1])


Projection = Linear | QuantizedLinear


def fuse_quantized(parts: list[QuantizedLinear]) -> QuantizedLinear | None:
    """One QuantizedLinear computing `parts` in one product, or None where their formats differ (as
    fuse_linears: each part's buffers become views into the fused ones, memory unchanged)."""
    weight = concat_rows([p.qweight for p in parts])
    if weight is None or len({p.bias is None for p in parts}) > 1:
        return None
    bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts if p.bias is not None])
    fused = QuantizedLinear(weight, bias)
    fused.upcast, fused.gemv, fused.native_rows = parts[0].upcast, parts[0].gemv, parts[0].native_rows
    fused.tile_rows, fused.int8_activations = parts[0].tile_rows, parts[0].int8_activations
    start = 0
    for p in parts:
        rows = slice(start, start + p.out_features)
        p.codes, p.scales = weight.codes[rows], weight.scales[rows]
        p.mins = None if weight.mins is None else weight.mins[rows]
        if bias is not None:
            p.bias = nn.Parameter(bias[rows], requires_grad=False)
        start += p.out_features
    return fused


def native_kernels_or_raise() -> NativeKernels:
    """This machine's native build (the quantized products' kernel), or a clear error."""
    kernels = native_kernels()
    if kernels is None:
        raise RuntimeError(f"the native kernels are unavailable: {unavailable_reason()}")
    return kernels


def _fuse(parts: list[Projection], huge_pages: bool) -> Projection | None:
    """The fused product of `parts`: dense ones by fuse_linears, quantized ones of one format by fuse_quantized;
    None for a mix (a GGUF file may store q, k and v in different types)."""
    if all(isinstance(p, Linear) for p in parts):
        return fuse_linears(cast(list[Linear], parts), huge_pages)
    if all(isinstance(p, QuantizedLinear) for p in parts):
        return fuse_quantized(cast(list[QuantizedLinear], parts))
    return None


class RMSNorm(nn.Module):
    """RMSNorm in fp32. Llama/Qwen: `weight * x_norm.to(dtype)`; Gemma: `(x_norm * (1 + weight)).to(dtype)`."""

    def __init__(self, dim: int, eps: float, *, gemma: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.gemma = gemma
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))

    def forward(self, x: torch.Tensor, native: NativeKernels | None = None) -> torch.Tensor:
        if native is not None:  # a one-token step: this formula in one call (infer/kernels/cpu_decode.c)
            return native.rms_norm(x, self.weight, self.eps, self.gemma)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"

        # gate and up in one product (Transformer.fused_projections); kept outside the module tree, so
        # state_dict holds only the checkpoint's tensors.
        self.__dict__["gate_up"] = None

    def forward(self, x: torch.Tensor, native: NativeKernels | None = None, rows: NativeKernels | None = None
                ) -> torch.Tensor:
        fused: Projection | None = self.__dict__["gate_up"]
        if native is not None and fused is not None:  # a one-token step: act(gate) * up in one call
            return self.down_proj(native.gated(fused(x), self.gelu))
        if fused is not None and fused.fuses(x):
            gate, up = fused(x).split(self.up_proj.out_features, -1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if rows is not None:  # the engine's steps: every row's SiLU(gate) * up (or GELU's) in one native call
            return self.down_proj(rows.gated_rows(gate, up, self.gelu))
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(gate * up)


@dataclass(frozen=True)
class StepContext:
    """Per-forward state shared by every layer (explicit, never global): the RoPE tables of the step's
    positions, the attention backend holding K/V, and the kernels chosen for the step."""

    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer type -> (cos, sin) [T, D]
    backend: AttentionBackend
    kernels: StepKernels

    @property
    def native(self) -> NativeKernels | None:
        """The native kernels of a one-token step's small ops, or None for PyTorch's."""
        return self.kernels.native

    @property
    def norms(self) -> NativeKernels | None:
        """The native kernels of the decoder's norms: a one-token step's, or every row's in the engine's steps."""
        return self.kernels.native or self.kernels.rows


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads, optional QK-norm, RoPE and a KV cache."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        family = FAMILIES[config.model_type]
        # Qwen 2 hard-codes q/k/v biases (and none on o_proj); elsewhere attention_bias sets all four.
        qkv_bias = family.qkv_bias or config.attention_bias
        o_bias = config.attention_bias and not family.qkv_bias
        self.q_proj = Linear(config.hidden_size, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if family.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, gemma=family.norm_plus_one)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, gemma=family.norm_plus_one)
        scalar = config.query_pre_attn_scalar or self.head_dim
        self.scale = scalar**-0.5
        self.softcap = config.attn_logit_softcapping
        self.window = config.sliding_window if self.layer_type == SLIDING_ATTENTION else None
        self.__dict__["qkv"] = None  # q, k and v in one product (Transformer.fused_projections)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        B, T, _ = x.shape
        fused: Projection | None = self.__dict__["qkv"]
        if fused is not None and fused.fuses(x):
            kv_width = self.num_kv_heads * self.head_dim
            q, k, v = fused(x).split([self.num_heads * self.head_dim, kv_width, kv_width], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # q: [B, H, T, D]; k, v: [B, Hkv, T, D]
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:  # (native: one-token steps', the engine steps' rows)
            q, k = self.q_norm(q, ctx.norms), self.k_norm(k, ctx.norms)
        cos, sin = ctx.rope[self.layer_type]
        if ctx.native is not None:  # one token: q and k are rows of head_dim, rotated in one call each
            q, k = ctx.native.rope(q, cos, sin), ctx.native.rope(k, cos, sin)
        elif ctx.kernels.rows is not None and B == 1:  # the engine's steps: every token by its own position
            q, k = ctx.kernels.rows.rope_rows(q, cos, sin), ctx.kernels.rows.rope_rows(k, cos, sin)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = ctx.backend.attend(self, q, k, v, ctx.kernels)  # the backend stores k, v where it keeps them
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm block; Gemma 3 adds post-norms after attention and after the MLP."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        family = FAMILIES[config.model_type]
        gemma, eps = family.norm_plus_one, config.rms_norm_eps
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, gemma=gemma)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, gemma=gemma)
        # Llama's "post_attention_layernorm" is the pre-MLP norm; Gemma names that one
        # "pre_feedforward_layernorm" and uses "post_attention_layernorm" as a true post-norm.
        self.sandwich = family.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, gemma=gemma)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, gemma=gemma)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        native, norms = ctx.native, ctx.norms
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x, norms), ctx), norms)
            return x + self.post_feedforward_layernorm(
                self.mlp(self.pre_feedforward_layernorm(x, norms), native, ctx.kernels.rows), norms)
        x = x + self.self_attn(self.input_layernorm(x, norms), ctx)
        return x + self.mlp(self.post_attention_layernorm(x, norms), native, ctx.kernels.rows)


class Transformer(nn.Module):
    """Embeddings, decoder layers, final norm and LM head. Call it on token ids `[B, T]`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        family = FAMILIES[config.model_type]
        # Given its weight, nn.Embedding skips its random init: the checkpoint's weights replace it, and the init
        # (torch.nn.init.normal_) imports torch._dynamo on first use, ~2 s of every process that loads a model.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, gemma=family.norm_plus_one)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.embed_scale = config.hidden_size**0.5 if family.embed_scale else None
        self.inv_freq: dict[str, torch.Tensor] = {
            layer_type: inverse_frequencies(self._rope_of(layer_type), config.head_dim)
            for layer_type in set(config.layer_types)
        }
        # Layer type -> (its first layer, its window): a cache's masks are built per type from that layer's keys.
        self._mask_layers = {lt: (config.layer_types.index(lt), self._window_of(lt)) for lt in self.inv_freq}
        self.use_reference_attention = False  # the unoptimised path, for checking `attention`
        self.cudnn_attention = False  # True: PyTorch may pick cuDNN's SDPA on CUDA (infer.attention.sdpa_backends)
        self._decode_gemv = "linear"  # Transformer.decode_gemv
        self.huge_pages = False  # weights on transparent huge pages (set by the loader; fusing keeps it)
        # One-token steps under the native GEMV run their norms, rotations and gated activation as native calls
        # (infer/kernels/cpu_decode.c: each the PyTorch formula, within an ulp), and the batched engine's bf16 steps
        # their decoder norms and rotations over all rows; False keeps PyTorch's ops.
        self.native_ops = True
        # Such a step of one sequence over a cache with rows in place (contiguous, sliding) runs every layer in one
        # native call (infer/models/native_step.py: the same kernels, attention summed in another order than
        # SDPA's), and so does a batched engine step whose tokens all attend in the native paged kernel, on products
        # packed for the native packed product (infer/models/native_batch_step.py: the per-op path's values bit for
        # bit); False keeps the per-op path, their check.
        self.native_step = True
        self.packed_upto: int | None = None  # the rows up to which the packed copies are taken (pack_products)
        self.__dict__["_native_step"] = None  # the model described to that call (built at first use)
        self.__dict__["_native_batch_step"] = None  # and to the batched one (False: it cannot take this model)
        # On CUDA, generate replays one-token steps into a contiguous cache from a CUDA graph (infer/graphs.py).
        self.decode_graphs = True
        # Such a step attends through the Triton decode kernel over the cached positions only, where Triton runs;
        # False reads every slot of the cache under a mask (StaticBackend: the check).
        self.static_attention_kernel = True
        # This rank's place when the model is one shard of a tensor-parallel group (infer/tensor_parallel.py, which
        # puts the collectives on as forward hooks); None in one process.
        self.tensor_parallel: Shards | None = None
        # Ids that end generation: config.json's, widened by the loader with generation_config.json's.
        self.eos_token_ids: tuple[int, ...] = config.eos_token_ids
        self.source: Path | None = None  # the checkpoint it was loaded from (set by the loader)

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """Dtype of multi-token (prefill) matmuls and attention; None = the weights' own dtype (exact
        to HF). One-token (decode) steps always run in the weights' dtype."""
        return self.lm_head.upcast

    @compute_dtype.setter
    def compute_dtype(self, dtype: torch.dtype | None) -> None:
        for module in self._linears():
            module.upcast = dtype

    @property
    def fused_projections(self) -> bool:
        """Whether q/k/v and gate/up each run as one product for every input (fewer, larger products); off by
        default. The weights are shared, so memory is unchanged. Not bit-exact for every shape: a GEMM over
        more output rows may block the reduction differently (seen at hidden size 48: 1.3e-4 on logits of
        magnitude 12, where the separate products equal HF exactly), so the oracle-exact default keeps the
        separate products. (With the native decode GEMV, one-row products are fused either way: exact.)"""
        fused = self._decoder_layers()[0].self_attn.__dict__["qkv"]
        return fused is not None and fused.all_rows

    @fused_projections.setter
    def fused_projections(self, on: bool) -> None:
        self._lay_out_fused(all_rows=on)

    def _lay_out_fused(self, all_rows: bool, fuse: bool = False) -> None:
        """Fused q/k/v and gate/up Linears where every product, the native one-row products or the packed ones
        (`fuse`, or packed already: kept with their packed copies) use them."""
        self.forget_native_step()
        keep = all_rows or self._decode_gemv == "native" or fuse or self.packed_products
        for layer in self._decoder_layers():
            attn, mlp = layer.self_attn, layer.mlp
            groups: tuple[tuple[nn.Module, str, list[Projection]], ...] = (
                (attn, "qkv", [attn.q_proj, attn.k_proj, attn.v_proj]), (mlp, "gate_up", [mlp.gate_proj, mlp.up_proj]))
            for owner, key, parts in groups:
                fused = owner.__dict__[key] if keep else None
                if keep and fused is None:
                    fused = _fuse(parts, self.huge_pages)
                if fused is not None:
                    fused.all_rows = all_rows
                owner.__dict__[key] = fused

    def _linears(self) -> list[Projection]:
        """Every Linear and QuantizedLinear, the fused ones included (they sit outside the module tree)."""
        fused = [f for layer in self._decoder_layers()
                 for f in (layer.self_attn.__dict__["qkv"], layer.mlp.__dict__["gate_up"]) if f is not None]
        return [m for m in self.modules() if isinstance(m, (Linear, QuantizedLinear))] + fused

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the norms are stored in it, whatever the projections' storage)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        """Where the model's tensors live."""
        return self.norm.weight.device

    @property
    def quantized_rows(self) -> int:
        """Rows of input up to which quantized products run the native (or Triton) kernel on the codes; longer
        inputs dequantize into the GEMM (infer.tuning.choose_quantized_rows measures it at load)."""
        projections = [m for m in self._linears() if isinstance(m, QuantizedLinear)]
        return projections[0].native_rows if projections else 0

    @quantized_rows.setter
    def quantized_rows(self, rows: int) -> None:
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise ValueError(f"quantized_rows must be an int >= 0, got {rows!r}")
        for module in self._linears():
            if isinstance(module, QuantizedLinear):
                module.native_rows = rows

    @property
    def gemm_rows(self) -> int:
        """Rows of input up to which bf16 products run the native few-row kernels inside `few_row_products()` (the
        batched engine's steps) when `decode_gemv` is "native": dense weights instead of F.linear, quantized ones
        past `quantized_rows` instead of dequantizing the weight into the GEMM (1: neither;
        infer.tuning.choose_gemm_rows measures it at load). Sums in another order: equal within rounding."""
        dense = [m for m in self._linears() if isinstance(m, Linear)]
        if dense:
            return dense[0].native_rows
        quantized = [m for m in self._linears() if isinstance(m, QuantizedLinear)]
        return quantized[0].tile_rows if quantized else 1

    @gemm_rows.setter
    def gemm_rows(self, rows: int) -> None:
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"gemm_rows must be an int >= 1, got {rows!r}")
        kernels = native_kernels()
        if rows > 1 and (kernels is None or not kernels.gemm_bf16_available):
            why = unavailable_reason() if kernels is None else f"this build ({kernels.isa}) has no AVX512-BF16"
            raise ValueError(f"gemm_rows > 1 needs the native few-row bf16 kernel: {why}; leave it at 1")
        for module in self._linears():
            if isinstance(module, Linear):
                module.native_rows = rows
            elif isinstance(module, QuantizedLinear):
                module.tile_rows = rows

    @property
    def packed_products(self) -> bool:
        """Whether products of more than a few bf16 rows inside `few_row_products()` (the batched engine's steps) run
        oneDNN's GEMM (or the native packed product: `packed_layout`) on weights packed once (`pack_products`), q/k/v
        and gate/up as one product each, instead of F.linear, which packs the weight again on every call: at 16-64
        rows that costs as much as the product. A second copy of every dense projection (`packed_bytes`), so off by
        default; the engine turns it on where infer.tuning.choose_packed_products measures it faster. oneDNN's: the
        same sums as F.linear's kernel (bit for bit where measured); both held to it within rounding, as the engine's
        steps are. Outside the engine's steps dense products stay F.linear's; packed codes serve every call in their
        range (`QuantizedLinear`)."""
        return any(m.packed is not None for m in self._linears())

    @property
    def packed_layout(self) -> str | None:
        """The packed copies' layout: "onednn" (oneDNN's GEMM), "native" (the native packed product), None: unpacked."""
        packed = [m for m in self._linears() if m.packed is not None]
        return packed[0].packed_layout if packed else None

    def quantize_activations(self, on: bool = True) -> int:
        """One-row products (one request's decode steps) on 4-bit codes with their input quantized to int8 per run
        of 32, as llama.cpp runs its quantized files: the codes multiplied as integers (AVX512-VNNI, AVX2), lossy,
        off by default (`False` turns it off again). The q4 projections (int4, Q4_0, Q4_1, Q4_K) take it; q8 codes
        (int8, Q8_0, Q5_0, Q6_K; the int8 LM heads) and dense weights stay exact: q8's exact products already ran
        faster than the integer ones on a Zen 4 (150M Llama, Q8_0: 190.8 against 145.7 tok/s). Returns how many
        projections took it. The batched engine's steps stay exact: it refuses a model with this on."""
        if not isinstance(on, bool):
            raise TypeError(f"on must be True or False, got {on!r}")
        fused = [layer.self_attn.__dict__["qkv"] for layer in self._decoder_layers()] + [
            layer.mlp.__dict__["gate_up"] for layer in self._decoder_layers()]  # (held outside the module tree)
        takers = [m for m in [*self.modules(), *fused]
                  if isinstance(m, QuantizedLinear) and m.qweight.fmt == "q4"]
        if on and not takers:
            raise ValueError("quantize_activations: this model has no 4-bit projections; load a GGUF file of 4-bit "
                             "blocks with weights='stored' or quantize with weights='int4'")
        if on and self.device.type != "cpu":
            raise ValueError(f"quantize_activations runs on the CPU (this model is on {self.device.type})")
        for m in takers:
            m.int8_activations = on
        self.forget_native_step()  # (the whole-step call's descriptors name each product's kind)
        return len([m for m in takers if m not in fused]) if on else 0

    def pack_products(self, on: bool, native_rows: int = 1, layout: str = "onednn", upto: int | None = None,
                      one_row: bool = False) -> None:
        """Pack the engine's products (`packed_products`) in `layout` ("onednn": oneDNN's blocked layout for its GEMM;
        "native": 16 rows a block, pairs of inputs interleaved, for the native packed product, which then takes every
        product of 2 rows or more), or drop the packed copies. `native_rows`: with "onednn", the rows of input up to
        which the native few-row kernel keeps them (it must be within `gemm_rows` to run). `upto`: the rows of input
        up to which the steps take the copies (None: all; past them the unpacked products, and the per-op path for
        a step of more tokens, whose one native call would run every product packed). `one_row`: with "native", the
        quantized products' packed codes take one-row products too (the engine's steps of one request, then one
        native call as a bf16 model's are), not the codes kernel (`choose_packed_products` times the two)."""
        if not isinstance(on, bool):
            raise TypeError(f"on must be True or False, got {on!r}")
        if not isinstance(one_row, bool):
            raise TypeError(f"one_row must be True or False, got {one_row!r}")
        if isinstance(native_rows, bool) or not isinstance(native_rows, int) or native_rows < 1:
            raise ValueError(f"native_rows must be an int >= 1, got {native_rows!r}")
        if upto is not None and (isinstance(upto, bool) or not isinstance(upto, int) or upto <= native_rows):
            raise ValueError(f"upto must be None or an int above native_rows ({native_rows}), got {upto!r}")
        if layout not in PACKED_LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(PACKED_LAYOUTS)}, got {layout!r}")
        products = self.packable_products()
        weights = [m.weight for m in products if isinstance(m, Linear)]
        coded = [m for m in products if isinstance(m, QuantizedLinear)]
        upcast = self.compute_dtype
        if on and layout == "onednn" and (why := "quantized projections have no oneDNN layout" if coded
                                          else packing_unavailable(weights, upcast)) is not None:
            raise ValueError(f"packing the products needs oneDNN's bf16 GEMM: {why}; leave them unpacked")
        if upcast not in (None, torch.float32):
            coded_why: str | None = f"the products upcast to {upcast} (compute_dtype), and it sums in float32"
        else:
            coded_why = native_packing_unavailable(weights, coded, self.dtype)
        if on and layout == "native" and (why := coded_why) is not None:
            raise ValueError(f"packing the products for the native packed product: {why}; use layout='onednn' or "
                             "leave them unpacked")
        if on and self._decoder_layers()[0].self_attn.__dict__["qkv"] is None:
            self._lay_out_fused(self.fused_projections, fuse=True)  # one packed product each for q/k/v, gate/up
        self.forget_native_step()  # (the batched whole step reads the packed copies)
        self.packed_upto = upto if on else None  # (every product's; the steps read it without walking them)
        products = self.packable_products()
        rows = native_rows if layout == "onednn" else 1
        if on and all(p.packed is not None and p.packed_layout == layout
                      and (layout != "onednn" or isinstance(p.packed, torch.Tensor)
                           and p.packed.dtype == (upcast or p.weight.dtype)) for p in products):
            for product in products:  # packed already: only the rows the native kernel keeps, and the rows taken
                product.packed_from, product.packed_upto = self._packed_from(product, rows, one_row), upto
            return
        for module in self._linears():
            module.packed, module.packed_from, module.packed_upto = None, 1, None
            if isinstance(module, Linear):
                module.packed_layout = "onednn"
        if on:
            if layout == "native":
                kernels = native_kernels_or_raise()

                def pack(weight: torch.Tensor) -> torch.Tensor:  # (streamed each step, as the weights are: same pages)
                    packed = kernels.pack(weight)
                    return on_huge_pages(packed) if self.huge_pages else packed

                # The codes on the same pages: a 150M Llama's 12 layers of int8 / int4 products at 16 rows ran
                # 1.05x / 1.01x by medians on a 2-core Zen 4 (level at 64 rows; bf16's packed copies 1.17x at 16)
                copied = 0  # (codes copied onto huge pages since the C heap was last trimmed)

                def pack_coded(weight: QuantizedWeight) -> PackedCodes:
                    nonlocal copied
                    packed = kernels.pack_codes(weight, self.dtype)
                    if not self.huge_pages:
                        return packed
                    packed = replace(packed, codes=on_huge_pages(packed.codes))
                    copied += packed.codes.nbytes
                    if copied >= _TRIM_EVERY:  # the first copies freed but kept by the heap: handed back
                        release_freed_memory()
                        copied = 0
                    return packed
            else:  # (in the dtype the products upcast to, if they do)
                def pack(weight: torch.Tensor) -> torch.Tensor:
                    return pack_weight(weight if upcast is None else weight.to(upcast))
            for product in products:
                if isinstance(product, QuantizedLinear):  # (layout native)
                    product.packed, product.packed_from = pack_coded(product.qweight), self._packed_from(product, rows,
                                                                                                        one_row)
                else:
                    product.packed, product.packed_from, product.packed_layout = pack(product.weight), rows, layout
                product.packed_upto = upto

    @staticmethod
    def _packed_from(product: Projection, rows: int, one_row: bool) -> int:
        """The rows of input past which `product`'s packed copy is taken (`ProjectionTraits.packed_from`): `rows`, or
        0 for quantized codes packed natively that take one-row products too (`pack_products`' `one_row`)."""
        return 0 if one_row and isinstance(product, QuantizedLinear) and product.packed_layout == "native" else rows

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed copies (`packed_products`): the weights they copy in the copies' dtype (bf16, or float32
        where the products upcast), a quantized product's packed codes and float32 scales; 0 when off."""
        return sum(m.weight.numel() * m.packed.element_size() if isinstance(m, Linear) else m.packed.nbytes
                   for m in self._linears() if m.packed is not None)

    def packable_products(self) -> list[Projection]:
        """The products the engine's steps run, one per distinct product: the fused q/k/v and gate/up where they
        exist, else their parts; o_proj, down_proj and the LM head, dense or quantized."""
        chosen: list[Projection] = []
        for layer in self._decoder_layers():
            attn, mlp = layer.self_attn, layer.mlp
            qkv, gate_up = attn.__dict__["qkv"], mlp.__dict__["gate_up"]
            chosen += [qkv] if qkv is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
            chosen.append(attn.o_proj)
            chosen += [gate_up] if gate_up is not None else [mlp.gate_proj, mlp.up_proj]
            chosen.append(mlp.down_proj)
        chosen.append(cast(Projection, self.lm_head))
        return chosen

    @property
    def quantized(self) -> bool:
        """Whether any projection is stored quantized (infer/quant_weights.py)."""
        return any(isinstance(m, QuantizedLinear) for m in self.modules())

    def _decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]

    @property
    def decode_gemv(self) -> str:
        """Kernel of one-row (decode) products: "linear" (F.linear), "mv" (torch.mv), "native" (the compiled
        kernel of infer/kernels/cpu_decode.c; a weight it cannot take keeps F.linear) or "triton" (a GPU's,
        infer/kernels/gemv.py). Sums in another order than
        F.linear: equal within rounding."""
        return self._decode_gemv

    @decode_gemv.setter
    def decode_gemv(self, form: str) -> None:
        if form not in GEMV_FORMS:
            raise ValueError(f"decode_gemv must be one of {', '.join(map(repr, GEMV_FORMS))}, got {form!r}")
        kernels = native_kernels() if form == "native" else None
        if form == "native" and kernels is None:
            raise ValueError(f"decode_gemv='native' is unavailable here: {unavailable_reason()}; use 'auto'")
        device = self.device
        if form == "native" and device.type != "cpu":
            raise ValueError(f"decode_gemv='native' runs on the CPU; this model is on {device.type}: use 'auto'")
        if form == "triton" and not triton_available(device.type):
            raise ValueError(f"decode_gemv='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1); "
                             f"this model is on {device.type}: use 'auto'")
        self._decode_gemv = form
        self._lay_out_fused(self.fused_projections)
        for module in self._linears():
            if isinstance(module, QuantizedLinear):  # torch.mv has no quantized form: the reference's
                takes = kernels is None or kernels.takes(module.qweight)
                module.gemv = form if form in ("native", "triton") and takes else "linear"
            else:
                module.gemv = "linear" if kernels is not None and not kernels.supports(module.weight) else form

    def _rope_of(self, layer_type: str) -> RopeConfig:
        if layer_type == SLIDING_ATTENTION and self.config.rope_local is not None:
            return self.config.rope_local
        return self.config.rope

    def forward(
        self,
        input_ids: torch.Tensor,
        kv_cache: KVCache | AttentionBackend | None = None,
        *,
        all_logits: bool | None = None,
    ) -> torch.Tensor:
        """Logits for `input_ids` `[B, T]`: the one forward every caller runs.

        Without a cache: the full sequence, logits `[B, T, vocab]`. With a cache: the tokens follow
        the `kv_cache.offset` already cached (prefill, chunk or single-token decode), the cache is
        advanced, and the logits are the last position's `[B, 1, vocab]` unless `all_logits=True`.
        With an attention backend (infer/backends.py: the engine's paged batch, static slots for graph
        capture): the logits of the rows that backend keeps.
        """
        backend = self._backend_for(input_ids, kv_cache, all_logits)
        kernels = self.step_kernels(input_ids, backend)
        whole = self._native_step_for(backend, kernels)  # (the step, positions read as codes) or None
        batched = None if whole is not None else self._native_batch_step_for(backend, kernels, input_ids.numel())
        if batched is not None:  # (embedding, RoPE tables and final norm in the call: NativeBatchStep)
            try:
                x = batched(input_ids)
            except BaseException:
                backend.abort()
                raise
            return self._logits(backend.finish(x), normed=True)
        x = self._embed(input_ids, kernels.native)
        if whole is not None:  # one position's rows of the kept tables, as the batched whole step reads them
            p = int(backend.positions[0])  # (~30 us of PyTorch ops a step less; the per-op path keeps the formula)
            rope = {lt: (c[p : p + 1], s[p : p + 1]) for lt, (c, s) in self._rope_tables(p + 1).items()}
        else:
            rope = {lt: rope_cos_sin(self._inv_freq_on(lt, input_ids.device), backend.positions, x.dtype)
                    for lt in self.inv_freq}
        ctx = StepContext(rope, backend, kernels)
        try:
            if whole is not None:
                x = whole[0](x, rope, whole[1])
            else:
                with sdpa_backends(x.device, self.cudnn_attention):
                    for layer in self.layers:
                        x = layer(x, ctx)
        except BaseException:  # Ctrl-C too: the storage must not keep half a step
            backend.abort()
            raise
        return self._logits(backend.finish(x), kernels.native or kernels.rows)

    def _backend_for(self, input_ids: torch.Tensor, kv_cache: KVCache | AttentionBackend | None,
                     all_logits: bool | None) -> AttentionBackend:
        """The backend a forward attends through (a KVCache, or none, is wrapped), once the input is checked."""
        self._check_input(input_ids, ids_in_vocab=not isinstance(kv_cache, AttentionBackend)
                          or kv_cache.checks_ids)
        if isinstance(kv_cache, AttentionBackend):
            backend = kv_cache
        elif kv_cache is None or type(kv_cache) in _CACHE_TYPES or isinstance(kv_cache, KVCache):
            if kv_cache is not None and type(kv_cache).__module__.startswith("infer."):
                # (the Protocol's isinstance reads every member, ~25 us, a decode step's largest Python cost
                # outside its layers: this library's cache kinds, once passed, are taken by their type)
                _CACHE_TYPES.add(type(kv_cache))
            backend = CacheBackend(kv_cache, input_ids.shape[1], input_ids.device, self._mask_layers, all_logits)
        else:
            raise TypeError(f"kv_cache must be a KVCache (infer.create_cache), got {type(kv_cache).__name__}")
        backend.check(input_ids, len(self.layers))
        return backend

    def step_kernels(self, input_ids: torch.Tensor, backend: AttentionBackend) -> StepKernels:
        """The kernels of one forward, chosen in one place: native small ops for a one-token step of one
        sequence under the native GEMV (`native_ops`; never where autograd could need them: no backward; an engine
        step of one token takes the engine steps' row kernels instead),
        the formula's attention when `use_reference_attention`, the prefill compute dtype, and a cache's own
        attention kernel for one-token steps (a quantized cache dequantizing in the kernel)."""
        native = None
        paged = isinstance(backend, PagedBackend)
        if self.native_ops and self._decode_gemv == "native" and input_ids.numel() == 1 and not paged and not (
                torch.is_grad_enabled() and self.norm.weight.requires_grad):
            native = native_kernels()
        reference = self.use_reference_attention
        in_kernel = backend.attends_in_kernel and input_ids.shape[1] == 1 and not reference
        # The engine's steps (held to their solo runs within rounding): norms and rotations of all rows in one native
        # call each, where the build does bf16 rows 16 lanes at a time (PyTorch's RMSNorm is 8 ops, RoPE 5); an fp32
        # model's too (scalar fp32 loops, but one call each, and the kernels its whole-step call runs).
        # (an engine step of one token too: its one-row products the GEMV either way, and so it can take the
        # batched whole step, `_native_batch_step_for`)
        rows = None
        if (native is None and self.native_ops and paged and self.dtype in (torch.bfloat16, torch.float32)
                and input_ids.device.type == "cpu" and not torch.is_grad_enabled()):
            found = native_kernels()
            rows = found if found is not None and found.rows_vectorized else None
        return StepKernels(native, reference, self.compute_dtype, in_kernel, rows)

    def _native_step_for(self, backend: AttentionBackend, kernels: StepKernels
                         ) -> tuple[NativeStep, tuple[int, int]] | None:
        """The whole-step native call for this forward and the positions it reads as key and value codes (0 but
        for a quantized cache), or None for the per-op path: a step that runs native small ops (`step_kernels`), no
        reference attention, one sequence over a cache with room whose rows a kernel can take in place
        (`layer_rows`, no in-cache attention) or a quantized cache's step that only writes its rings
        (`native_step_codes`), every projection on the native kernel."""
        if (not self.native_step or self.tensor_parallel is not None or kernels.native is None or kernels.reference
                or not isinstance(backend, CacheBackend)):
            return None
        cache = backend.cache
        if cache is None or cache.batch_size != 1 or cache.offset >= cache.max_seq_len:
            return None
        codes, quantized = codes_cache(cache), (0, 0)
        if codes is not None:  # a quantized cache: a step that only writes its ring
            held = codes.native_step_codes()
            if held is None:
                return None
            quantized = held
        elif kernels.in_kernel or not hasattr(cache, "layer_rows"):
            return None
        step = self.__dict__["_native_step"]
        if step is None:
            native = kernels.native
            step = NativeStep(self, native) if takes_model(self, native) else False
            self.__dict__["_native_step"] = step
        return (step, quantized) if step and step.bind(cache) else None

    def _native_batch_step_for(self, backend: AttentionBackend, kernels: StepKernels, tokens: int
                               ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The batched whole-step native call for this forward (token ids -> final-normed hidden states), or None for
        the per-op path: an engine step (`StepKernels.rows`) without reference attention whose every token attends in
        the native paged kernel in one call (`DecodeGroup.all_rows`) in each layer's batch (the pool's; Gemma 3's
        sliding layers' rings have their own), over exact blocks or a quantized pool whose staging is the model's dtype
        (bf16 or fp32), on a model `batch_step_unavailable` takes; a step of one token (`tokens`) where every one-row
        product is the native GEMV on a weight of the model's dtype, which the call then runs
        (`NativeBatchStep.one_row`)."""
        if (not self.native_step or self.tensor_parallel is not None or kernels.rows is None or kernels.reference
                or not isinstance(backend, PagedBackend)):
            return None
        batches = {id(batch): batch for batch, _, _ in backend.layers}
        for batch in batches.values():
            group = batch.decode
            if group is None or not group.all_rows or group.kernel != "native" or group.starts is None:
                return None
        pools: list[tuple[torch.Tensor, torch.Tensor] | QuantizedPoolLayer] = []
        plans: dict[int, StepPlan | None] = {}  # id(batch) -> the quantized pool's plan where its layers read it
        dtype = self.dtype  # (a module attribute read: once, not twice a layer)
        for batch, k_blocks, v_blocks in backend.layers:
            if isinstance(k_blocks, QuantizedPoolLayer):  # its staging rows, as its plan put them
                plan = k_blocks.pool.plan
                if k_blocks.pool.dtype != dtype or plan.write_slots is None:
                    return None
                pools.append(k_blocks)
            elif (isinstance(k_blocks, torch.Tensor) and isinstance(v_blocks, torch.Tensor)
                  and k_blocks.dtype == dtype == v_blocks.dtype and k_blocks.is_contiguous()
                  and v_blocks.is_contiguous()):
                plan = None
                pools.append((k_blocks, v_blocks))
            else:
                return None
            if plans.setdefault(id(batch), plan) is not plan:  # (a batch read by exact and quantized layers)
                return None
        step = self.__dict__["_native_batch_step"]
        if step is None:
            native = kernels.rows
            step = NativeBatchStep(self, native) if batch_step_unavailable(self, native) is None else False
            self.__dict__["_native_batch_step"] = step
        if not step or (tokens == 1 and not step.one_row) or (self.packed_upto is not None
                                                               and tokens > self.packed_upto):
            return None
        described = {key: describe_batch(batch, plans[key]) for key, batch in batches.items()}
        layer_batches = [described[id(batch)] for batch, _, _ in backend.layers]
        batch = backend.batch
        block_size, end = batch.block_size, batch.end
        if end is None:  # (a batch built elsewhere: graphs.py's padded steps)
            end = int(batch.positions.max()) + 1 if batch.positions.numel() else 0
        return lambda ids: step(ids, self._embed, self._rope_tables(end), batch.positions, pools, layer_batches,
                                block_size)

    def _rope_tables(self, end: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each layer type's RoPE tables `[P, D]` (CPU, the model's dtype) of positions 0 .. P - 1, P >= `end`: kept,
        and grown by doubling, for the batched whole step to read at each row's position. Built by the per-op path's
        own `rope_cos_sin`, 256 positions a call: each value computed as a step's tables compute it (the same
        vectorized loop over a row's D values, no split between threads)."""
        kept = self.__dict__.get("_rope_table_cache")
        if kept is not None and kept[0] >= end and kept[1] == self.dtype:
            return kept[2]
        rows = max(256, 1 << max(end - 1, 0).bit_length())
        tables = {}
        for lt in self.inv_freq:
            freq = self._inv_freq_on(lt, torch.device("cpu"))
            parts = [rope_cos_sin(freq, torch.arange(p, min(p + 256, rows)), self.dtype) for p in range(0, rows, 256)]
            tables[lt] = (torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts]))
        self.__dict__["_rope_table_cache"] = (rows, self.dtype, tables)
        return tables

    def forget_native_step(self) -> None:
        """Drop the whole-step descriptions (they hold the weights' addresses): rebuilt at the next step. Called
        wherever the projections, their tensors or their packed copies change (decode_gemv, fusing, packing, `.to()`,
        load_state_dict)."""
        self.__dict__["_native_step"] = None
        self.__dict__["_native_batch_step"] = None

    def _apply(self, fn: Any, recurse: bool = True) -> Transformer:
        """nn.Module._apply (.to(), .float(), ...) with the fused products and the whole step made again."""
        with self._fused_again():
            super()._apply(fn, recurse)
        return self

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """nn.Module.load_state_dict, with the fused products and the whole step made again (assign=True swaps
        the tensors)."""
        with self._fused_again():
            return super().load_state_dict(state_dict, strict=strict, assign=assign)

    @contextlib.contextmanager
    def _fused_again(self) -> Iterator[None]:
        """Around a change of the module tree's tensors: the fused products (outside the tree) and the whole-step
        description are dropped first and made again from the new parts after."""
        all_rows = self.fused_projections
        self.forget_native_step()
        for layer in self._decoder_layers():
            layer.self_attn.__dict__["qkv"] = layer.mlp.__dict__["gate_up"] = None
        try:
            yield
        finally:
            self._lay_out_fused(all_rows)

    def _window_of(self, layer_type: str) -> int | None:
        return self.config.sliding_window if layer_type == SLIDING_ATTENTION else None

    def _embed(self, input_ids: torch.Tensor, native: NativeKernels | None = None) -> torch.Tensor:
        quantized = isinstance(self.embed_tokens, QuantizedEmbedding)
        x = self.embed_tokens(input_ids, native) if quantized else self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            # HF rounds the scale to the model dtype before multiplying.
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def _logits(self, x: torch.Tensor, native: NativeKernels | None = None, normed: bool = False) -> torch.Tensor:
        logits = self.lm_head(x if normed else self.norm(x, native))
        if self.config.final_logit_softcapping is not None:
            cap = self.config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def static_backend(self, position: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
                       ) -> StaticBackend:
        """The backend of a one-token step with static shapes, what a CUDA graph captures (infer/graphs.py):
        K/V written into slot `position` (a `[1]` tensor) of a contiguous cache's tensors `[L, B, Hkv, S, D]`,
        attention over the slots up to the position (`static_attention_kernel`: the Triton kernel reading only
        those, where Triton runs; else every slot under a mask)."""
        kernel = self.static_attention_kernel and triton_available(k_cache.device.type)
        return StaticBackend(k_cache, v_cache, position, {lt: self._window_of(lt) for lt in self.inv_freq}, kernel)

    def _inv_freq_on(self, layer_type: str, device: torch.device) -> torch.Tensor:
        # Kept out of the module's buffers so `model.to(dtype)` never rounds the frequencies.
        freq = self.inv_freq[layer_type]
        if freq.device != device:
            freq = self.inv_freq[layer_type] = freq.to(device)
        return freq

    def _check_input(self, input_ids: torch.Tensor, ids_in_vocab: bool = True) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("input_ids must be a 2-D tensor [batch, seq_len] of token ids")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must be int64 or int32 token ids, got {input_ids.dtype}")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids is empty: pass at least one token")
        weights = self.device
        if input_ids.device != weights:
            # Checked first: a forward on another device would also move the cached RoPE tables there.
            raise ValueError(f"input_ids are on {input_ids.device} but the model is on {weights}; "
                             f"move them with input_ids.to('{weights}')")
        # Checked on the CPU only: on a GPU the check would synchronise every decode step.
        if ids_in_vocab and input_ids.device.type == "cpu":
            if input_ids.numel() == 1:  # (a decode step's one token: one read, where min and max are two reductions)
                lo = hi = int(input_ids.item())
            else:
                lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), got min {lo} max {hi}")
