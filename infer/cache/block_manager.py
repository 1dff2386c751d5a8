"""Bookkeeping for a pool of fixed-size KV blocks, in pure Python (no tensors, no torch).

It decides which physical block holds which slots of which sequence: a free deque, a reference
count per block, a block table per sequence, and a hash map from a full block's content to the
block holding it, so sequences with the same prompt prefix share those blocks. It never touches
K/V data: it tells the tensor side (`infer/cache/paged.py`) which blocks to copy before a write.
Modelled on nano-vllm's `block_manager.py`.

Positions `0 .. num_tokens - 1` of a sequence live in slot `p % block_size` of block
`block_table[p // block_size]`; the table always has exactly `ceil(num_tokens / block_size)` blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from infer.errors import CacheFullError


class PoolExhaustedError(CacheFullError):
    """The block pool has too few free blocks for a request; nothing was changed."""


@dataclass(frozen=True)
class CopyOnWrite:
    """Copy block `src` into block `dst` (every layer, K and V) before writing into `dst`."""

    src: int
    dst: int


@dataclass(frozen=True)
class BlockStats:
    """Pool occupancy. `waste_slots`: slots in used blocks that no live sequence has filled."""

    num_blocks: int
    blocks_free: int
    blocks_used: int
    blocks_shared: int  # held by more than one sequence
    blocks_cached: int  # free, but still findable by a prefix hit
    waste_slots: int


def block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block: chained through the parent's hash, so equal hashes mean equal prefixes
    (up to collisions, which `BlockManager` checks for)."""
    return hash((parent_hash, token_ids))


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    # Bumped each time the block is handed out for new content, so a child registered under an
    # older incarnation of this block can no longer be matched as its successor.
    generation: int = 0
    hash: int | None = None  # set once the block is full and its tokens are known
    token_ids: tuple[int, ...] = ()
    parent: tuple[int, int] | None = None  # (block id, generation) of the block before it


@dataclass
class _Sequence:
    block_table: list[int]
    num_tokens: int = 0
    num_registered_blocks: int = 0  # leading blocks whose content (hash, tokens) is recorded


