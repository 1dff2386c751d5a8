"""The paged cache: many sequences in one pool of fixed-size KV blocks, sharing prompt prefixes.

`PagedKVPool` owns the tensors `[L, num_blocks, Hkv, block_size, D]` and a `BlockManager` (the
pure-Python allocator); `PagedCache` is a batch of sequences in that pool behind the `KVCache`
protocol. Attention stays the model's ordinary attention: `update` gathers each sequence's keys and
values from its own block table into `[B, Hkv, S, D]`, so results are exactly those of a
contiguous cache, and a block another sequence freed is never read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infer.cache.base import (
    FLOAT,
    CacheSnapshot,
    allocate_zeros,
    check_advance,
    check_cache_size,
    check_counts,
    check_kv_shape,
    check_layer,
    check_snapshot,
    check_snapshot_tensors,
)
from infer.cache.block_manager import BlockManager, BlockStats, CopyOnWrite, PoolExhaustedError
from infer.config import ModelConfig
from infer.errors import CacheFullError

DEFAULT_BLOCK_SIZE = 16


class PagedKVPool:
    """Block tensors for every layer, plus the allocator deciding which sequence owns which block."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_layers: int | None = None,
        spare_blocks: int = 0,
        huge_pages: bool = True,
    ) -> None:
        check_counts(num_blocks=num_blocks, block_size=block_size)
        check_cache_size(1, 1, dtype)
        # num_layers: the layers the pool serves (default all; the batched engine keeps Gemma 3's sliding
        # layers out of it, in rings bounded by the window).
        num_layers = config.num_hidden_layers if num_layers is None else num_layers
        # spare_blocks: blocks after the managed ones that the allocator never hands out (the batched engine's
        # graph-captured steps write their padding rows there).
        shape = (num_layers, num_blocks + spare_blocks, config.num_key_value_heads, block_size, config.head_dim)
        # k_blocks, v_blocks: [L, N, Hkv, block_size, D]. Checked against free memory (with the block
        # manager's per-block bookkeeping) before either the tensors or the per-block objects exist.
        # huge_pages: on the CPU, in maps on transparent huge pages. The allocator hands blocks out in order, so a
        # run's first touch of each layer's next blocks faulted in 4 KiB pages (a block of one layer is two at
        # the 150M model's heads): 2.5-3.8 ms of a 44-request decode step zeroing fresh blocks on a 2-core EPYC,
        # about 1 ms on 2 MiB pages (a fault per 256 such blocks).
        self.k_blocks, self.v_blocks = allocate_zeros(
            "a paged pool", device, (shape, dtype), (shape, dtype), extra_bytes=num_blocks * BLOCK_BOOKKEEPING_BYTES,
            huge_pages=huge_pages,
        )
        self.manager = BlockManager(num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = num_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self._next_seq_id = 0

    @property
    def dtype(self) -> torch.dtype:
        """Element type of the block tensors."""
        return self.k_blocks.dtype

    @property
    def device(self) -> torch.device:
        """Where the block tensors live."""
        return self.k_blocks.device

    @property
    def memory_bytes(self) -> int:
        """Bytes of the two block tensors (the whole pool)."""
        return self.k_blocks.nbytes + self.v_blocks.nbytes

    def stats(self) -> BlockStats:
        """Blocks free, used, shared and cached, and unfilled slots in used blocks."""
        return self.manager.stats()

    def check_fits(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        """Raise a ValueError when a model with `config`, in `dtype` on `device`, cannot use this pool."""
        shape = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
        if shape != (self.num_layers, self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"the pool was built for (layers, kv_heads, head_dim) = "
                f"{(self.num_layers, self.num_kv_heads, self.head_dim)}, the model has {shape}"
            )
        if dtype != self.dtype or torch.device(device).type != self.device.type:
            raise ValueError(
                f"the pool holds {self.dtype} on {self.device}, asked for {dtype} on {device}: "
                "pass the pool's dtype and device"
            )

    def new_sequence(
        self, prompt_token_ids: Sequence[int] | None = None, *, max_seq_len: int | None = None
    ) -> PagedCache:
        """A batch-1 cache for a new sequence. With `prompt_token_ids`, the cached full blocks its
        prompt starts with are shared and `offset` starts past them: prefill `prompt[offset:]`."""
        capacity = self.num_blocks * self.block_size
        max_seq_len = capacity if max_seq_len is None else max_seq_len
        check_cache_size(max_seq_len, 1)
        prompt = _token_id_list(prompt_token_ids, "prompt_token_ids") if prompt_token_ids is not None else []
        if len(prompt) > max_seq_len:
            raise CacheFullError(f"the prompt has {len(prompt)} tokens but max_seq_len is {max_seq_len}")
        seq_id = self._new_seq_id()
        num_cached = self.manager.new_sequence(seq_id, prompt)
        return PagedCache(self, [seq_id], max_seq_len=max_seq_len, offset=num_cached, token_ids=prompt)

    def new_batch(self, batch_size: int, *, max_seq_len: int) -> PagedCache:
        """An empty cache for `batch_size` new sequences that advance together (no prefix sharing)."""
        check_cache_size(max_seq_len, batch_size)
        seq_ids = [self._new_seq_id() for _ in range(batch_size)]
        for seq_id in seq_ids:
            self.manager.new_sequence(seq_id)
        token_ids: list[int] | None = [] if batch_size == 1 else None
        return PagedCache(self, seq_ids, max_seq_len=max_seq_len, offset=0, token_ids=token_ids)

    def copy_blocks(self, copies: Sequence[CopyOnWrite]) -> None:
        """Do the allocator's copy-on-write copies, in every layer."""
        if not copies:
            return
        src = torch.tensor([c.src for c in copies], device=self.device)
        dst = torch.tensor([c.dst for c in copies], device=self.device)
        self.k_blocks[:, dst] = self.k_blocks[:, src]
        self.v_blocks[:, dst] = self.v_blocks[:, src]

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1


class PagedCache:
    """A batch of sequences of equal length in a `PagedKVPool`, used like any `KVCache`.

    Build one with `pool.new_sequence`, `pool.new_batch` or `create_cache("paged", ...)`. Its blocks
    go back to the pool on `release()` (or `reset()`); until then they stay taken.
    """

    def __init__(
        self,
        pool: PagedKVPool,
        seq_ids: list[int],
        *,
        max_seq_len: int,
        offset: int,
        token_ids: list[int] | None,
    ) -> None:
        self.pool = pool
        self.seq_ids = seq_ids
        self.batch_size = len(seq_ids)
        self.max_seq_len = max_seq_len
        self._offset = offset
        self._num_reserved = offset  # slots taken from the allocator; > offset while a step is written
        # Known token ids from position 0 (batch 1 only); full blocks among the first `offset` are
        # registered for prefix sharing.
        self._token_ids = token_ids
        self.num_prefix_hit_tokens = offset
        self._released = False
        self._table: torch.Tensor | None = None  # [B, num_blocks_held], rebuilt when the tables change
        self._write_index: tuple[int, int, torch.Tensor, torch.Tensor] | None = None
        self._pending_layers: set[int] = set()  # layers written by the step in progress

    @property
    def offset(self) -> int:
        """Number of tokens cached."""
        return self._offset

    @property
    def token_ids(self) -> list[int] | None:
        """The sequence's known token ids (batch 1), or None when they are not tracked."""
        return None if self._token_ids is None else list(self._token_ids)

    def extend_token_ids(self, token_ids: Sequence[int]) -> None:
        """Tell the cache the next token ids of its (single) sequence, so its full blocks can be shared."""
        self._check_live()
        if self._token_ids is None:
            raise ValueError("token ids are tracked for batch-1 caches only")
        self._token_ids.extend(_token_id_list(token_ids, "token_ids"))
        self._register()

    def key_positions(self, layer: int, q_len: int) -> torch.Tensor:
        """Keys come back in order from position 0."""
        return torch.arange(self._offset + q_len, device=self.pool.device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write at `offset` through the block tables; return every valid position of this layer,
        gathered from this batch's own blocks."""
        self._check_live()
        check_layer(layer, self.pool.num_layers)
        check_kv_shape(k, v, self.batch_size, self.pool.num_kv_heads, self.pool.head_dim, self.pool.device)
        if layer in self._pending_layers:  # the last step stopped part-way: give back what it reserved
            self.discard_step()
        self._pending_layers.add(layer)
        end = self._offset + k.shape[2]
        if end > self.max_seq_len:
            raise CacheFullError(
                f"{k.shape[2]} new tokens after {self._offset} cached exceed max_seq_len={self.max_seq_len}; "
                "create the cache with a larger max_seq_len"
            )
        self._reserve(end)
        block_index, slot_index = self._slots(self._offset, k.shape[2])
        dtype = self.pool.dtype
        # Index tensors around the head slice put [B, T] first: the target is [B, T, Hkv, D].
        self.pool.k_blocks[layer, block_index, :, slot_index] = k.transpose(1, 2).to(dtype)
        self.pool.v_blocks[layer, block_index, :, slot_index] = v.transpose(1, 2).to(dtype)
        return self._gather(self.pool.k_blocks[layer], end), self._gather(self.pool.v_blocks[layer], end)

    def advance(self, n: int) -> None:
        """Count `n` more tokens as cached; register the blocks they filled when token ids are known."""
        self._check_live()
        check_advance(n, self._offset, self.max_seq_len)
        self._reserve(self._offset + n)
        self._offset += n
        self._pending_layers.clear()
        self._register()

    def reset(self) -> None:
        """Give every block back to the pool and start empty sequences (also revives a released cache)."""
        self._free_sequences()
        self.seq_ids = [self.pool._new_seq_id() for _ in range(self.batch_size)]
        for seq_id in self.seq_ids:
            self.pool.manager.new_sequence(seq_id)
        self._set_empty_state(0, [] if self._token_ids is not None else None)

    def release(self) -> None:
        """Give every block back to the pool; the cache cannot be used afterwards (until `reset`)."""
        if not self._released:
            self._free_sequences()

    @property
    def memory_bytes(self) -> int:
        """Bytes of the whole pool's tensors, which this cache shares with the pool's other sequences."""
        return self.pool.memory_bytes

    def stats(self) -> BlockStats:
        """The pool's block figures (see `BlockStats`)."""
        return self.pool.stats()

    def fork(self) -> PagedCache:
        """A new cache holding the same tokens and sharing all blocks; either one's writes copy first."""
        self._check_live()
        if self._num_reserved != self._offset:
            raise ValueError("cannot fork in the middle of a step: call advance() or discard_step() first")
        seq_ids = [self.pool._new_seq_id() for _ in self.seq_ids]
        for seq_id, new_id in zip(self.seq_ids, seq_ids, strict=True):
            self.pool.manager.fork(seq_id, new_id)
        token_ids = None if self._token_ids is None else list(self._token_ids)
        return PagedCache(self.pool, seq_ids, max_seq_len=self.max_seq_len, offset=self._offset, token_ids=token_ids)

    def snapshot(self) -> CacheSnapshot:
        """Copies of the cached K/V, gathered to `[L, B, Hkv, offset, D]`, and the token ids if known."""
        self._check_live()
        n = self._offset
        token_ids = None
        if self._token_ids is not None and len(self._token_ids) >= n:
            token_ids = self._token_ids[:n]
        return CacheSnapshot(
            kind="paged",
            offset=n,
            tensors={
                "k": self._gather_all(self.pool.k_blocks, n),
                "v": self._gather_all(self.pool.v_blocks, n),
            },
            token_ids=token_ids,
            meta={"block_size": self.pool.block_size},
        )

    def restore(self, snapshot: CacheSnapshot) -> None:
        """Replace the contents by a snapshot's K/V, written into freshly taken blocks. Raises
        `PoolExhaustedError`, changing nothing, when the pool cannot hold them."""
        check_snapshot(snapshot, "paged", self.max_seq_len)
        pool, manager = self.pool, self.pool.manager
        n = snapshot.offset
        expected = (pool.num_layers, self.batch_size, pool.num_kv_heads, n, pool.head_dim)
        t = check_snapshot_tensors(snapshot, {"k": (expected, FLOAT), "v": (expected, FLOAT)}, pool.k_blocks.device)
        k, v = t["k"], t["v"]
        known = snapshot.token_ids
        if known is not None and (
            len(known) != n or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in known)
        ):
            raise ValueError(f"snapshot token_ids must be {n} non-negative ints, one per cached token")
        needed = self.batch_size * manager.blocks_for(n)
        reclaimable = 0 if self._released else manager.num_reclaimable(self.seq_ids)
        if needed > manager.num_free + reclaimable:
            raise PoolExhaustedError(
                f"restoring {n} tokens x {self.batch_size} sequences needs {needed} KV blocks but only "
                f"{manager.num_free + reclaimable} of {manager.num_blocks} can be freed; raise num_blocks "
                "or free finished sequences"
            )
        self._free_sequences()
        self.seq_ids = [pool._new_seq_id() for _ in range(self.batch_size)]
        for seq_id in self.seq_ids:
            manager.new_sequence(seq_id)
            manager.append(seq_id, n)  # fresh blocks: no copies
        token_ids: list[int] | None = None
        if self.batch_size == 1:
            token_ids = list(snapshot.token_ids) if snapshot.token_ids is not None else []
        self._set_empty_state(n, token_ids)
        if n:
            block_index, slot_index = self._slots(0, n)
            for layer in range(pool.num_layers):
                pool.k_blocks[layer, block_index, :, slot_index] = k[layer].transpose(1, 2).to(pool.dtype)
                pool.v_blocks[layer, block_index, :, slot_index] = v[layer].transpose(1, 2).to(pool.dtype)
        self._register()

    # ---- internals --------------------------------------------------------------------------

    def _check_live(self) -> None:
        if self._released:
            raise ValueError("this PagedCache was released; its blocks may hold other sequences now (reset() it)")

    def _free_sequences(self) -> None:
        if not self._released:
            for seq_id in self.seq_ids:
                self.pool.manager.free(seq_id)
        self._released = True

    def discard_step(self) -> None:
        """Give back the slots of a step that stopped before `advance` (its writes past the offset are
        never read). Copy-on-write copies it made stay: they hold the same tokens."""
        if self._released:
            return
        if self._num_reserved > self._offset:
            for seq_id in self.seq_ids:
                self.pool.manager.truncate(seq_id, self._offset)
            self._num_reserved = self._offset
            self._table = None
            self._write_index = None
        self._pending_layers.clear()

    def _set_empty_state(self, offset: int, token_ids: list[int] | None) -> None:
        self._released = False
        self._offset = self._num_reserved = offset
        self._token_ids = token_ids
        self.num_prefix_hit_tokens = 0
        self._table = None
        self._write_index = None
        self._pending_layers = set()

    def _reserve(self, end: int) -> None:
        """Take slots up to position `end` for every row, all or nothing, doing copy-on-write copies."""
        n = end - self._num_reserved
        if n <= 0:
            return
        manager = self.pool.manager
        needed = sum(manager.num_blocks_to_append(seq_id, n) for seq_id in self.seq_ids)
        if needed > manager.num_free:
            raise PoolExhaustedError(
                f"{n} more tokens x {self.batch_size} sequences need {needed} free KV blocks but only "
                f"{manager.num_free} of {manager.num_blocks} are free; raise num_blocks or free finished "
                "sequences"
            )
        copies: list[CopyOnWrite] = []
        for seq_id in self.seq_ids:
            copies += manager.append(seq_id, n)
        self.pool.copy_blocks(copies)
        self._num_reserved = end
        self._table = None
        self._write_index = None

    def _block_table(self) -> torch.Tensor:
        """Block tables of the rows as one tensor `[B, num_blocks_held]` (rows hold equal numbers)."""
        if self._table is None:
            tables = [self.pool.manager.block_table(seq_id) for seq_id in self.seq_ids]
            self._table = torch.tensor(tables, dtype=torch.long, device=self.pool.device)
        return self._table

    def _slots(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Physical block `[B, T]` and slot in the block `[T]` of positions `start .. start+length-1`;
        kept while the step's layers all write the same positions."""
        cached = self._write_index
        if cached is not None and cached[:2] == (start, length):
            return cached[2], cached[3]
        bs = self.pool.block_size
        positions = torch.arange(start, start + length, device=self.pool.device)
        block_index = self._block_table()[:, positions // bs]
        slot_index = positions % bs
        self._write_index = (start, length, block_index, slot_index)
        return block_index, slot_index

    def _gather(self, layer_blocks: torch.Tensor, end: int) -> torch.Tensor:
        """Positions `0 .. end-1` of one layer: `[N, Hkv, bs, D]` -> `[B, Hkv, end, D]`."""
        table = self._block_table()
        blocks = layer_blocks[table]  # [B, nb, Hkv, bs, D]
        B, nb, Hkv, bs, D = blocks.shape
        return blocks.transpose(1, 2).reshape(B, Hkv, nb * bs, D)[:, :, :end]

    def _gather_all(self, pool_blocks: torch.Tensor, end: int) -> torch.Tensor:
        """Positions `0 .. end-1` of every layer, as a copy: `[L, N, Hkv, bs, D]` -> `[L, B, Hkv, end, D]`."""
        table = self._block_table()
        blocks = pool_blocks[:, table]  # [L, B, nb, Hkv, bs, D]
        L, B, nb, Hkv, bs, D = blocks.shape
        return blocks.permute(0, 1, 3, 2, 4, 5).reshape(L, B, Hkv, nb * bs, D)[:, :, :, :end].clone()

    def _register(self) -> None:
        if self._token_ids is None or not self._token_ids:
            return
        tokens = self._token_ids if len(self._token_ids) <= self._offset else self._token_ids[: self._offset]
        self.pool.manager.register_full_blocks(self.seq_ids[0], tokens)


# Python-side bytes per block in the block manager (free list entry, ref count, hash maps), for the memory check.
BLOCK_BOOKKEEPING_BYTES = 200


def _token_id_list(token_ids: object, name: str) -> list[int]:
    if not isinstance(token_ids, (list, tuple, range)):
        raise TypeError(f"{name} must be a list of token ids, got {type(token_ids).__name__}")
    ids = list(token_ids)
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise TypeError(f"{name} must be non-negative ints, got {ids[:8]}")
    return ids


def create_paged_cache(
    config: ModelConfig,
    *,
    max_seq_len: int,
    batch_size: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    block_size: int | None = None,
    num_blocks: int | None = None,
    pool: PagedKVPool | None = None,
) -> PagedCache:
    """The `create_cache("paged", ...)` factory: a batch in `pool`, or in a pool of its own with
    `block_size` (16 by default) and `num_blocks` (default: enough for every row to reach max_seq_len)."""
    check_cache_size(max_seq_len, batch_size)
    if pool is None:
        block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
        check_counts(block_size=block_size)
        if num_blocks is None:
            num_blocks = batch_size * -(-max_seq_len // block_size)
        pool = PagedKVPool(config, num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=device)
    else:
        if block_size is not None or num_blocks is not None:
            raise ValueError("pass either pool or block_size/num_blocks: a given pool keeps its own sizes")
        pool.check_fits(config, dtype, device)
    return pool.new_batch(batch_size, max_seq_len=max_seq_len)
