"""A one-token decode step of one sequence with every decoder layer in one native call.

On a small model the per-op path spends as long in Python as in its products (SmolLM2-135M: ~20 calls a
layer, 30 layers, ~4 of a 9 ms step). cpu_decode.c's `infer_decode_step` runs the layers with the kernels
that path calls (the native GEMV and quantized GEMV, norms, RoPE, gated activation) in DecoderLayer's order,
and attends with the native paged kernel's exact path in place of SDPA: the one difference, a sum in
another order. This module describes the model to it once (`NativeStep`: each layer's products, norms and
attention traits, as ctypes structures holding the tensors' addresses) and a cache's storage once per
cache; the embedding, the final norm and the LM head stay in Python.

Taken only where it applies (`Transformer._native_step_for`): the native small ops' step (one token, one sequence, the
native GEMV; `Transformer.native_ops`), every projection on the native kernel, and a cache that stores each
layer's K/V rows in place (`layer_rows`: the contiguous and sliding kinds), or a quantized cache read by the native
kernel whose step only writes its exact ring (`native_step_codes`: not the steps that write a sink or fill a key
block, which quantize in PyTorch); that cache's layers attend with infer_qattn, the per-layer path's kernel, so its
steps equal that path's bit for bit. Anything else runs the per-op path, which stays the check
(`Transformer.native_step = False`).
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any, Protocol, cast

import torch

from infer.config import ModelConfig
from infer.kernels.native import (
    MINS_EIGHT_SCALES,
    QFORMATS,
    QSCHEMES,
    SCALE_CODES,
    NativeKernels,
    StepLayer,
    StepProj,
    codes_shape_taken,
    point_at_packed_codes,
)
from infer.quant_weights import PackedCodes

QUANTIZED_KINDS = {"q8": 1, "q4": 2, "q6": 3}  # QuantizedWeight.kernel_args' format -> step_proj.kind (0: dense)
PACKED_KIND = 4  # step_proj.kind of codes packed by NativeKernels.pack_codes
A8_KIND = 5  # step_proj.kind of codes whose one-row products quantize x to int8 (Transformer.quantize_activations)


class RowsCache(Protocol):
    """A cache whose layers keep K/V rows a kernel can write and read in place."""

    batch_size: int
    max_seq_len: int
    offset: int

    def layer_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Layer `layer`'s K and V storage `[B, Hkv, slots, D]` and whether it is a ring."""
        ...


class CodesCache(Protocol):
    """A quantized cache (infer/cache/quantized.py) whose one-token steps the whole-step call can take."""

    batch_size: int
    max_seq_len: int
    offset: int

    def native_step_codes(self) -> tuple[int, int] | None:
        """The positions read as key and as value codes by a one-token step now, or None where it must run layer
        by layer."""
        ...

    def layer_codes(self, layer: int) -> Any:
        """Layer `layer`'s storage (`QuantizedLayerRows`)."""
        ...


def codes_cache(cache: object) -> CodesCache | None:
    """`cache` as a quantized cache the whole-step call can take, or None (a plain attribute test: this runs every
    step, where a runtime-checkable Protocol's isinstance costs ~10 us)."""
    return cast(CodesCache, cache) if hasattr(cache, "native_step_codes") else None


class StepModel(Protocol):
    """What this module reads of a Transformer (infer/models/transformer.py imports this module, not the reverse):
    its layers are read by their Hugging Face attribute names, a projection as `Linear` (a `weight`) or
    `QuantizedLinear` (a `qweight`)."""

    config: ModelConfig
    inv_freq: dict[str, torch.Tensor]

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def _decoder_layers(self) -> list[Any]: ...


