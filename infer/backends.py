"""Where a forward's keys and values live: the attention backend handed to `Transformer.forward`.

The model has one forward. Its layers compute q, k and v and hand them to a backend, which stores k and v
where its storage keeps them and returns the attention output; everything else in the step (embedding,
norms, RoPE, projections, LM head) is the same whoever calls. Three backends, one per storage:

- `CacheBackend`: one request over any `KVCache` kind (or none: the full sequence). Masks come from the
  cache's key positions; the cache is advanced after the last layer, or its step discarded if one raises.
- `PagedBackend`: the batched engine's ragged batch over the paged pool and the sliding layers' rings. Each
  layer reads its table set's metadata (infer/ragged.py builds it) and block tensors; the engine owns the
  bookkeeping, so a forward that raises leaves slots its scheduler never counts as computed.
- `StaticBackend`: a one-token step at static shapes, what a CUDA graph captures (infer/graphs.py): K/V go to
  a contiguous cache's slot at a position held in a tensor, and every slot is read, those past the position
  (and outside a sliding window) masked. No host sync, no size that depends on the position.

The kernels of a step (native small ops, reference attention, prefill compute dtype, a cache attending in its
own kernel) are chosen once per forward (`Transformer.step_kernels`) and passed to every layer as
`StepKernels`; the per-product GEMV form is the model's (`Transformer.decode_gemv`) and the engine's decode
attention kernel rides in its batch (`DecodeGroup.kernel`, chosen by infer.tuning).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol, cast

import torch

from infer.attention import (
    CAUSAL,
    Mask,
    attention,
    attention_mask,
    attention_reference,
    decode_attention_matmul,
)
from infer.cache.base import AttendsInKernel, KVCache
from infer.cache.paged_quantized import QuantizedPoolLayer
from infer.kernels.native import NativeKernels
from infer.ragged import DecodeGroup, RaggedBatch, SeqSlice

Attend = Callable[..., torch.Tensor]
# Keys and values `[B, Hkv, length, D]` of block tables `[B, nb]` (all their slots without a length).
Gather = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class AttentionLayer(Protocol):
    """What a backend reads of a model's attention layer."""

    layer_idx: int
    layer_type: str  # FULL_ATTENTION or SLIDING_ATTENTION
    window: int | None  # sliding window, None for full attention
    scale: float
    softcap: float | None


@dataclass(frozen=True)
class StepKernels:
    """The kernels one forward runs, chosen once for the step (`Transformer.step_kernels`)."""

    native: NativeKernels | None  # a one-token step's norms, RoPE and activation as native calls; None: PyTorch
    reference: bool  # attention by the formula (the check), never a fused kernel
    compute_dtype: torch.dtype | None  # multi-token attention runs in this dtype when set
    in_kernel: bool = False  # the cache attends over its own storage (quantized codes dequantized in a kernel)
    # The batched engine's bf16 steps: the decoder's norms, every row's rotation and the K/V writes as native calls
    rows: NativeKernels | None = None


class AttentionBackend:
    """The storage a forward attends over. Subclasses set `positions` and implement `attend`."""

    positions: torch.Tensor  # [T] absolute position of each new token (RoPE reads it)
    # Whether a one-token step may let the storage attend in its own kernel (StepKernels.in_kernel).
    attends_in_kernel: bool = False
    # Whether the model checks every id against the vocabulary (a reduction per step on the CPU). The engine and
    # the graph decoders feed only ids already checked when their request was added, and the model's own samples.
    checks_ids: bool = True

    def check(self, input_ids: torch.Tensor, num_layers: int) -> None:
        """Raise a ValueError/TypeError if `input_ids` `[B, T]` cannot run over this storage."""

    def attend(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kernels: StepKernels) -> torch.Tensor:
        """Store this step's `k`, `v` `[B, Hkv, T, D]` for `layer` and return the attention of `q`
        `[B, H, T, D]` over the keys it sees: `[B, H, T, D]`."""
        raise NotImplementedError

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """After the last layer: commit the step and return the hidden rows whose logits are wanted."""
        return x

    def abort(self) -> None:
        """A layer raised (Ctrl-C too): leave the storage as it was before the step."""


