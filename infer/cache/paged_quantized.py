"""The batched engine's pool with quantized blocks: int8, int4 or FP4 codes in the quantized cache's layout.

A full block holds its keys as codes with one bf16 scale per channel over the block's tokens (KIVI: a real model's
keys have outlier channels that a scale per row cannot hold) and its values as codes with one scale per (token, head);
the 4-bit schemes also centre each key channel on its midpoint over the block and store value rows rotated
(`quant.value_rotation`), as the registered quantized caches do. A block not yet full has no channel scales yet: its
K/V sit exact, in the model dtype, in a staging slot (KIVI's full-precision residual), and are quantized in the step
that fills the block. A sequence's first block is never quantized: it is its attention sink (BOS and the first
tokens, where a real model's largest keys sit), kept exact in its slot while any sequence holds it and while the
prefix cache can still find it (such sinks are forgotten, oldest first, when their slots are needed). Block tables
name a staged block `code_blocks + slot` (`plan_step`; `code_blocks` is every block with codes: the managed ones and
a spare), so the ragged batch's writes land in staging and its gathers read codes or staging block by block
(`QuantizedPoolLayer`).

Pure-decode steps replayed from CUDA graphs (infer/graphs.py) read the plan from static buffers padded to the
graph's batch: padding rows write to the discard row, padding fills quantize a spare staging slot into a spare code
block, and padding fresh slots zero that spare slot (`padded_plan`), so the same kernels run whatever the step
holds.

The host side is pure Python and all-or-nothing. Each step:
  `plan_step(chunks)`  every block the step writes gets a staging slot, zeroed when written from its first slot
                       (a full block written in the middle, a prompt's recomputed last token, keeps what it
                       stores: codes, or a sink's staging);
                       the tables come back with the blocks still partly filled after the step remapped, and the
                       blocks the step fills are listed;
  the forward          each layer zeroes its fresh slots, writes the new K/V there, quantizes the filled blocks into
                       codes (read as codes from this step on, as the quantized cache does; on a CPU in C,
                       `native_quantizer`, the torch code's formulas without a Python call per layer), then attends;
  `commit_step()`      filled blocks give their slots back; `abort_step()` gives back the slots `plan_step` took.
A staged block no sequence holds any more (its request finished or was preempted) gives its slot back at the next
plan, unless it is a sink the prefix cache still finds. Sliding-window layers keep their exact rings
(infer/cache/batch_storage.py): they are bounded by the window.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from infer.cache import quant
from infer.cache.base import allocate_zeros, check_counts
from infer.cache.block_manager import BlockManager, BlockStats, CopyOnWrite
from infer.cache.paged import BLOCK_BOOKKEEPING_BYTES
from infer.cache.quantized import DEFAULT_ROTATE_VALUES, SCHEMES
from infer.config import ModelConfig
from infer.errors import CacheFullError
from infer.ragged import DecodeGroup, RaggedBatch, SeqChunk, long_tensors

if TYPE_CHECKING:
    from infer.kernels.native import NativeKernels

KV_CACHE_DTYPES = tuple(SCHEMES)
# Key channels centred on an offset per block: the 4-bit schemes, as the quantized caches. int8 takes none here: a
# pool block (16 tokens by default) already spends 1 bit per key on its channel scales, and offsets would add another.
POOL_KEY_OFFSETS = {"int8": False, "int4": True, "fp4": True}
_NO_INTS = torch.empty(0, dtype=torch.long)


@dataclass
class StepPlan:
    """Where a step's layers write each new token (a staging slot), which slots start empty, and which blocks
    they quantize from their slot after the writes (`fill`: (slot, block) pairs, and as device tensors)."""

    fill: list[tuple[int, int]] = field(default_factory=list)
    taken: list[int] = field(default_factory=list)  # blocks given a free slot by this plan (undone on abort)
    sealed: list[int] = field(default_factory=list)  # first blocks the step fills: sinks, staged from now on
    fill_slots: torch.Tensor = field(default_factory=lambda: _NO_INTS)
    fill_blocks: torch.Tensor = field(default_factory=lambda: _NO_INTS)
    write_slots: torch.Tensor | None = None  # [N] the staging slot of each new token, in batch order; None: unplanned
    fresh_slots: torch.Tensor = field(default_factory=lambda: _NO_INTS)  # slots written from their first slot
    writes: list[int] = field(default_factory=list)  # write_slots and fresh_slots on the host
    fresh: list[int] = field(default_factory=list)
    padded: bool = False  # the tensors are a graph's static buffers (`padded_plan`): quantize every step

    @property
    def quantizes(self) -> bool:
        """Whether the layers quantize `fill_slots` into `fill_blocks` after their writes."""
        return bool(self.fill) or self.padded


def native_quantizer(device: torch.device) -> NativeKernels | None:
    """The native kernels that quantize a pool's filled blocks on `device` (`NativeKernels.quantize_blocks`: no
    Python call per layer, the torch code's formulas), or None: a GPU, no native build, or INFER_NATIVE_QUANTIZE=0
    (the check: the torch code)."""
    if device.type != "cpu" or os.environ.get("INFER_NATIVE_QUANTIZE") == "0":
        return None
    from infer.kernels.native import native_kernels

    return native_kernels()


def check_pool_scheme(scheme: object, config: ModelConfig) -> None:
    """Refuse a `kv_cache_dtype` that is no pool scheme, or one this model's head size cannot pack."""
    if not isinstance(scheme, str) or scheme not in SCHEMES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))} (or None for "
                         f"the model's dtype), got {scheme!r}")
    if config.head_dim % SCHEMES[scheme][2]:
        raise ValueError(f"kv_cache_dtype={scheme!r} packs two values per byte and needs an even head_dim, got "
                         f"{config.head_dim}; use 'int8'")