class NativeStep:
    """A model described to `infer_decode_step`: built once per model (rebuilt when its weights change:
    Transformer.forget_native_step), bound to one cache at a time."""

    def __init__(self, model: StepModel, kernels: NativeKernels) -> None:
        config = model.config
        self.kernels = kernels
        self.dtype = model.dtype
        self.keep: list[torch.Tensor] = []  # every tensor a descriptor points into
        self.rope_types = list(model.inv_freq)
        layers = model._decoder_layers()
        self.layers = (StepLayer * len(layers))()
        for desc, layer in zip(self.layers, layers, strict=True):
            self._describe(desc, layer)
        self.shape = (config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size,
                      config.intermediate_size)
        self.eps = config.rms_norm_eps
        self.gemma = layers[0].input_layernorm.gemma
        self.gelu = layers[0].mlp.gelu
        # The bound cache, held weakly: its tensors are its own (a step runs only while it lives).
        self._cache: weakref.ref[Any] | None = None

    def _address(self, t: torch.Tensor | None, dtype: torch.dtype | None = None) -> int | None:
        """The address of `t` (in `dtype`, contiguous: a copy where it is not), kept alive with this step."""
        if t is None:
            return None
        t = t.detach()
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        t = t.contiguous()
        self.keep.append(t)
        return t.data_ptr()

    def _product(self, desc: StepProj, module: Any) -> None:
        """A Linear (dense `weight`) or a QuantizedLinear (`qweight`, or its packed codes where the per-op path's
        one-row product runs on them: `Transformer.pack_products`' `one_row`)."""
        packed = getattr(module, "packed", None)
        if getattr(module, "int8_activations", False):
            fmt, codes, sdtype, scales, mins, n, k, group = module.qweight.kernel_args
            self.keep.extend(module.qweight.tensors())
            desc.kind, desc.fmt, desc.sdtype = A8_KIND, QFORMATS[fmt], SCALE_CODES[sdtype]  # (q4 codes)
            desc.w, desc.scales, desc.mins, desc.n, desc.k, desc.group = codes, scales, mins, n, k, group
        elif isinstance(packed, PackedCodes) and module.takes_packed(1):
            self.keep += point_at_packed_codes(desc, packed)
            desc.kind, (desc.n, desc.k) = PACKED_KIND, packed.shape
        elif hasattr(module, "qweight"):
            fmt, codes, sdtype, scales, mins, n, k, group = module.qweight.kernel_args
            self.keep.extend(module.qweight.tensors())
            desc.kind, desc.sdtype = QUANTIZED_KINDS[fmt], SCALE_CODES[sdtype]
            desc.w, desc.scales, desc.mins, desc.n, desc.k, desc.group = codes, scales, mins, n, k, group
            desc.fmt = MINS_EIGHT_SCALES if module.qweight.mins_are_eight_scales else 0  # (Q4_0's mins formed)
        else:
            desc.kind, desc.n, desc.k = 0, module.out_features, module.in_features
            desc.w = self._address(module.weight)
        desc.bias = self._address(module.bias, self.dtype)

    def _norm(self, norm: Any) -> int | None:
        return None if norm is None else self._address(norm.weight, self.dtype)

    def _describe(self, desc: StepLayer, layer: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.__dict__["qkv"]] if attn.__dict__["qkv"] is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
        gate_up = [mlp.__dict__["gate_up"]] if mlp.__dict__["gate_up"] is not None else [mlp.gate_proj, mlp.up_proj]
        for i, module in enumerate(qkv):
            self._product(desc.qkv[i], module)
        for i, module in enumerate(gate_up):
            self._product(desc.gate_up[i], module)
        self._product(desc.o, attn.o_proj)
        self._product(desc.down, mlp.down_proj)
        desc.n_qkv, desc.n_gate_up = len(qkv), len(gate_up)
        norm = self._norm
        desc.attn_in = norm(layer.input_layernorm)
        if layer.sandwich:  # Gemma: post-norms after attention and the MLP, its own pre-MLP norm
            desc.attn_out, desc.mlp_in = norm(layer.post_attention_layernorm), norm(layer.pre_feedforward_layernorm)
            desc.mlp_out = norm(layer.post_feedforward_layernorm)
        else:
            desc.mlp_in = norm(layer.post_attention_layernorm)
        desc.q_norm, desc.k_norm = norm(attn.q_norm), norm(attn.k_norm)
        desc.window, desc.rope = attn.window or 0, self.rope_types.index(attn.layer_type)
        desc.scale, desc.softcap = attn.scale, attn.softcap or 0.0

    def bind(self, cache: RowsCache | CodesCache) -> bool:
        """Point every layer at `cache`'s rows (once per cache); False where its storage cannot be taken."""
        if self._cache is not None and self._cache() is cache:
            return True
        codes = codes_cache(cache)
        if codes is not None:
            return self._bind_codes(codes)
        cache = cast(RowsCache, cache)
        rows = [cache.layer_rows(i) for i in range(len(self.layers))]
        if any(k.dtype != self.dtype or not k.is_contiguous() or not v.is_contiguous() for k, v, _ in rows):
            return False
        for desc, (k, v, ring) in zip(self.layers, rows, strict=True):
            desc.k, desc.v, desc.slots, desc.ring = k.data_ptr(), v.data_ptr(), k.shape[2], int(ring)
            desc.qscheme = 0  # exact rows (where a quantized cache bound before set a scheme)
        self._cache = weakref.ref(cache)
        return True

    def _bind_codes(self, cache: CodesCache) -> bool:
        """A quantized cache's layers: the step writes its row into the exact ring and attends with infer_qattn."""
        layers = [cache.layer_codes(i) for i in range(len(self.layers))]
        for rows in layers:
            parts = [rows.k_ring, rows.v_ring, rows.k_sink, rows.v_sink, rows.k_codes, rows.v_codes, rows.k_scale,
                     rows.v_scale, *([] if rows.k_offset is None else [rows.k_offset]),
                     *([] if rows.rotation is None else [rows.rotation])]
            if rows.k_ring.dtype != self.dtype or not all(t.is_contiguous() for t in parts) or (
                    rows.rotation is not None and rows.rotation.dtype != torch.float32):
                return False
        for desc, rows in zip(self.layers, layers, strict=True):
            desc.k, desc.v, desc.slots, desc.ring = rows.k_ring.data_ptr(), rows.v_ring.data_ptr(), \
                rows.k_ring.shape[1], 1
            desc.qscheme, desc.channel_keys = 1 + QSCHEMES[rows.scheme], int(rows.channel_keys)
            desc.sinks, desc.nq_cap, desc.block = rows.sinks, rows.k_codes.shape[1], rows.block
            desc.scale_rows = rows.k_scale.shape[1]
            desc.vslots, desc.nqv_cap = rows.v_ring.shape[1], rows.v_codes.shape[1]
            desc.k_sink, desc.v_sink = rows.k_sink.data_ptr(), rows.v_sink.data_ptr()
            desc.k_codes, desc.v_codes = rows.k_codes.data_ptr(), rows.v_codes.data_ptr()
            desc.k_scale, desc.v_scale = rows.k_scale.data_ptr(), rows.v_scale.data_ptr()
            desc.k_offset = None if rows.k_offset is None else rows.k_offset.data_ptr()
            desc.v_rot = None if rows.rotation is None else rows.rotation.data_ptr()
        self._cache = weakref.ref(cache)
        return True

    def __call__(self, x: torch.Tensor, rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 quantized: tuple[int, int] = (0, 0)) -> torch.Tensor:
        """The hidden state `[1, 1, hidden]` after every layer at the bound cache's next position, whose K/V it
        writes there; `quantized`: a quantized cache's positions read as key and value codes in this step (its
        `native_step_codes()`, which the caller checked is not None)."""
        cache = None if self._cache is None else self._cache()
        if cache is None:
            raise RuntimeError("a native step runs after bind(cache), while that cache lives")
        position = cache.offset
        x = x.contiguous()
        tables = [(rope[lt][0].contiguous(), rope[lt][1].contiguous()) for lt in self.rope_types]
        cos = (ctypes.c_void_p * len(tables))(*(c.data_ptr() for c, _ in tables))
        sin = (ctypes.c_void_p * len(tables))(*(s.data_ptr() for _, s in tables))
        self.kernels.decode_step(self.layers, self.shape, self.eps, self.gemma, self.gelu, x, position, cos, sin,
                                 quantized)
        return x


def takes_model(model: StepModel, kernels: NativeKernels) -> bool:
    """Whether every projection of `model` runs the native kernel on weights `infer_decode_step` takes: dense ones in
    the model's dtype, quantized ones of whole runs of 32 in groups of whole runs (or, q8, of 16)."""
    if model.dtype not in kernels.dtypes or model.device.type != "cpu":
        return False
    for layer in model._decoder_layers():
        attn, mlp = layer.self_attn, layer.mlp
        for module in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj,
                       attn.__dict__["qkv"], mlp.__dict__["gate_up"]):
            if module is None:
                continue
            if module.gemv != "native":
                return False
            if hasattr(module, "qweight"):
                fmt, _, _, _, _, _, k, group = module.qweight.kernel_args
                if not codes_shape_taken(fmt, k, group):
                    return False
            elif module.weight.dtype != model.dtype:
                return False
    return True
