"""Every decoder layer of a batched engine step in one native call.

The per-op path of an engine step makes ~15 Python calls a layer around its kernels (norms, the products, RoPE, the K/V
writes, the paged attention, the gated activation, the residual adds): at 16 rows of a 150M Llama about 4 ms of a 20 ms
step, as long as the attention and the small ops together. cpu_decode.c's `infer_batch_step` runs the same kernels in
DecoderLayer's order, so a step's hidden states are the per-op path's bit for bit (tests/test_native_batch_step.py holds
it to that). This module describes the model to it once (`NativeBatchStep`: each layer's packed products, norms and
attention traits as ctypes structures holding the tensors' addresses) and fills in each step's pools and RoPE tables.
The step's ends are done in the call too where it can (`BatchEnds`): the rows embedded from an embedding table of the
model's dtype or a quantized one's rows dequantized (as the native dequantizer does: `QuantizedEmbedding`'s values;
other tables' rows come embedded from Python), each row's RoPE read from tables of every position
(`Transformer._rope_tables`, built by the per-op path's own `rope_cos_sin`), and the final norm; the LM head stays in
Python. Each of those ends was a few PyTorch ops between two native calls, run with their code evicted by the step's
weights: about 0.1 ms each at 16 rows.

Taken only where it applies (`Transformer._native_batch_step_for`): the engine's steps (`StepKernels.rows`), every token
of the step attending in the native paged kernel in one call (`DecodeGroup.all_rows`) over exact pools or a quantized
pool (infer/cache/paged_quantized.py: the rows staged in C, the blocks they fill quantized in C by the pool's native
quantizer, as its per-op path quantizes them on a CPU, or, with its torch quantizer (INFER_NATIVE_QUANTIZE=0), by a call
back into `QuantizedPoolLayer.quantize_filled`: either way the codes are the per-op path's bit for bit; then the paged
kernel over codes and staging), each layer reading its batch (`describe_batch`: the pool's, or Gemma 3's sliding layers'
rings'; a quantized pool's layers one batch); a bf16 or fp32 model of pre-norm SiLU layers (Qwen 3's q/k norms included)
or Gemma 3's (its norms, post-norms and GELU) whose products are packed for the native packed product
(`Transformer.pack_products(layout="native")`: the model's weights, or quantized ones' codes, `pack_codes`, which the
call multiplies as the per-op path's `QuantizedLinear` does: an fp32 model's in AVX2's channel form, fp32 sums).
Anything else runs the per-op path, which stays the check (`Transformer.native_step = False` turns both whole-step calls
off).
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable
from typing import Any, Protocol, cast

import torch

from infer.cache.paged_quantized import QuantizedPagedPool, QuantizedPoolLayer, StepPlan
from infer.config import ModelConfig
from infer.kernels.native import (
    QFORMATS,
    QSCHEMES,
    SCALE_CODES,
    BatchEnds,
    BatchLayer,
    BatchProduct,
    BatchTables,
    NativeKernels,
    codes_shape_taken,
    point_at_packed_codes,
)
from infer.quant_weights import PackedCodes, QuantizedWeight
from infer.ragged import RaggedBatch


class BatchModel(Protocol):
    """What this module reads of a Transformer (which imports this module, not the reverse)."""

    config: ModelConfig
    embed_scale: float | None
    norm: Any

    @property
    def embed_tokens(self) -> torch.nn.Module: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def _decoder_layers(self) -> list[Any]: ...


def batch_step_unavailable(model: BatchModel, kernels: NativeKernels | None) -> str | None:
    """Why `infer_batch_step` cannot run this model's layers (None: it can)."""
    config = model.config
    if kernels is None or not kernels.packed_bf16_available:
        return "no native build with AVX512-BF16 or AVX2 with FMA"
    if model.dtype not in (torch.bfloat16, torch.float32):
        return "the activations are neither bf16 nor fp32"
    if any(size % 2 for size in (config.head_dim, config.hidden_size, config.intermediate_size)):
        return "odd sizes"
    for layer in model._decoder_layers():
        attn, mlp = layer.self_attn, layer.mlp
        products = (attn.__dict__["qkv"], attn.o_proj, mlp.__dict__["gate_up"], mlp.down_proj)
        if any(p is None or getattr(p, "packed", None) is None or p.packed_layout != "native" for p in products):
            return "products not packed for the native packed product"
    return None


