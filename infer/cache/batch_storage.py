"""The batched engine's KV storage: the paged pool, the sliding layers' rings, and which layers read which.

`BatchStorage.allocate` sizes and builds it for a model: full-attention layers (every layer, without
`bound_sliding_layers`) keep their K/V in one `PagedKVPool`; sliding-window layers (Gemma 3's local ones) in
per-request `SlidingRings`, whose memory is bounded by window + chunk whatever the context. Each block space
is a `TableSet`: its tensors, the model layers reading it, their windows, and a spare block no sequence owns
(written by the padding rows of graph-captured steps). `block_tables` gives each scheduled chunk its table in
every set: the one place a request's blocks become tables. The engine holds this and never touches tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from infer.cache.base import allocate_zeros
from infer.cache.paged import PagedKVPool
from infer.cache.paged_quantized import KV_CACHE_DTYPES, QuantizedPagedPool, QuantizedPoolLayer, staging_for
from infer.config import ModelConfig
from infer.memory import available_memory
from infer.ragged import SeqChunk
from infer.scheduler import PoolTooSmall, ScheduledChunk

# One layer's blocks: K and V tensors `[blocks, Hkv, block_size, D]`, or a quantized pool's layer (both).
LayerBlocks = torch.Tensor | QuantizedPoolLayer

# Share of the memory left on the device that a default pool takes (the rest: activations, other work),
# and on a CPU at most 4 GiB (vLLM's CPU default), which holds thousands of blocks for the shapes served here.
DEFAULT_POOL_SHARE = {"cpu": 0.25, "cuda": 0.7}
DEFAULT_CPU_POOL_CAP = 4 * 2**30


@dataclass
class SlidingRings:
    """K/V of the sliding-window layers: each running request owns a ring of `blocks_per_ring` blocks, and
    logical block j of its sequence lives in ring block j mod `blocks_per_ring`. The ring spans window +
    chunk + a block, so a chunk's writes never overwrite a key one of its queries still sees, and a block
    that is started (zeroed, infer/ragged.py) only held keys that every query has left behind. Block
    tables built from it alias older logical blocks to newer ones; attention masks those by position."""

    k: torch.Tensor  # [layers, num_rings * blocks_per_ring, Hkv, block_size, D]
    v: torch.Tensor
    blocks_per_ring: int
    free: list[int]  # ring indices
    owner: dict[int, int] = field(default_factory=dict)  # request id -> ring index

    @classmethod
    def allocate(cls, num_layers: int, num_rings: int, window: int, chunk: int, block_size: int,
                 config: ModelConfig, dtype: torch.dtype, device: torch.device, spare_blocks: int = 0
                 ) -> SlidingRings:
        """Rings for `num_rings` running requests, attending `window` keys in chunks of up to `chunk` tokens;
        `spare_blocks` more after them that no ring uses (as PagedKVPool's)."""
        per_ring = -(-(window + chunk - 1) // block_size) + 1
        shape = (num_layers, num_rings * per_ring + spare_blocks, config.num_key_value_heads, block_size,
                 config.head_dim)
        k, v = allocate_zeros("the sliding layers' rings", device, (shape, dtype), (shape, dtype))
        return cls(k, v, per_ring, list(range(num_rings - 1, -1, -1)))

    @property
    def memory_bytes(self) -> int:
        """Bytes of the ring tensors."""
        return self.k.nbytes + self.v.nbytes

    def acquire(self, request_id: int) -> None:
        """Give a newly scheduled request a ring (no-op if it has one). The scheduler never runs more requests
        than there are rings."""
        if request_id not in self.owner:
            self.owner[request_id] = self.free.pop()

    def release(self, request_id: int) -> None:
        """Take a finished or preempted request's ring back (no-op if it has none)."""
        ring = self.owner.pop(request_id, None)
        if ring is not None:
            self.free.append(ring)

    def table(self, request_id: int, num_tokens: int) -> list[int]:
        """The block table of the request's first `num_tokens` positions, through its ring."""
        base = self.owner[request_id] * self.blocks_per_ring
        return [base + j % self.blocks_per_ring for j in range(-(-num_tokens // self.k.shape[3]))]


@dataclass(frozen=True)
class TableSet:
    """A block space sequences have tables in: its K/V `[len(layers), blocks, Hkv, block_size, D]`, the model
    layers reading it, their distinct windows (None: full attention), and its spare block (the last one, that
    no sequence owns) when graph steps need one."""

    k: torch.Tensor | list[QuantizedPoolLayer]  # a quantized pool: its layers (which hold K and V), as v too
    v: torch.Tensor | list[QuantizedPoolLayer]
    layers: list[int]
    windows: list[int | None]
    spare: int | None


@dataclass
class BatchStorage:
    """The pool, the rings (if any) and their table sets, built by `allocate`."""

    pool: PagedKVPool | QuantizedPagedPool
    ring: SlidingRings | None
    table_sets: list[TableSet]
    ring_layers: list[int]
    pool_layers: list[int]
    _layer_blocks: list[tuple[int, LayerBlocks, LayerBlocks]] = field(default_factory=list)

    @classmethod
    def allocate(cls, config: ModelConfig, windows: Sequence[int | None], *, dtype: torch.dtype,
                 device: torch.device, block_size: int, num_blocks: int | None, cache_memory: int | None,
                 max_num_seqs: int, max_num_batched_tokens: int, bound_sliding_layers: bool,
                 spare_blocks: int = 0, kv_cache_dtype: str | None = None,
                 agree_blocks: Callable[[int], int] | None = None, huge_pages: bool = True) -> BatchStorage:
        """Storage for a model whose layer i has sliding window `windows[i]`: rings for the sliding layers
        when `bound_sliding_layers`, the pool for the rest, `num_blocks` blocks or as many as `cache_memory`
        bytes hold after the rings (default: `default_num_blocks`). `spare_blocks` more in each set.
        `kv_cache_dtype` ("int8", "int4", "fp4"): the pool's blocks quantized (`QuantizedPagedPool`, with its
        staging counted in `cache_memory`); the rings stay exact. `agree_blocks`: the number of blocks every rank
        of a tensor-parallel group can hold, from this rank's (their pools must mirror each other). `huge_pages`:
        an exact pool on transparent huge pages where the kernel allows (PagedKVPool)."""
        ring_layers = [i for i, w in enumerate(windows) if w is not None] if bound_sliding_layers else []
        pool_layers = [i for i in range(len(windows)) if i not in ring_layers]
        ring = None
        if ring_layers:
            window = max(w for w in windows if w is not None)
            ring = SlidingRings.allocate(len(ring_layers), max(max_num_seqs, 1), window,
                                         max(max_num_batched_tokens, 1), block_size, config, dtype, device,
                                         spare_blocks)
        block_bytes = (2 * len(pool_layers) * config.num_key_value_heads * block_size * config.head_dim
                       * dtype.itemsize) or 1
        stage_slots, scratch_slots = staging_for(max(max_num_seqs, 1), max(max_num_batched_tokens, 1), block_size)
        stage_bytes = 0
        if kv_cache_dtype is not None:
            if kv_cache_dtype not in KV_CACHE_DTYPES:
                raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))} or None "
                                 f"(the model's dtype), got {kv_cache_dtype!r}")
            # A slot holds one exact block in every layer; a scratch row one layer's.
            stage_bytes = ((stage_slots + spare_blocks) * block_bytes
                           + scratch_slots * block_bytes // max(len(pool_layers), 1))
            block_bytes = QuantizedPagedPool.block_bytes(config, kv_cache_dtype, block_size, len(pool_layers)) or 1
        if num_blocks is None:
            # Fixed costs first: the sliding layers' rings, a quantized pool's staging, the graphs' spare block.
            ring_bytes = (ring.memory_bytes if ring is not None else 0) + stage_bytes + spare_blocks * block_bytes
            if ring_bytes and cache_memory is not None and cache_memory - ring_bytes < block_bytes:
                fixed = [f"{what} ({size} bytes)" for what, size in (
                    ("the sliding layers' rings", ring.memory_bytes if ring is not None else 0),
                    ("the quantized pool's staging", stage_bytes),
                    ("the decode graphs' spare block", spare_blocks * block_bytes)) if size]
                raise ValueError(f"cache_memory={cache_memory} bytes holds no KV block of {block_bytes} bytes beside "
                                 f"{' and '.join(fixed)}; raise it")
            num_blocks = default_num_blocks(block_bytes, block_size, config.max_position_embeddings,
                                            max_num_seqs, device,
                                            None if cache_memory is None else cache_memory - ring_bytes)
        if agree_blocks is not None:
            num_blocks = agree_blocks(num_blocks)
        pool_windows = sorted({windows[i] for i in pool_layers}, key=lambda w: -1 if w is None else w)
        spare = (lambda k: k.shape[1] - 1) if spare_blocks else (lambda k: None)
        pool: PagedKVPool | QuantizedPagedPool
        if kv_cache_dtype is not None:
            pool = QuantizedPagedPool(config, scheme=kv_cache_dtype, num_blocks=num_blocks, block_size=block_size,
                                      stage_slots=stage_slots, scratch_slots=scratch_slots, dtype=dtype,
                                      device=device, num_layers=len(pool_layers), spare_blocks=spare_blocks)
            sets = [TableSet(pool.layers, pool.layers, pool_layers, pool_windows, pool.spare_block)]
        else:
            pool = PagedKVPool(config, num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=device,
                               num_layers=len(pool_layers), spare_blocks=spare_blocks, huge_pages=huge_pages)
            sets = [TableSet(pool.k_blocks, pool.v_blocks, pool_layers, pool_windows, spare(pool.k_blocks))]
        if ring is not None:
            ring_windows: list[int | None] = [*sorted({w for i in ring_layers if (w := windows[i]) is not None})]
            sets.append(TableSet(ring.k, ring.v, ring_layers, ring_windows, spare(ring.k)))
        return cls(pool, ring, sets, ring_layers, pool_layers)

    @property
    def memory_bytes(self) -> int:
        """Bytes of the KV storage: the pool, and the sliding layers' rings."""
        return self.pool.memory_bytes + (self.ring.memory_bytes if self.ring is not None else 0)

    def layer_blocks(self) -> list[tuple[int, LayerBlocks, LayerBlocks]]:
        """Per model layer, in order: (its table set, its K blocks, its V blocks); views made once."""
        if not self._layer_blocks:
            layers = {layer: (s, ts.k[j], ts.v[j]) for s, ts in enumerate(self.table_sets)
                      for j, layer in enumerate(ts.layers)}
            self._layer_blocks = [layers[i] for i in range(len(layers))]
        return self._layer_blocks

    def schedule(self, preempted: Sequence[int], chunks: Sequence[ScheduledChunk]) -> None:
        """Follow a step's plan: preempted requests give their rings back (and a quantized pool the staging of
        their blocks), scheduled ones get one."""
        if isinstance(self.pool, QuantizedPagedPool):
            self.pool.release_unheld()
        if self.ring is not None:
            for rid in preempted:
                self.ring.release(rid)
            for chunk in chunks:
                self.ring.acquire(chunk.request_id)

    def release(self, request_id: int) -> None:
        """A finished request gives its ring back, and a quantized pool the staging of its blocks (its pool blocks
        go through the scheduler)."""
        if isinstance(self.pool, QuantizedPagedPool):
            self.pool.release_unheld()
        if self.ring is not None:
            self.ring.release(request_id)

    def block_tables(self, chunks: Sequence[ScheduledChunk]) -> list[list[SeqChunk]]:
        """Per table set, each chunk with its block table there: the pool's, then the rings'. A quantized pool
        plans its staging for the step here (`commit_step` / `abort_step` end it)."""
        manager = self.pool.manager
        sets = [[SeqChunk(c.start, c.num_tokens, manager.block_table(c.request_id)) for c in chunks]]
        if isinstance(self.pool, QuantizedPagedPool):
            sets[0] = self.pool.plan_step(sets[0])
        if self.ring is not None:
            ring = self.ring
            sets.append([SeqChunk(c.start, c.num_tokens, ring.table(c.request_id, c.start + c.num_tokens))
                         for c in chunks])
        return sets


    def commit_step(self) -> None:
        """The step planned by `block_tables` ran."""
        if isinstance(self.pool, QuantizedPagedPool):
            self.pool.commit_step()

    def abort_step(self) -> None:
        """The step planned by `block_tables` raised: undo its plan."""
        if isinstance(self.pool, QuantizedPagedPool):
            self.pool.abort_step()


def default_num_blocks(block_bytes: int, block_size: int, context: int, max_num_seqs: int, device: torch.device,
                       cache_memory: int | None) -> int:
    """Blocks for a pool: `cache_memory` bytes when given; else enough for `max_num_seqs` requests at the
    model's full context, capped at a share of the memory the device has left."""
    if cache_memory is not None:
        blocks = cache_memory // block_bytes
        if blocks < 1:
            raise ValueError(f"cache_memory={cache_memory} bytes holds no KV block of {block_bytes} bytes; "
                             "raise it")
        return int(blocks)
    wanted = max_num_seqs * -(-context // block_size)
    free = available_memory(device)
    if free is not None:
        share = int(free * DEFAULT_POOL_SHARE.get(device.type, 0.25))
        if device.type == "cpu":
            share = min(share, DEFAULT_CPU_POOL_CAP)
        wanted = min(wanted, share // block_bytes)
    if wanted < 1:
        raise PoolTooSmall(f"the device has too little free memory for one KV block of {block_bytes} bytes")
    return wanted