class BlockManager:
    """Ref-counted blocks with prefix sharing. Every mutation either succeeds or raises with the
    state unchanged; each has a query to ask first (`can_allocate`, `can_append`)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self._seqs: dict[int, _Sequence] = {}
        self._num_shared = 0  # blocks with ref_count > 1, kept by `_hold` and `_drop` (the engine reads it each step)

    # ---- queries ----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (some may still serve prefix hits until handed out)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self._free)

    @property
    def num_shared(self) -> int:
        """Blocks held by more than one sequence."""
        return self._num_shared

    @property
    def waste_slots(self) -> int:
        """Slots of used blocks that hold no live sequence's token (the unfilled tails)."""
        # Every block of a table but its last is full (a table holds ceil(tokens / block_size) blocks), so only the
        # last blocks are walked one by one: the engine reads this every step (a walk of every slot was 0.4 ms at
        # 48 requests of ~200 tokens). With no block shared, each used block is in one table: no walk at all.
        bs = self.block_size
        if not self._num_shared:
            return sum(len(seq.block_table) * bs - seq.num_tokens for seq in self._seqs.values())
        full, tails = set[int](), dict[int, int]()
        for seq in self._seqs.values():
            table = seq.block_table
            if table:
                full.update(table[:-1])
                tail = seq.num_tokens - (len(table) - 1) * bs
                tails[table[-1]] = max(tails.get(table[-1], 0), tail)
        filled = sum(bs if b in full else n for b, n in tails.items())  # (a tail holds 1 .. bs tokens)
        return self.num_used * bs - filled - bs * len(full - tails.keys())

    def stats(self) -> BlockStats:
        """Occupancy figures in one object."""
        return BlockStats(
            num_blocks=self.num_blocks,
            blocks_free=self.num_free,
            blocks_used=self.num_used,
            blocks_shared=self.num_shared,
            blocks_cached=sum(1 for b in self._free if self.is_cached(b)),
            waste_slots=self.waste_slots,
        )

    @property
    def seq_ids(self) -> tuple[int, ...]:
        """Ids of the live sequences."""
        return tuple(self._seqs)

    def block_table(self, seq_id: int) -> tuple[int, ...]:
        """Physical block of each logical block of the sequence."""
        return tuple(self._seq(seq_id).block_table)

    def num_tokens(self, seq_id: int) -> int:
        """Slots the sequence has taken (cached or being written)."""
        return self._seq(seq_id).num_tokens

    def num_registered_blocks(self, seq_id: int) -> int:
        """Leading blocks of the sequence whose tokens are recorded (and hashed for sharing)."""
        return self._seq(seq_id).num_registered_blocks

    def ref_count(self, block_id: int) -> int:
        """Number of block tables holding the block."""
        return self._blocks[block_id].ref_count

    def free_block_ids(self) -> tuple[int, ...]:
        """Free blocks, in the order they will be handed out."""
        return tuple(self._free)

    def registered_token_ids(self, block_id: int) -> tuple[int, ...] | None:
        """The tokens a full block was registered with, or None if it was not registered."""
        block = self._blocks[block_id]
        return block.token_ids if block.hash is not None else None

    def is_cached(self, block_id: int) -> bool:
        """Whether a prefix hit can find this block (it is the hash map's entry for its content)."""
        block = self._blocks[block_id]
        return block.hash is not None and self._hash_to_block.get(block.hash) == block_id

    def generation(self, block_id: int) -> int:
        """How many times the block has been handed out for new content (a holder of an older count holds
        content the block no longer has)."""
        return self._blocks[block_id].generation

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of `num_tokens` tokens fits. Prefix hits only lower the need, so
        True also guarantees `new_sequence(prompt)` then `append` of the rest of that prompt."""
        return self.blocks_for(num_tokens) <= len(self._free)

    def num_blocks_to_append(self, seq_id: int, n: int) -> int:
        """Free blocks `append(seq_id, n)` would take: new blocks plus one copy if the partly filled
        last block is shared."""
        seq = self._seq(seq_id)
        if n < 0:
            raise ValueError(f"cannot append {n} tokens")
        if n == 0:
            return 0
        end = seq.num_tokens + n
        needed = self.blocks_for(end) - len(seq.block_table)
        if self._shared_block_to_write(seq) is not None:
            needed += 1
        return needed

    def can_append(self, seq_id: int, n: int) -> bool:
        """Whether `append(seq_id, n)` would succeed."""
        return self.num_blocks_to_append(seq_id, n) <= len(self._free)

    def num_reclaimable(self, seq_ids: Iterable[int]) -> int:
        """Blocks that `free` of all these sequences would return to the free list."""
        holders: dict[int, int] = {}
        for seq_id in set(seq_ids):
            for block_id in self._seq(seq_id).block_table:
                holders[block_id] = holders.get(block_id, 0) + 1
        return sum(1 for b, n in holders.items() if self._blocks[b].ref_count == n)

    # ---- mutations --------------------------------------------------------------------------

    def new_sequence(self, seq_id: int, prompt_token_ids: Sequence[int] = ()) -> int:
        """Start a sequence, sharing every cached full block its prompt starts with; return the number
        of prompt tokens already cached (at most `len(prompt) - 1`: the last prompt token must still
        be computed to get its logits, and its write may then copy a shared block)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already exists; free it first or use a new id")
        hits = self._match_prefix(prompt_token_ids)
        num_shared = min(len(hits) * self.block_size, max(len(prompt_token_ids) - 1, 0))
        hits = hits[: self.blocks_for(num_shared)]
        for block_id in hits:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                self._free.remove(block_id)  # revive a freed block whose content is still intact
            self._hold(block)
        self._seqs[seq_id] = _Sequence(hits, num_shared, num_registered_blocks=len(hits))
        return num_shared

    def append(self, seq_id: int, n: int) -> list[CopyOnWrite]:
        """Take slots for `n` more tokens, adding blocks as needed. If the partly filled last block is
        shared it is first replaced by a private copy; the returned copies must be done on the
        tensors before writing. Raises `PoolExhaustedError`, changing nothing, when blocks run out."""
        needed = self.num_blocks_to_append(seq_id, n)
        if needed > len(self._free):
            raise PoolExhaustedError(
                f"sequence {seq_id} needs {needed} free KV blocks for {n} more tokens but only "
                f"{len(self._free)} of {self.num_blocks} are free; raise num_blocks or free finished "
                "sequences"
            )
        if n == 0:
            return []
        seq = self._seq(seq_id)
        copies: list[CopyOnWrite] = []
        index = self._shared_block_to_write(seq)
        if index is not None:
            src = seq.block_table[index]
            dst = self._take_free_block()
            # The copy holds the same tokens, so it keeps the recorded content (not the map entry).
            src_block, dst_block = self._blocks[src], self._blocks[dst]
            dst_block.hash, dst_block.token_ids = src_block.hash, src_block.token_ids
            dst_block.parent = src_block.parent
            self._drop(src_block)
            seq.block_table[index] = dst
            copies.append(CopyOnWrite(src, dst))
        seq.num_tokens += n
        while len(seq.block_table) < self.blocks_for(seq.num_tokens):
            seq.block_table.append(self._take_free_block())
        return copies

    def register_full_blocks(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """Record the tokens of the sequence's full blocks so later prompts can share them.

        `token_ids` are the sequence's tokens from position 0 whose K/V are already written; blocks
        past them or past `num_tokens` are left alone. Returns how many blocks were newly registered.
        """
        seq = self._seq(seq_id)
        bs = self.block_size
        num_full = min(len(token_ids), seq.num_tokens) // bs
        registered = 0
        for i in range(seq.num_registered_blocks, num_full):
            block_id = seq.block_table[i]
            block = self._blocks[block_id]
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent: tuple[int, int] | None = None
            parent_hash: int | None = None
            if i > 0:
                prev = self._blocks[seq.block_table[i - 1]]
                parent, parent_hash = (prev.block_id, prev.generation), prev.hash
            if block.hash is not None:
                # Registered already through another holder (a fork): it must be the same content.
                if block.token_ids != tokens or block.parent != parent:
                    raise ValueError(
                        f"token ids of sequence {seq_id} at block {i} differ from the tokens its shared "
                        "block holds; pass the sequence's own tokens from position 0"
                    )
                continue
            block.hash = block_hash(parent_hash, tokens)
            block.token_ids, block.parent = tokens, parent
            # The newest holder wins the entry; an older identical block stays valid for its holders.
            self._hash_to_block[block.hash] = block_id
            registered += 1
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)
        return registered

    def fork(self, seq_id: int, new_seq_id: int) -> None:
        """Start `new_seq_id` as a copy of `seq_id` sharing all its blocks; writes copy them later."""
        seq = self._seq(seq_id)
        if new_seq_id in self._seqs:
            raise ValueError(f"sequence {new_seq_id} already exists; fork into a new id")
        for block_id in seq.block_table:
            self._hold(self._blocks[block_id])
        self._seqs[new_seq_id] = _Sequence(list(seq.block_table), seq.num_tokens, seq.num_registered_blocks)

    def free(self, seq_id: int) -> list[int]:
        """End a sequence; return the blocks that no sequence holds any more. Registered ones stay
        findable by prefix hits until they are handed out for other content."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        released: list[int] = []
        # Tail blocks first, so they are handed out before the prefix blocks more likely to be hit.
        for block_id in reversed(seq.block_table):
            block = self._blocks[block_id]
            self._drop(block)
            if block.ref_count == 0:
                self._free.append(block_id)
                released.append(block_id)
        return released

    def forget(self, block_id: int) -> None:
        """Drop a free block from the prefix cache: no later prompt can find it (nor the blocks cached after
        it, whose prefix it is). Raises `ValueError` for a block a sequence holds."""
        block = self._blocks[block_id]
        if block.ref_count:
            raise ValueError(f"block {block_id} is held by {block.ref_count} sequences; only a free block can be "
                             "forgotten")
        if self.is_cached(block_id) and block.hash is not None:
            del self._hash_to_block[block.hash]

    def truncate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Shrink a sequence to its first `num_tokens` tokens: give back the slots a step reserved but never
        finished. Returns the blocks that no sequence holds any more. Registered blocks are never given back
        (other sequences may share them), and a sequence may count one token fewer than they hold: a prefix hit
        on whole blocks leaves the last prompt token to compute, so that is as far as it can shrink (while it
        still needs every registered block)."""
        seq = self._seq(seq_id)
        registered, size = seq.num_registered_blocks, self.block_size
        lowest = max(registered * size - 1, (registered - 1) * size + 1) if registered else 0
        if not lowest <= num_tokens <= seq.num_tokens:
            raise ValueError(
                f"sequence {seq_id} can be truncated to {lowest}..{seq.num_tokens} tokens, not {num_tokens}"
            )
        keep = self.blocks_for(num_tokens)
        released: list[int] = []
        for block_id in reversed(seq.block_table[keep:]):
            block = self._blocks[block_id]
            self._drop(block)
            if block.ref_count == 0:
                released.append(block_id)
        # First in line again, in the order they were taken: as if the step had never run.
        self._free.extendleft(released)
        del seq.block_table[keep:]
        seq.num_tokens = num_tokens
        return released

    # ---- internals --------------------------------------------------------------------------

    def _seq(self, seq_id: int) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"no live sequence {seq_id} (never created, or already freed)")
        return seq

    def _hold(self, block: _Block) -> None:
        """One more sequence holds `block`."""
        block.ref_count += 1
        self._num_shared += block.ref_count == 2

    def _drop(self, block: _Block) -> None:
        """One sequence fewer holds `block`."""
        block.ref_count -= 1
        self._num_shared -= block.ref_count == 1

    def _shared_block_to_write(self, seq: _Sequence) -> int | None:
        """Index of the partly filled last block when another sequence also holds it."""
        index = seq.num_tokens // self.block_size
        if index < len(seq.block_table) and self._blocks[seq.block_table[index]].ref_count > 1:
            return index
        return None

    def _match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks holding the prompt's leading full blocks, stopping at the first miss."""
        bs = self.block_size
        hits: list[int] = []
        parent: tuple[int, int] | None = None
        parent_hash: int | None = None
        for i in range(len(token_ids) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent_hash, tokens)
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            block = self._blocks[block_id]
            # The hash only proposes a candidate: equal tokens after the very block we matched last
            # prove the whole prefix is equal, whatever the hash collides on.
            if block.token_ids != tokens or block.parent != parent:
                break
            hits.append(block_id)
            parent, parent_hash = (block_id, block.generation), h
        return hits

    def _take_free_block(self) -> int:
        """Hand out the oldest free block for new content, forgetting what it held."""
        block_id = self._free.popleft()
        block = self._blocks[block_id]
        if self.is_cached(block_id) and block.hash is not None:
            del self._hash_to_block[block.hash]
        block.hash, block.token_ids, block.parent = None, (), None
        block.generation += 1
        block.ref_count = 1
        return block_id