def describe_batch(batch: RaggedBatch, plan: StepPlan | None = None) -> BatchTables:
    """`batch` as the call reads it: where each row's K/V go (the pool's slots; read by a quantized pool's layers:
    its `plan`'s write and fresh staging slots) and what each row attends (its decode group's tables, lengths and
    starts), as int64 tensors the description holds (`keep`) and points into."""
    group = batch.decode
    if group is None or group.starts is None:
        raise ValueError("the whole-step call needs every row in one decode group with table starts")
    if plan is not None:
        if plan.write_slots is None:
            raise ValueError("the quantized pool's step was not planned (QuantizedPagedPool.plan_step)")
        slots = (plan.write_slots, batch.slot_offsets, plan.fresh_slots)
    else:
        slots = (batch.slot_blocks, batch.slot_offsets, batch.fresh_blocks)
    keep = [t.to(torch.int64).contiguous() for t in (*slots, group.tables, group.lengths, group.starts)]
    slot_blocks, slot_offsets, fresh, tables, lengths, starts = keep
    described = BatchTables(slot_blocks.data_ptr(), slot_offsets.data_ptr(), fresh.data_ptr(), tables.data_ptr(),
                            lengths.data_ptr(), starts.data_ptr(), fresh.numel(), tables.shape[1])
    described.keep = keep
    return described