def attend_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, layer: AttentionLayer,
                 kernels: StepKernels) -> torch.Tensor:
    """Attention of `q` over contiguous `k`, `v` (a cache's history or the sequence itself)."""
    attend = attention_reference if kernels.reference else attention
    wide = kernels.compute_dtype
    if wide is not None and q.dtype != wide and q.shape[2] > 1:
        # Half-precision prefill attention is slow on CPUs without bf16 units; the cache stays narrow.
        return attend(q.to(wide), k.to(wide), v.to(wide), mask, layer.scale, layer.softcap).to(q.dtype)
    return attend(q, k, v, mask, layer.scale, layer.softcap)


class CacheBackend(AttentionBackend):
    """One request over a `KVCache` (any kind), or over its own tokens when `cache` is None.

    `windows`: layer type -> (its first layer, its sliding window); a mask is built per layer type, once per
    step, before any layer writes. `all_logits`: keep every position's hidden state (with a cache the last
    one only, by default; without one, always all)."""

    def __init__(self, cache: KVCache | None, num_tokens: int, device: torch.device,
                 windows: dict[str, tuple[int, int | None]], all_logits: bool | None = None) -> None:
        self.cache = cache
        self.num_tokens = num_tokens
        offset = cache.offset if cache is not None else 0
        self.positions = torch.arange(offset, offset + num_tokens, device=device)
        self.masks = {lt: self._mask(first, window) for lt, (first, window) in windows.items()}
        self.all_logits = all_logits
        self.attends_in_kernel = bool(getattr(cache, "attends_in_kernel", False))

    def check(self, input_ids: torch.Tensor, num_layers: int) -> None:
        """The cache must be a KVCache holding the input's batch."""
        cache = self.cache
        if cache is None:
            return
        if cache.batch_size != input_ids.shape[0]:
            raise ValueError(f"input batch {input_ids.shape[0]} does not match the cache's batch_size "
                             f"{cache.batch_size}")

    def _mask(self, layer: int, window: int | None) -> Mask:
        positions, cache, T = self.positions, self.cache, self.num_tokens
        if cache is None:
            key_positions = positions
        else:
            if T == 1 and window is None:
                return None  # one query at the newest position sees every cached key
            key_positions = cache.key_positions(layer, T)
        offset = 0 if cache is None else cache.offset
        if T > 1 and offset == 0 and (window is None or window >= T) and torch.equal(key_positions, positions):
            # A prefill from position 0 whose keys are its own tokens in order (every kind's today; the check
            # keeps a kind that returns other slots correct): fused kernels need no mask tensor.
            return CAUSAL
        return attention_mask(positions, key_positions, window)

    def attend(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kernels: StepKernels) -> torch.Tensor:
        """Update the cache (or not) and attend over what it returns."""
        if self.cache is not None and kernels.in_kernel:
            # The cache attends over its own storage (quantized codes dequantized in the kernel).
            return cast(AttendsInKernel, self.cache).decode_attention(layer.layer_idx, q, k, v, layer.scale,
                                                                      layer.softcap, layer.window)
        if self.cache is not None:
            k, v = self.cache.update(layer.layer_idx, k, v)  # k, v: [B, Hkv, S, D]
            if k.dtype != q.dtype:  # (the forward raising discards the step: the cache is left as it was)
                raise ValueError(f"the cache holds K/V in {k.dtype} but the model computes in {q.dtype}: create the "
                                 f"cache with dtype={q.dtype} (the model's), or load the model in {k.dtype}")
        return attend_dense(q, k, v, self.masks[layer.layer_type], layer, kernels)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """Advance the cache by the step's tokens; keep the last position unless `all_logits`."""
        if self.cache is None:
            return x
        self.cache.advance(self.num_tokens)
        return x if self.all_logits else x[:, -1:]

    def abort(self) -> None:
        """Discard the cache's half-written step."""
        if self.cache is not None:
            self.cache.discard_step()