class QuantizedPagedPool:
    """Codes and scales for `num_blocks` blocks of `num_layers` layers, staging for the blocks being filled, and
    the `BlockManager` deciding who owns which block (as `PagedKVPool`, which holds exact blocks)."""

    def __init__(self, config: ModelConfig, *, scheme: str, num_blocks: int, block_size: int, stage_slots: int,
                 scratch_slots: int, dtype: torch.dtype, device: torch.device | str,
                 num_layers: int | None = None, spare_blocks: int = 0) -> None:
        check_pool_scheme(scheme, config)
        check_counts(num_blocks=num_blocks, block_size=block_size, stage_slots=stage_slots,
                     scratch_slots=scratch_slots)
        if spare_blocks not in (0, 1):
            raise ValueError(f"spare_blocks must be 0 or 1 (graph steps' padding), got {spare_blocks!r}")
        _, _, per_element, code_dtype = SCHEMES[scheme]
        self.scheme, self.dtype = scheme, dtype
        self.key_offsets = POOL_KEY_OFFSETS[scheme]
        self.rotation = quant.value_rotation(config.head_dim, device) if DEFAULT_ROTATE_VALUES[scheme] else None
        self.quantizer = native_quantizer(torch.device(device))
        self.num_layers = config.num_hidden_layers if num_layers is None else num_layers
        # With `spare_blocks`, one code block past the managed ones and one staging slot past the handed-out ones
        # that only a graph step's padding touches (`padded_plan`); tables name staged blocks past every code block.
        self.num_blocks, self.block_size = num_blocks, block_size
        self.code_blocks, self.stage_slots = num_blocks + spare_blocks, stage_slots + spare_blocks
        self.spare_block = num_blocks if spare_blocks else None
        self.spare_slot = stage_slots if spare_blocks else None
        self.scratch_slots = scratch_slots
        lnh = (self.num_layers, self.code_blocks, config.num_key_value_heads)
        codes = ((*lnh, block_size, config.head_dim // per_element), code_dtype)
        # Staging rows: `stage_slots` per layer for blocks that stay partly filled between steps (row layer * P +
        # slot), then `scratch_slots` that every layer reuses within its step: blocks a step writes whole and fills
        # (row L * P + t), and the last one, where writes that must change nothing go (see plan_step).
        stage = ((self.num_layers * self.stage_slots + scratch_slots, config.num_key_value_heads, block_size,
                  config.head_dim), dtype)
        # k_codes, v_codes: [L, N, Hkv, bs, D or D/2]; k_scale [L, N, Hkv, D] (per channel over the block's tokens);
        # v_scale [L, N, Hkv, bs] (per token); k_stage, v_stage [L * P + T, Hkv, bs, D] exact; k_offset as k_scale
        # (empty where the scheme takes none).
        (self.k_codes, self.v_codes, self.k_scale, self.v_scale, self.k_stage, self.v_stage,
         self.k_offset) = allocate_zeros(
            f"an {scheme} paged pool", device, codes, codes, ((*lnh, config.head_dim), quant.SCALE_DTYPE),
            ((*lnh, block_size), quant.SCALE_DTYPE), stage, stage,
            ((*lnh, config.head_dim if self.key_offsets else 0), quant.SCALE_DTYPE),
            extra_bytes=num_blocks * BLOCK_BOOKKEEPING_BYTES)
        self.manager = BlockManager(num_blocks, block_size)
        self._staged: dict[int, int] = {}  # block -> staging slot
        self._sinks: dict[int, int] = {}  # full first blocks kept staged -> their generation in the manager
        self._free_slots = list(range(stage_slots - 1, -1, -1))
        # Persistent staging by layer: [L, P, Hkv, bs, D] views.
        P = self.stage_slots
        self.k_persistent = self.k_stage[: self.num_layers * P].view(self.num_layers, P, *self.k_stage.shape[1:])
        self.v_persistent = self.v_stage[: self.num_layers * P].view(self.num_layers, P, *self.v_stage.shape[1:])
        self.plan = StepPlan()
        self.layers = [QuantizedPoolLayer(self, i) for i in range(self.num_layers)]

    @staticmethod
    def block_bytes(config: ModelConfig, scheme: str, block_size: int, num_layers: int) -> int:
        """Bytes one block takes in every layer: K and V codes, the keys' channel scales (and offsets), the values'
        row scales."""
        _, _, per_element, code_dtype = SCHEMES[scheme]
        codes = block_size * (config.head_dim // per_element) * code_dtype.itemsize
        key_rows = 2 if POOL_KEY_OFFSETS[scheme] else 1
        scales = (key_rows * config.head_dim + block_size) * quant.SCALE_DTYPE.itemsize
        return num_layers * config.num_key_value_heads * (2 * codes + scales)

    @staticmethod
    def element_bytes(config: ModelConfig, scheme: str, block_size: int) -> float:
        """Bytes a full block takes per K or V element (`block_bytes` over its elements): what a step reads of the
        pool per key and value it attends to (the roofline's K/V bytes for this pool)."""
        elements = 2 * config.num_key_value_heads * block_size * config.head_dim
        return QuantizedPagedPool.block_bytes(config, scheme, block_size, 1) / elements

    @property
    def device(self) -> torch.device:
        """Where the tensors live."""
        return self.k_codes.device

    @property
    def memory_bytes(self) -> int:
        """Bytes of codes, scales and staging."""
        return sum(t.nbytes for t in (self.k_codes, self.v_codes, self.k_scale, self.v_scale, self.k_offset,
                                      self.k_stage, self.v_stage))

    def stats(self) -> BlockStats:
        """Blocks free, used, shared and cached, and unfilled slots in used blocks."""
        return self.manager.stats()

    def stage_rows(self, slots: torch.Tensor, layer: int | torch.Tensor) -> torch.Tensor:
        """Rows of the staging tensors for a plan's slots in `layer`: slot s < P is the layer's own row
        `layer * P + s`; P + t is scratch row `L * P + t`, which every layer shares. (`layer` a column of layers
        `[L, 1]`: every layer's rows at once, `[L, len(slots)]`.)"""
        P = self.stage_slots
        return slots + torch.where(slots < P, layer * P, (self.num_layers - 1) * P)

    @property
    def staged_blocks(self) -> dict[int, int]:
        """Block -> staging slot of the blocks held exact (a copy)."""
        return dict(self._staged)

    # ---- host side: which block is staged where --------------------------------------------------

    def plan_step(self, chunks: Sequence[SeqChunk]) -> list[SeqChunk]:
        """Stage every block the chunks write (see the module docstring); return the chunks with the blocks that
        stay staged after the step named `num_blocks + slot` (the blocks the step fills are read as codes, as the
        quantized cache reads a block in the step that fills it; a sequence's first block, its sink, stays
        staged). Raises `CacheFullError`, changing nothing, when staging runs out (the engine sizes it so that it
        cannot)."""
        bs, n, P = self.block_size, self.code_blocks, self.stage_slots
        self.release_unheld()
        # (chunk, block index, first and last position written in the block)
        spans = [(c, j, max(c.start, j * bs), min(c.start + c.num_tokens, (j + 1) * bs)) for c in chunks
                 for j in range(c.start // bs, -(-(c.start + c.num_tokens) // bs))]
        # Blocks written from their first slot: staged across steps if they stay partly filled or are first blocks
        # (sinks), else quantized from a scratch row in this step.
        starting = [(j, last == (j + 1) * bs) for c, j, first, last in spans
                    if first == j * bs and c.block_table[j] not in self._staged]
        persistent = sum(1 for j, fills in starting if j == 0 or not fills)
        free, evictable = len(self._free_slots), self._evictable_sinks()
        if persistent > free + len(evictable) or len(starting) - persistent >= self.scratch_slots:
            raise CacheFullError(f"the step starts {persistent} blocks that stay staged and fills "
                                 f"{len(starting) - persistent} whole, but {free} of {self.stage_slots} staging "
                                 f"slots and {self.scratch_slots - 1} scratch slots are free; raise stage_slots / "
                                 "scratch_slots")
        for block in evictable[: max(persistent - free, 0)]:
            self._evict_sink(block)
        plan = StepPlan()
        write_slots: list[int] = []
        fresh: list[int] = []
        discard, scratch = P + self.scratch_slots - 1, P
        for c, j, first, last in spans:
            block = c.block_table[j]
            fills = last == (j + 1) * bs
            if block in self._sinks or (block not in self._staged and first > j * bs):
                # A full block written in the middle holds these very tokens: the last token of a prompt found
                # whole in the prefix cache, recomputed for its logits. What is stored stays (the write goes to the
                # discard row), so the request reads what the prefix's first run stored.
                write_slots += [discard] * (last - first)
                continue
            if block in self._staged:
                slot = self._staged[block]
                if first == j * bs:  # a block taken afresh that its last owner left staged: start it empty
                    fresh.append(slot)
            elif fills and j > 0:  # written whole by this step: quantized from a scratch row
                slot, scratch = scratch, scratch + 1
            else:
                slot = self._staged[block] = self._free_slots.pop()
                plan.taken.append(block)
                fresh.append(slot)
            write_slots += [slot] * (last - first)
            if fills and j == 0:
                plan.sealed.append(block)
            elif fills:
                plan.fill.append((slot, block))
        plan.fill_slots, plan.fill_blocks, plan.write_slots, plan.fresh_slots = long_tensors(
            [f[0] for f in plan.fill], [f[1] for f in plan.fill], write_slots, fresh, device=self.device)
        plan.writes, plan.fresh = write_slots, fresh
        self.plan = plan
        filled = {block for _, block in plan.fill}
        stays = {b: s for b, s in self._staged.items() if b not in filled}
        return [SeqChunk(c.start, c.num_tokens, [n + stays[b] if b in stays else b for b in c.block_table])
                for c in chunks]

    def padded_plan(self, batch: int) -> list[int]:
        """This step's plan padded to `batch` rows for a graph's static buffers, flat: write slots (padding rows
        write to the discard row), fresh slots, fill slots and fill blocks (padding zeroes and quantizes the spare
        slot into the spare block), `batch` of each. (Before any plan: padding only, as a graph's capture runs.)"""
        if self.spare_slot is None or self.spare_block is None:
            raise ValueError("a graph step pads its plan into the spare block and slot: allocate the pool with "
                             "spare_blocks=1")
        plan, spare = self.plan, self.spare_slot
        if len(plan.writes) > batch or len(plan.fresh) > batch or len(plan.fill) > batch:
            raise ValueError(f"the step's plan ({len(plan.writes)} writes, {len(plan.fresh)} fresh slots, "
                             f"{len(plan.fill)} fills) does not fit a graph of {batch} rows")
        discard = self.stage_slots + self.scratch_slots - 1

        def pad(values: list[int], fill: int) -> list[int]:
            return values + [fill] * (batch - len(values))

        return [*pad(plan.writes, discard), *pad(plan.fresh, spare), *pad([s for s, _ in plan.fill], spare),
                *pad([b for _, b in plan.fill], self.spare_block)]

    def use_padded_plan(self, static: torch.Tensor) -> None:
        """Read this step's plan from a graph's static buffer `[4, batch]` holding `padded_plan`'s values: the
        layers' writes, zeroing and quantizing read those tensors (a captured graph reads them at every replay)."""
        plan = self.plan
        plan.write_slots, plan.fresh_slots, plan.fill_slots, plan.fill_blocks = static
        plan.padded = True

    def release_unheld(self) -> None:
        """Staged blocks no sequence holds any more (their request finished or was preempted) give their slots
        back, except sinks the prefix cache can still find (a later prompt starting the same way reads them); a
        sink handed out for other content is a sink no longer."""
        manager = self.manager
        for block in [b for b, generation in self._sinks.items() if manager.generation(b) != generation]:
            del self._sinks[block]
        for block in [b for b in self._staged if manager.ref_count(b) == 0
                      and not (b in self._sinks and manager.is_cached(b))]:
            self._free_slots.append(self._staged.pop(block))
            self._sinks.pop(block, None)

    def _evictable_sinks(self) -> list[int]:
        """Sinks only the prefix cache holds (after `release_unheld`), oldest first: their slots can be had by
        forgetting them (a later prompt starting the same way recomputes them)."""
        return [b for b in self._sinks if self.manager.ref_count(b) == 0]

    def _evict_sink(self, block: int) -> None:
        self.manager.forget(block)
        del self._sinks[block]
        self._free_slots.append(self._staged.pop(block))

    def commit_step(self) -> None:
        """The step ran: the blocks it filled are codes now and give their slots back; the first blocks it filled
        are sinks from now on."""
        for slot, block in self.plan.fill:
            if slot < self.stage_slots and self._staged.get(block) == slot:
                del self._staged[block]
                self._free_slots.append(slot)
        for block in self.plan.sealed:
            self._sinks[block] = self.manager.generation(block)
        self.plan = StepPlan()

    def abort_step(self) -> None:
        """The step raised: give back the slots it took (its blocks are as they were: staged ones still hold
        their tokens, the rest their codes; sinks it had to evict stay forgotten)."""
        for block in self.plan.taken:
            self._free_slots.append(self._staged.pop(block))
        self.plan = StepPlan()

    def copy_blocks(self, copies: Sequence[CopyOnWrite]) -> None:
        """Do the allocator's copy-on-write copies: codes, scales and offsets in every layer, and the staging of a
        staged source (a block copied while partly filled, or a sink, stays exact in its copy). Raises
        `CacheFullError`, copying nothing, when a staged source finds no free slot."""
        if not copies:
            return
        for c in copies:  # the destination was free: a slot it kept is stale
            if c.dst in self._staged:
                self._free_slots.append(self._staged.pop(c.dst))
                self._sinks.pop(c.dst, None)
        staged_src = [c for c in copies if c.src in self._staged]
        evictable = [b for b in self._evictable_sinks() if b not in {c.src for c in copies}]
        if len(staged_src) > len(self._free_slots) + len(evictable):
            raise CacheFullError(f"copy-on-write of {len(staged_src)} staged blocks needs as many staging "
                                 f"slots; {len(self._free_slots)} are free")
        for block in evictable[: max(len(staged_src) - len(self._free_slots), 0)]:
            self._evict_sink(block)
        src = torch.tensor([c.src for c in copies], device=self.device)
        dst = torch.tensor([c.dst for c in copies], device=self.device)
        for t in (self.k_codes, self.v_codes, self.k_scale, self.v_scale, self.k_offset):
            t[:, dst] = t[:, src]
        for c in staged_src:
            slot = self._free_slots.pop()
            self._staged[c.dst] = slot
            self.k_persistent[:, slot] = self.k_persistent[:, self._staged[c.src]]
            self.v_persistent[:, slot] = self.v_persistent[:, self._staged[c.src]]
            if c.src in self._sinks:
                self._sinks[c.dst] = self.manager.generation(c.dst)


class QuantizedPoolLayer:
    """One layer of a `QuantizedPagedPool`, as the ragged batch's attention reads and writes it."""

    def __init__(self, pool: QuantizedPagedPool, layer: int) -> None:
        self.pool, self.layer = pool, layer

    def write(self, batch: RaggedBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stage this step's `k`, `v` `[1, Hkv, N, D]` where `plan_step` put each token, then quantize the blocks
        the step fills."""
        pool, plan, i = self.pool, self.pool.plan, self.layer
        if plan.write_slots is None or plan.write_slots.shape[0] != k.shape[2]:
            raise ValueError(f"the step's {k.shape[2]} tokens were not planned (QuantizedPagedPool.plan_step)")
        rows = pool.stage_rows(plan.write_slots, i)
        pool.k_stage.index_fill_(0, plan.fresh_slots + i * pool.stage_slots, 0)
        pool.v_stage.index_fill_(0, plan.fresh_slots + i * pool.stage_slots, 0)
        # Index tensors around the head slice put N first: the target is [N, Hkv, D].
        pool.k_stage[rows, :, batch.slot_offsets] = k[0].transpose(0, 1).to(pool.dtype)
        pool.v_stage[rows, :, batch.slot_offsets] = v[0].transpose(0, 1).to(pool.dtype)
        self.quantize_filled()

    def quantize_filled(self) -> None:
        """Quantize the blocks the step fills from their staging rows into this layer's codes and scales (after its
        writes: `write`, or the batched whole-step call, which calls back here unless it quantizes them itself):
        natively on a CPU (`native_quantizer`), else by the torch code below, its formula."""
        pool, plan, i = self.pool, self.pool.plan, self.layer
        if not plan.quantizes:
            return
        filled = pool.stage_rows(plan.fill_slots, i)
        if pool.quantizer is not None:
            pool.quantizer.quantize_blocks((pool.k_stage, pool.v_stage), filled, plan.fill_blocks,
                                           (pool.k_codes[i], pool.v_codes[i]), (pool.k_scale[i], pool.v_scale[i]),
                                           pool.k_offset[i] if pool.key_offsets else None, pool.rotation, pool.scheme)
            return
        keys = pool.k_stage[filled]
        centres = quant.channel_offsets(keys) if pool.key_offsets else None
        codes, scales = quant.quantize_channels(keys, pool.scheme, centres)
        pool.k_codes[i][plan.fill_blocks], pool.k_scale[i][plan.fill_blocks] = codes, scales
        if centres is not None:
            pool.k_offset[i][plan.fill_blocks] = centres
        values = pool.v_stage[filled]
        codes, scales = SCHEMES[pool.scheme][0](values if pool.rotation is None
                                                else quant.rotate(values, pool.rotation))
        pool.v_codes[i][plan.fill_blocks], pool.v_scale[i][plan.fill_blocks] = codes, scales

    def gather(self, tables: torch.Tensor, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of block tables `[B, nb]` in position order, `[B, Hkv, length, D]` each: codes
        dequantized, staged blocks exact."""
        pool, i = self.pool, self.layer
        ids = tables.reshape(-1)
        staged = ids >= pool.code_blocks
        code_ids = torch.where(staged, torch.zeros_like(ids), ids)
        slot_ids = torch.where(staged, ids - pool.code_blocks, torch.zeros_like(ids))
        where = staged[:, None, None, None]
        keys = torch.where(where, pool.k_persistent[i].index_select(0, slot_ids),
                           quant.dequantize_channels(pool.k_codes[i].index_select(0, code_ids),
                                                     pool.k_scale[i].index_select(0, code_ids), pool.scheme,
                                                     pool.dtype, pool.k_offset[i].index_select(0, code_ids)
                                                     if pool.key_offsets else None))
        values = torch.where(where, pool.v_persistent[i].index_select(0, slot_ids),
                             _dequantize_rows(pool, pool.v_codes[i].index_select(0, code_ids),
                                              pool.v_scale[i].index_select(0, code_ids)))
        B, nb = tables.shape
        Hkv, bs, D = keys.shape[1:]

        def in_order(blocks: torch.Tensor) -> torch.Tensor:
            return blocks.view(B, nb, Hkv, bs, D).transpose(1, 2).reshape(B, Hkv, nb * bs, D)[:, :, :length]

        return in_order(keys), in_order(values)

    def decode_attention(self, group: DecodeGroup, q: torch.Tensor, scale: float, softcap: float | None,
                         window: int | None) -> torch.Tensor:
        """The decode group's queries `q` `[B, H, D]` over this layer's codes and staged blocks in place (no
        gather, no dequantized copy), in the group's kernel: the native CPU one, or "triton"'s: `[B, H, D]`."""
        pool, i = self.pool, self.layer
        if group.starts is None:
            raise ValueError("the decode group has no table starts: build it with build_ragged_batch")
        if group.kernel == "triton":
            from infer.kernels.quantized_attention import quantized_paged_decode_attention

            return quantized_paged_decode_attention(
                q.contiguous(), (pool.k_codes[i], pool.v_codes[i]), (pool.k_scale[i], pool.v_scale[i]),
                (pool.k_persistent[i], pool.v_persistent[i]), group.tables, group.lengths, group.starts,
                pool.scheme, scale, softcap, window, key_offsets=pool.k_offset[i] if pool.key_offsets else None,
                value_rotation=pool.rotation)
        from infer.kernels.native import native_kernels

        kernels = native_kernels()
        if kernels is None:
            raise ValueError("decode_attention='native' needs the native kernels, which did not build here")
        return kernels.quantized_attention_paged(
            q, (pool.k_codes[i], pool.v_codes[i]), (pool.k_scale[i], pool.v_scale[i]),
            pool.k_offset[i] if pool.key_offsets else None, pool.rotation, (pool.k_persistent[i], pool.v_persistent[i]),
            group.tables, group.lengths, group.starts, pool.scheme, scale, softcap, window).to(q.dtype)


def _dequantize_rows(pool: QuantizedPagedPool, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Value rows of blocks, rotated back where the scheme stores them rotated."""
    if pool.rotation is None:
        return SCHEMES[pool.scheme][1](codes, scales, pool.dtype)
    return quant.rotate(SCHEMES[pool.scheme][1](codes, scales, torch.float32), pool.rotation).to(pool.dtype)


def staging_for(max_num_seqs: int, max_num_batched_tokens: int, block_size: int) -> tuple[int, int]:
    """(stage_slots, scratch_slots) that never run out. A running request holds at most two staged blocks between
    steps (its sink, unless shared, and its partly filled last block) and in a step one more only when its chunk
    fills a staged block and starts the next: a prompt chunk continuing where the token budget cut it, which the
    scheduler leaves to one request at a time (the last it fits in a step; the next step continues it before
    admitting another). Sinks only the prefix cache holds are forgotten when their slots are needed. A step
    writes at most a block's worth of tokens into each block it fills whole; one more scratch row takes the writes
    that change nothing."""
    return 2 * max_num_seqs + 1, max_num_batched_tokens // block_size + 1