class NativeBatchStep:
    """A model described to `infer_batch_step`: built once per model (rebuilt when its weights or packing change:
    Transformer.forget_native_step); each step fills in the layers' pools and RoPE tables."""

    def __init__(self, model: BatchModel, kernels: NativeKernels) -> None:
        config = model.config
        self.kernels, self.dtype = kernels, model.dtype  # (every tensor it points at in the model's dtype)
        self.keep: list[torch.Tensor] = []  # every tensor a descriptor points into
        # Whether one-row steps can take the call: every product's one-row form is the native GEMV on its weight
        # or the packed codes (not a quantized one's codes GEMV, nor another kernel), which the call then runs
        # (`_describe_product`).
        self.one_row = True
        layers = model._decoder_layers()
        self.layer_types = [layer.self_attn.layer_type for layer in layers]
        self.layers = (BatchLayer * len(layers))()
        first = layers[0]
        self.gemma, self.gelu = first.input_layernorm.gemma, first.mlp.gelu
        for desc, layer in zip(self.layers, layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            desc.attn_norm = self._address(layer.input_layernorm.weight)
            if layer.sandwich:  # (Gemma 3: post-norms on the attention's and the MLP's outputs)
                desc.attn_out = self._address(layer.post_attention_layernorm.weight)
                desc.mlp_norm = self._address(layer.pre_feedforward_layernorm.weight)
                desc.mlp_out = self._address(layer.post_feedforward_layernorm.weight)
            else:
                desc.mlp_norm = self._address(layer.post_attention_layernorm.weight)
            if attn.q_norm is not None:  # (Qwen 3, Gemma 3)
                desc.q_norm, desc.k_norm = self._address(attn.q_norm.weight), self._address(attn.k_norm.weight)
            for name, product in (("qkv", attn.__dict__["qkv"]), ("o", attn.o_proj),
                                  ("gate_up", mlp.__dict__["gate_up"]), ("down", mlp.down_proj)):
                self._describe_product(getattr(desc, name), product)
            desc.window, desc.scale, desc.softcap = attn.window or 0, attn.scale, attn.softcap or 0.0
        self.shape = (config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size,
                      config.intermediate_size)
        self.eps = config.rms_norm_eps
        self.rotation: tuple[torch.Tensor | None, torch.Tensor | None] | None = None  # a pool's, and its fp32 copy
        # The quantized pool whose fixed addresses the layers hold (_describe_pools): the pool (weakly: an engine's pool
        # goes with it), each layer's index in it (-1: exact) and the coded layers' indices as a column.
        self.pool_described: tuple[weakref.ref[QuantizedPagedPool], tuple[int, ...], torch.Tensor] | None = None
        # The step's ends (BatchEnds): the final norm, and the embedding where it is a table of the model's dtype or a
        # quantized one the native dequantizer takes (else its rows come embedded from Python); Gemma's scale rounded
        # to the model's dtype first, as the per-op path's.
        self.final_norm = self._address(model.norm.weight)
        self.embed_table = self._embedding_table(model.embed_tokens)
        scale = model.embed_scale
        self.embed_scale = 0.0 if scale is None else float(torch.tensor(scale, dtype=self.dtype))

    def _embedding_table(self, embedding: torch.nn.Module) -> BatchEnds | None:
        """The embedding's table as `BatchEnds` reads it (its ids, scale, tables and norm filled in at each step), or
        None where the call cannot read it: not an `nn.Embedding` of the model's dtype nor a QuantizedEmbedding (its
        `qweight`) of the model's dtype, of a format and shape the native dequantizer takes (the groups rule of
        cpu_decode.c's qshape_ok)."""
        if type(embedding) is torch.nn.Embedding:
            table = embedding.weight
            if table.dtype != self.dtype:
                return None
            return BatchEnds(embed=self._address(table), vocab=table.shape[0])
        weight = getattr(embedding, "qweight", None)
        if not isinstance(weight, QuantizedWeight) or getattr(embedding, "dtype", None) != self.dtype:
            return None
        fmt, _, sdtype, _, _, vocab, k, group = weight.kernel_args
        if not codes_shape_taken(fmt, k, group) or sdtype not in SCALE_CODES or (weight.factored and k % 256):
            return None
        self.keep += [t for t in (weight.codes, weight.scales, weight.mins) if t is not None]
        return BatchEnds(embed_codes=weight.codes.data_ptr(), embed_scales=weight.scales.data_ptr(),
                         embed_mins=None if weight.mins is None else weight.mins.data_ptr(), embed_fmt=QFORMATS[fmt],
                         embed_sdtype=SCALE_CODES[sdtype], embed_group=group, vocab=vocab)

    def _describe_product(self, desc: BatchProduct, product: Any) -> None:
        """Point `desc` at `product`'s packed copy: a weight (fmt -1) or a quantized weight's packed codes; and at its
        row-major weight where the per-op path's one-row product is the native GEMV on it (then a
        one-row step runs the same GEMV: `one_row`). Packed codes that take one-row products too
        (`Transformer.pack_products`' `one_row`) run them in the call as the per-op path does."""
        packed = product.packed
        desc.bias = None if product.bias is None else self._address(product.bias)
        weight = getattr(product, "weight", None)
        if (getattr(product, "gemv", None) == "native" and isinstance(weight, torch.Tensor)
                and weight.dtype == self.dtype and weight.is_contiguous()):
            desc.rows_w = self._address(weight)
        elif not (isinstance(packed, PackedCodes) and product.takes_packed(1)):
            self.one_row = False
        if isinstance(packed, PackedCodes):
            self.keep += point_at_packed_codes(desc, packed)
        else:
            desc.w, desc.fmt = self._address(packed), -1

    def _address(self, t: torch.Tensor) -> int:
        """The address of `t` (the model's dtype, contiguous: a copy where it is not), kept alive with this step."""
        t = t.detach().to(self.dtype).contiguous()
        self.keep.append(t)
        return t.data_ptr()

    def __call__(self, input_ids: torch.Tensor, embed: Callable[[torch.Tensor], torch.Tensor],
                 rope: dict[str, tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor,
                 pools: list[tuple[torch.Tensor, torch.Tensor] | QuantizedPoolLayer], batches: list[BatchTables],
                 block_size: int) -> torch.Tensor:
        """The step's hidden states after every layer and the final norm `[1, N, hidden]`, from its token ids
        `input_ids` `[1, N]` (embedded in the call, or by `embed` where it cannot: `embed_table` None): `rope` the
        RoPE tables by layer type (`[P, D]` each, contiguous, positions 0 .. P - 1) read at each row's `positions`
        (`[N]` int64), `pools` each layer's K and V blocks or its layer of a quantized pool, `batches` each layer's
        batch (`describe_batch`; kept alive by the caller through the call)."""
        tokens, hidden = input_ids.shape[1], self.shape[3]
        # (each layer type's tables and each batch addressed once: the layers share them)
        tables = {layer_type: (cos.data_ptr(), sin.data_ptr()) for layer_type, (cos, sin) in rope.items()}
        pointers = {key: ctypes.pointer(batch) for key, batch in {id(b): b for b in batches}.items()}
        for desc, layer_type, batch in zip(self.layers, self.layer_types, batches, strict=True):
            desc.cos, desc.sin = tables[layer_type]
            desc.batch = pointers[id(batch)]
        ends = BatchEnds() if self.embed_table is None else self.embed_table
        positions = positions.to(torch.int64).contiguous()  # (alive through the call)
        ends.final_norm, ends.positions = self.final_norm, positions.data_ptr()
        ends.table_rows = next(iter(rope.values()))[0].shape[0]
        if self.embed_table is not None:
            ids = input_ids.reshape(tokens).to(torch.int64).contiguous()  # (alive through the call)
            out = torch.empty(1, tokens, hidden, dtype=self.dtype)
            ends.ids, ends.embed_scale = ids.data_ptr(), self.embed_scale
        else:
            out = embed(input_ids).to(self.dtype).contiguous().clone()
        rows = self._describe_pools(pools)  # (a quantized pool's staging rows: alive through the call)
        quantize_filled = None
        if rows is not None and rows[2].plan.quantizes and rows[2].quantizer is None:  # (else quantized in the call)
            quantize_filled = lambda layer: cast(QuantizedPoolLayer, pools[layer]).quantize_filled()  # noqa: E731
        self.kernels.batch_step(self.layers, self.shape, self.eps, out, block_size, quantize_filled, self.gemma,
                                self.gelu, ends)
        del rows
        return out

    def _describe_pools(self, pools: list[tuple[torch.Tensor, torch.Tensor] | QuantizedPoolLayer]
                        ) -> tuple[torch.Tensor, torch.Tensor, QuantizedPagedPool, torch.Tensor, torch.Tensor] | None:
        """Point each layer at its K and V blocks, or at its quantized pool layer's codes, scales, staging and this
        step's staging rows (the per-op path's `QuantizedPagedPool.stage_rows` of the plan's write and fresh slots,
        and of its fill slots where the call quantizes the filled blocks itself); returns those rows, the pool and the
        filled blocks (None: no quantized layer). A pool's fixed addresses are set once while steps keep reading the
        same pool in the same layers (`_describe_pool_layers`; ~100 tensor views a step less)."""
        coded = [p for p in pools if isinstance(p, QuantizedPoolLayer)]
        rows = None
        if coded:
            pool = coded[0].pool
            plan = pool.plan
            if plan.write_slots is None:
                raise ValueError("the quantized pool's step was not planned (QuantizedPagedPool.plan_step)")
            layout = tuple(p.layer if isinstance(p, QuantizedPoolLayer) else -1 for p in pools)
            kept = self.pool_described
            if kept is None or kept[0]() is not pool or kept[1] != layout:
                kept = self._describe_pool_layers(pools, pool, layout)
            # [coded layers, slots]; the filled blocks' rows only where the call quantizes them (native_quantizer)
            fills = plan.fill_slots if plan.quantizes and pool.quantizer is not None else plan.fill_slots[:0]
            slots = (plan.write_slots, plan.fresh_slots, fills)
            staged = pool.stage_rows(torch.cat(slots), kept[2]).to(torch.int64).contiguous()
            write, fresh, fill = staged.split([t.numel() for t in slots], dim=1)  # (a layer's row of each: contiguous)
            blocks = plan.fill_blocks[: fills.numel()].to(torch.int64).contiguous()
            rows = (write, fresh, pool, fill, blocks)
        else:
            self.pool_described = None  # (another engine's exact pool took the layers: described afresh next time)
        n = 0
        for desc, layer in zip(self.layers, pools, strict=True):
            if not isinstance(layer, QuantizedPoolLayer):
                k_blocks, v_blocks = layer
                desc.k_blocks, desc.v_blocks, desc.k_codes = k_blocks.data_ptr(), v_blocks.data_ptr(), None
                continue
            desc.write_rows, desc.fresh_rows = write[n].data_ptr(), fresh[n].data_ptr()
            desc.fill_rows, desc.fill_blocks, desc.n_fill = fill[n].data_ptr(), blocks.data_ptr(), blocks.numel()
            n += 1
        return rows

    def _describe_pool_layers(self, pools: list[tuple[torch.Tensor, torch.Tensor] | QuantizedPoolLayer],
                              pool: QuantizedPagedPool, layout: tuple[int, ...]
                              ) -> tuple[weakref.ref[QuantizedPagedPool], tuple[int, ...], torch.Tensor]:
        """The coded layers' fixed addresses in `pool` (its codes, scales, offsets, rotation, staging and persistent
        blocks, which it never reallocates), kept as `pool_described`."""
        if self.rotation is None or self.rotation[0] is not pool.rotation:
            self.rotation = (pool.rotation, None if pool.rotation is None else pool.rotation.float().contiguous())
        rotation = self.rotation[1]
        for desc, i in zip(self.layers, layout, strict=True):
            if i < 0:
                continue
            desc.k_codes, desc.v_codes = pool.k_codes[i].data_ptr(), pool.v_codes[i].data_ptr()
            desc.k_scale, desc.v_scale = pool.k_scale[i].data_ptr(), pool.v_scale[i].data_ptr()
            desc.k_offset = pool.k_offset[i].data_ptr() if pool.key_offsets else None
            desc.rotation = None if rotation is None else rotation.data_ptr()
            desc.k_stage, desc.v_stage = pool.k_stage.data_ptr(), pool.v_stage.data_ptr()
            desc.k_blocks, desc.v_blocks = pool.k_persistent[i].data_ptr(), pool.v_persistent[i].data_ptr()
            desc.scheme, desc.num_blocks = QSCHEMES[pool.scheme], pool.num_blocks
        index = torch.tensor([i for i in layout if i >= 0])[:, None]
        self.pool_described = (weakref.ref(pool), layout, index)
        return self.pool_described