class StaticBackend(AttentionBackend):
    checks_ids = False  # generate's own ids (checked prompt, sampled tokens); and no host sync in a capture

    """A one-token step into a contiguous cache's tensors `k_cache`, `v_cache` `[L, B, Hkv, S, D]` at
    `position` (a `[1]` tensor): the slot written by index, then attention over the slots up to the position.
    Two forms, side by side: `kernel` (the Triton decode kernel, infer/kernels/paged_attention.py) reads only
    those slots, split over the GPU; without it, every slot is read and the ones past the position and outside a
    window are masked (the check; at 8k context on an H200 it made a replayed step 4.6x its kernels' time). The
    caller checks capacity and advances the cache."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, position: torch.Tensor,
                 windows: dict[str, int | None], kernel: bool = False) -> None:
        self.k_cache, self.v_cache, self.positions = k_cache, v_cache, position
        _, batch, kv_heads, slots, _ = k_cache.shape
        self.windows = windows
        self.masks: dict[str, Mask] = {}  # built at first use: the kernel form needs none
        self.tables: torch.Tensor | None = None
        if kernel:
            from infer.kernels.paged_attention import contiguous_tables

            self.tables = contiguous_tables(batch, kv_heads, slots, k_cache.device)
            self.lengths = (position + 1).to(torch.int32).repeat(batch)

    def attend(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kernels: StepKernels) -> torch.Tensor:
        """Write the slot at the position, attend over the slots up to it."""
        k_cache, v_cache = self.k_cache[layer.layer_idx], self.v_cache[layer.layer_idx]
        k_cache.index_copy_(2, self.positions, k)
        v_cache.index_copy_(2, self.positions, v)
        if self.tables is not None and not kernels.reference:
            from infer.kernels.paged_attention import contiguous_decode_attention

            return contiguous_decode_attention(q[:, :, 0], k_cache, v_cache, self.tables, self.lengths, layer.scale,
                                               layer.softcap, layer.window)[:, :, None]
        if not self.masks:
            keys = torch.arange(k_cache.shape[2], device=k_cache.device)
            self.masks = {lt: attention_mask(self.positions, keys, w) for lt, w in self.windows.items()}
        return attend_dense(q, k_cache, v_cache, self.masks[layer.layer_type], layer, kernels)


class PagedBackend(AttentionBackend):
    checks_ids = False  # the engine checked every prompt id when it added the request; the rest are samples

    """The engine's ragged batch: `layers[i]` is (the batch metadata layer i reads, its K blocks, its V blocks
    `[num_blocks, Hkv, block_size, D]`). All layers share positions and sampled rows; they may use different
    block tables, as the ring-bounded sliding layers do. The input is one flat row `[1, N]`."""

    def __init__(self, layers: Sequence[tuple[RaggedBatch, torch.Tensor | QuantizedPoolLayer,
                                              torch.Tensor | QuantizedPoolLayer]]) -> None:
        if not layers:
            raise ValueError("layers must give one (batch, k_blocks, v_blocks) per model layer, got none")
        self.layers = layers
        self.batch = layers[0][0]
        self.positions = self.batch.positions

    def check(self, input_ids: torch.Tensor, num_layers: int) -> None:
        """One flat row of the batch's N tokens, and metadata for every layer."""
        if len(self.layers) != num_layers:
            raise ValueError(f"layers must give one (batch, k_blocks, v_blocks) per layer ({num_layers}), "
                             f"got {len(self.layers)}")
        n = self.positions.shape[0]
        if input_ids.shape != (1, n):
            raise ValueError(f"input_ids must be [1, N] with N = {n} tokens of the batch, "
                             f"got {tuple(input_ids.shape)}")

    def attend(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kernels: StepKernels) -> torch.Tensor:
        """Write the tokens' slots in the layer's blocks, attend each sequence over its own."""
        batch, k_blocks, v_blocks = self.layers[layer.layer_idx]
        return paged_attention(q, k, v, k_blocks, v_blocks, batch, layer.window, layer.scale, layer.softcap,
                               kernels.reference, kernels.compute_dtype, kernels.rows)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The sampled rows `[S, hidden]`."""
        rows = self.batch.sample_rows  # (increasing: as many as x has, they are all of them, in order)
        # Every row samples (a pure-decode step): the rows go on as they are; the gather, the first torch op after a
        # native step, cost ~0.1 ms with torch's code evicted.
        return x[0] if rows.numel() == x.shape[1] else x[0, rows]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_blocks: torch.Tensor | QuantizedPoolLayer,
    v_blocks: torch.Tensor | QuantizedPoolLayer,
    batch: RaggedBatch,
    window: int | None,
    scale: float,
    softcap: float | None = None,
    reference: bool = False,
    wide: torch.dtype | None = None,
    native: NativeKernels | None = None,
) -> torch.Tensor:
    """Write this step's `k`, `v` `[1, Hkv, N, D]` into one layer's blocks `[num_blocks, Hkv, bs, D]` (or a
    quantized pool's layer, which stages and quantizes them itself), then attend each sequence's queries (rows of
    `q` `[1, H, N, D]`) to its own keys; returns `[1, H, N, D]`.

    `reference`: every call is `attention_reference` (the model's check); `wide`: the dtype a multi-token
    chunk computes in (the model's compute_dtype), as in a solo prefill; `native`: the step's many-row native
    kernels (StepKernels.rows), which then write the K/V rows in one call."""
    attend: Attend = partial(attention_reference if reference else attention, scale=scale, softcap=softcap)
    gather: Gather
    if isinstance(k_blocks, QuantizedPoolLayer):
        k_blocks.write(batch, k, v)
        gather = k_blocks.gather
    else:
        v_pool = cast(torch.Tensor, v_blocks)
        if native is not None and k.dtype == k_blocks.dtype and k_blocks.is_contiguous() and v_pool.is_contiguous():
            native.write_kv(k, v, k_blocks, v_pool, batch.slot_blocks, batch.slot_offsets, batch.fresh_blocks)
        else:
            _write_blocks(k, v, k_blocks, v_pool, batch)
        gather = partial(_gather_kv, k_blocks, cast(torch.Tensor, v_blocks))
    if batch.decode is None and len(batch.seqs) == 1:  # one sequence: no scatter
        seq = batch.seqs[0]
        return _attend_one(q[:, :, seq.row : seq.row + seq.num_tokens], gather, seq, window, attend, wide)
    group = batch.decode
    if group is not None and group.all_rows and group.kernel in ("native", "triton") and not reference:
        # A step of one-token chunks alone: q's rows are the group's, in order (q is a view of [1, N, H, D]
        # memory), so the kernel reads them in place and its [B, H, D] output is the step's, transposed back.
        return _attend_in_pool(q[0].transpose(0, 1), k_blocks, v_blocks, group, scale, softcap,
                               window).transpose(0, 1)[None]
    out = torch.empty_like(q)
    for seq in batch.seqs:
        out[:, :, seq.row : seq.row + seq.num_tokens] = _attend_one(
            q[:, :, seq.row : seq.row + seq.num_tokens], gather, seq, window, attend, wide)
    if group is not None and group.kernel in ("native", "triton") and not reference:
        queries = q[0, :, group.rows].transpose(0, 1)  # [B, H, D]
        out[0, :, group.rows] = _attend_in_pool(queries, k_blocks, v_blocks, group, scale, softcap,
                                                window).transpose(0, 1)
    elif group is not None:
        keys, values = gather(group.tables)
        queries = q[0, :, group.rows, None].transpose(0, 1)  # [B, H, 1, D]
        mask = _group_mask(group, window, keys.shape[2])
        if group.kernel == "matmul" and not reference:
            attended = decode_attention_matmul(queries, keys, values, mask, scale, softcap)
        else:
            attended = attend(queries, keys, values, mask)
        out[0, :, group.rows] = attended[:, :, 0].transpose(0, 1)
    return out


def _attend_in_pool(queries: torch.Tensor, k_blocks: torch.Tensor | QuantizedPoolLayer,
                    v_blocks: torch.Tensor | QuantizedPoolLayer, group: DecodeGroup, scale: float,
                    softcap: float | None, window: int | None) -> torch.Tensor:
    """A decode group's queries `[B, H, D]` over the pool in place, in the group's kernel (native or Triton):
    `[B, H, D]`."""
    if isinstance(k_blocks, QuantizedPoolLayer):
        return k_blocks.decode_attention(group, queries, scale, softcap, window)
    if group.kernel == "triton":
        from infer.kernels.paged_attention import paged_decode_attention

        return paged_decode_attention(queries.contiguous(), k_blocks, cast(torch.Tensor, v_blocks), group.tables,
                                      group.lengths, scale, softcap, window)
    return native_paged_attention(queries, k_blocks, cast(torch.Tensor, v_blocks), group, scale, softcap, window)


def native_paged_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, group: DecodeGroup,
                           scale: float, softcap: float | None, window: int | None) -> torch.Tensor:
    """A decode group's queries `q` `[B, H, D]` over exact blocks `[N, Hkv, bs, D]` in place, in the native CPU
    kernel (the quantized pool's, every block read as staged): no gather, no padding. `[B, H, D]`."""
    from infer.kernels.native import native_kernels

    kernels = native_kernels()
    if kernels is None or group.starts is None:
        raise ValueError("decode_attention='native' needs the native kernels, which did not build here")
    return kernels.exact_paged_attention(q, k_blocks, v_blocks, group.tables, group.lengths, group.starts, scale,
                                         softcap, window).to(q.dtype)


def _write_blocks(k: torch.Tensor, v: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                  batch: RaggedBatch) -> None:
    # A block a sequence starts is zeroed first, so its unwritten slots never hold a previous owner's
    # values (the batched decode reads them, masked: a stale NaN would still poison its sum).
    # (index_fill_ with a scalar: no host value copied to the device, so a CUDA graph can capture it.)
    k_blocks.index_fill_(0, batch.fresh_blocks, 0)
    v_blocks.index_fill_(0, batch.fresh_blocks, 0)
    # Index tensors around the head slice put N first: the target is [N, Hkv, D].
    k_blocks[batch.slot_blocks, :, batch.slot_offsets] = k[0].transpose(0, 1).to(k_blocks.dtype)
    v_blocks[batch.slot_blocks, :, batch.slot_offsets] = v[0].transpose(0, 1).to(v_blocks.dtype)


def _gather_kv(k_blocks: torch.Tensor, v_blocks: torch.Tensor, tables: torch.Tensor, length: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    return gather_blocks(k_blocks, tables, length), gather_blocks(v_blocks, tables, length)


def _group_mask(group: DecodeGroup, window: int | None, num_keys: int) -> torch.Tensor:
    """The group's [B, 1, 1, S] mask (built here when the batch was planned for the kernel, which needs none)."""
    if window in group.masks:
        return group.masks[window]
    k_pos = torch.arange(num_keys, device=group.lengths.device)[None, :]
    lens = group.lengths[:, None]
    visible = k_pos < lens
    if window is not None:
        visible &= k_pos > lens - 1 - window
    return visible[:, None, None, :]


def _attend_one(queries: torch.Tensor, gather: Gather, seq: SeqSlice, window: int | None, attend: Attend,
                wide: torch.dtype | None) -> torch.Tensor:
    """One sequence's queries `[1, H, T, D]` over its own keys, with the shapes and mask of a solo run."""
    keys, values = gather(seq.blocks[None], seq.context_len - seq.first_key)
    mask = seq.masks[window]
    if wide is not None and seq.num_tokens > 1 and queries.dtype != wide:
        return attend(queries.to(wide), keys.to(wide), values.to(wide), mask).to(queries.dtype)
    return attend(queries, keys, values, mask)


def gather_blocks(blocks: torch.Tensor, tables: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """Keys (or values) of block tables `[B, nb]` in position order: `[B, Hkv, length, D]` (all the
    blocks' slots by default), as a contiguous cache holds them."""
    B, nb = tables.shape
    Hkv, bs, D = blocks.shape[1:]
    # index_select, not blocks[tables]: the same copy, 3x faster on CPU.
    gathered = blocks.index_select(0, tables.view(-1)).view(B, nb, Hkv, bs, D)
    return gathered.transpose(1, 2).reshape(B, Hkv, nb * bs, D)[:, :, :length]
