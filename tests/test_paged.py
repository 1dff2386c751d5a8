"""The paged cache: the block allocator as a Hypothesis state machine, then many sequences sharing
one pool with real tiny models, each checked against the same sequence alone on a contiguous cache."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import infer
from infer.cache import block_manager
from infer.cache.block_manager import BlockManager, CopyOnWrite, PoolExhaustedError
from infer.cache.paged import PagedCache, PagedKVPool
from infer.config import ModelConfig
from infer.families import ARCHITECTURES
from infer.models import Transformer
from tests.helpers import TEST_DEVICE, assert_close, random_model, tiny_config

ALPHABET = st.integers(0, 1)  # two token ids: prompts share prefixes (and hashes collide) often

# Hash functions the machine may swap in: the real one, one blind to the prefix (equal blocks at
# different places collide) and a constant (everything collides). Sharing must stay exact with each.
HASHES: dict[str, Callable[[int | None, tuple[int, ...]], int]] = {
    "real": block_manager.block_hash,
    "blind_to_prefix": lambda parent_hash, token_ids: hash(token_ids),
    "constant": lambda parent_hash, token_ids: 0,
}


def fingerprint(manager: BlockManager) -> tuple[Any, ...]:
    """Everything observable about the allocator, to check that a failed call changed nothing."""
    blocks = range(manager.num_blocks)
    return (
        manager.free_block_ids(),
        tuple(manager.ref_count(b) for b in blocks),
        tuple(manager.is_cached(b) for b in blocks),
        tuple(manager.registered_token_ids(b) for b in blocks),
        {s: (manager.block_table(s), manager.num_tokens(s), manager.num_registered_blocks(s)) for s in manager.seq_ids},
    )


class BlockManagerMachine(RuleBasedStateMachine):
    """Random interleavings of the allocator's operations; the model of the world is each live
    sequence's token ids (prompt included), from which every block's content follows."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(1, 1)
        self.tokens: dict[int, list[int]] = {}
        self.freed: list[int] = []
        self.next_id = 0
        self.patch: Any = None

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 4), hash_name=st.sampled_from(sorted(HASHES)))
    def setup(self, num_blocks: int, block_size: int, hash_name: str) -> None:
        self.manager = BlockManager(num_blocks, block_size)
        self.patch = mock.patch.object(block_manager, "block_hash", HASHES[hash_name])
        self.patch.start()

    def teardown(self) -> None:
        if self.patch is not None:
            self.patch.stop()

    def _pick(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.tokens)), label="seq")

    @rule(prompt=st.lists(ALPHABET, max_size=10))
    def new_sequence(self, prompt: list[int]) -> None:
        manager, seq_id = self.manager, self.next_id
        self.next_id += 1
        fits = manager.can_allocate(len(prompt))
        shared = manager.new_sequence(seq_id, prompt)
        assert 0 <= shared <= max(len(prompt) - 1, 0), "the last prompt token must be left to compute"
        assert manager.num_tokens(seq_id) == shared
        self.tokens[seq_id] = list(prompt)
        if fits:  # the promise of can_allocate: the rest of the prompt can be appended
            assert manager.can_append(seq_id, len(prompt) - shared)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.one_of(st.integers(0, 4), st.integers(0, 40)))
    def append(self, data: st.DataObject, n: int) -> None:
        manager, seq_id = self.manager, self._pick(data)
        bs = manager.block_size
        start = manager.num_tokens(seq_id)
        known = self.tokens[seq_id]
        missing = max(0, start + n - len(known))  # tokens past the prompt: drawn
        new_tokens = data.draw(st.lists(ALPHABET, min_size=missing, max_size=missing))
        table = manager.block_table(seq_id)
        index = start // bs
        writes_existing = n > 0 and index < len(table)
        was_shared = writes_existing and manager.ref_count(table[index]) > 1
        if not manager.can_append(seq_id, n):
            before = fingerprint(manager)
            with pytest.raises(PoolExhaustedError, match="raise num_blocks or free"):
                manager.append(seq_id, n)
            assert fingerprint(manager) == before
            return
        old_ref = manager.ref_count(table[index]) if writes_existing else 0
        copies = manager.append(seq_id, n)
        after = manager.block_table(seq_id)
        assert manager.num_tokens(seq_id) == start + n
        assert after[:index] == table[:index]
        if was_shared:
            assert copies == [CopyOnWrite(table[index], after[index])]
            assert manager.ref_count(table[index]) == old_ref - 1
        else:
            assert copies == []
        # No block about to be written is held by another sequence.
        for i in range(index, math.ceil((start + n) / bs) if n else index):
            assert manager.ref_count(after[i]) == 1, f"block {after[i]} is shared but written in place"
        known.extend(new_tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def register(self, data: st.DataObject) -> None:
        seq_id = self._pick(data)
        self.manager.register_full_blocks(seq_id, self.tokens[seq_id][: self.manager.num_tokens(seq_id)])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        """Give back slots a stopped step reserved: any length from the registered blocks (but their last token,
        which a prefix hit on whole blocks leaves to compute) to the end; registered blocks stay."""
        manager, seq_id = self.manager, self._pick(data)
        registered, size = manager.num_registered_blocks(seq_id), manager.block_size
        low = max(registered * size - 1, (registered - 1) * size + 1) if registered else 0
        n = data.draw(st.integers(low, manager.num_tokens(seq_id)), label="truncate to")
        table = manager.block_table(seq_id)
        keep = manager.blocks_for(n)
        assert keep >= registered, "a registered block would be given back"
        free_before = manager.free_block_ids()
        released = manager.truncate(seq_id, n)
        assert manager.num_tokens(seq_id) == n and manager.block_table(seq_id) == table[:keep]
        assert [b for b in table[keep:] if manager.ref_count(b) == 0] == sorted(released, key=table.index)
        assert manager.free_block_ids() == (*sorted(released, key=table.index), *free_before)
        with pytest.raises(ValueError, match="truncated"):
            manager.truncate(seq_id, n + 1)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        seq_id, new_id = self._pick(data), self.next_id
        self.next_id += 1
        self.manager.fork(seq_id, new_id)
        self.tokens[new_id] = list(self.tokens[seq_id])
        assert self.manager.block_table(new_id) == self.manager.block_table(seq_id)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = self._pick(data)
        released = self.manager.free(seq_id)
        del self.tokens[seq_id]
        self.freed.append(seq_id)
        free = set(self.manager.free_block_ids())
        assert all(self.manager.ref_count(b) == 0 and b in free for b in released)

    @precondition(lambda self: self.manager.num_free)
    @rule(data=st.data())
    def forget(self, data: st.DataObject) -> None:
        """Drop a free block from the prefix cache (the quantized pool's sinks do): that block, and only it,
        stops being findable; a held block is refused."""
        manager = self.manager
        block = data.draw(st.sampled_from(manager.free_block_ids()), label="forget")
        cached = [manager.is_cached(b) for b in range(manager.num_blocks)]
        manager.forget(block)
        cached[block] = False
        assert [manager.is_cached(b) for b in range(manager.num_blocks)] == cached
        held = [b for b in range(manager.num_blocks) if manager.ref_count(b)]
        if held:
            before = fingerprint(manager)
            with pytest.raises(ValueError, match="only a free block"):
                manager.forget(held[0])
            assert fingerprint(manager) == before

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def free_again(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.freed))
        before = fingerprint(self.manager)
        with pytest.raises(ValueError, match="no live sequence"):
            self.manager.free(seq_id)
        assert fingerprint(self.manager) == before

    @invariant()
    def blocks_are_free_xor_used(self) -> None:
        manager = self.manager
        free = manager.free_block_ids()
        assert len(free) == len(set(free)), "a block is on the free list twice"
        assert manager.num_free + manager.num_used == manager.num_blocks
        for b in range(manager.num_blocks):
            assert manager.ref_count(b) >= 0
            assert (b in free) == (manager.ref_count(b) == 0), f"block {b} is both free and used, or neither"

    @invariant()
    def ref_counts_count_block_tables(self) -> None:
        manager = self.manager
        holders, filled = [0] * manager.num_blocks, [0] * manager.num_blocks
        for seq_id in manager.seq_ids:
            table = manager.block_table(seq_id)
            assert len(set(table)) == len(table)
            assert len(table) == math.ceil(manager.num_tokens(seq_id) / manager.block_size)
            for i, b in enumerate(table):
                holders[b] += 1
                slots = min(manager.block_size, manager.num_tokens(seq_id) - i * manager.block_size)
                filled[b] = max(filled[b], slots)  # a slot is filled if any holder's token is in it
        assert holders == [manager.ref_count(b) for b in range(manager.num_blocks)]
        stats = manager.stats()
        assert stats.blocks_shared == sum(1 for n in holders if n > 1)
        assert stats.blocks_used == manager.num_used
        assert stats.waste_slots == manager.num_used * manager.block_size - sum(filled)
        free = manager.free_block_ids()
        assert stats.blocks_free == len(free) and stats.blocks_cached == sum(map(manager.is_cached, free))
        bs = manager.block_size
        for n in (len(free) * bs, len(free) * bs + 1):  # the edge: exactly the free blocks, and one token more
            assert manager.can_allocate(n) == (n <= len(free) * bs)

    @invariant()
    def the_prefix_map_holds_only_live_entries(self) -> None:
        """Every hash entry names a block that still records that hash: a block handed out for new content takes
        its entry with it, so the map never outgrows the pool however many prompts pass through."""
        entries = self.manager._hash_to_block
        assert len(entries) <= self.manager.num_blocks
        for h, b in entries.items():
            assert self.manager._blocks[b].hash == h, f"a stale entry for block {b}"

    @invariant()
    def reclaimable_is_what_free_gives_back(self) -> None:
        """`num_reclaimable(seqs)` equals what freeing those sequences releases, tried on a copy."""
        seq_ids = sorted(self.tokens)
        for chosen in ([*seq_ids], *([s] for s in seq_ids[:3])):
            trial = copy.deepcopy(self.manager)
            released = sum(len(trial.free(s)) for s in chosen)
            assert self.manager.num_reclaimable(chosen) == released

    @invariant()
    def blocks_hold_their_sequences_tokens(self) -> None:
        manager, bs = self.manager, self.manager.block_size
        for seq_id, known in self.tokens.items():
            table = manager.block_table(seq_id)
            for i, b in enumerate(table):
                recorded = manager.registered_token_ids(b)
                if i < manager.num_registered_blocks(seq_id):
                    assert recorded is not None
                if recorded is not None:
                    assert recorded == tuple(known[i * bs : (i + 1) * bs]), f"block {b} holds other tokens"

    @invariant()
    def shared_blocks_have_equal_prefixes(self) -> None:
        manager, bs = self.manager, self.manager.block_size
        where: dict[int, list[tuple[int, int]]] = {}
        for seq_id in manager.seq_ids:
            for i, b in enumerate(manager.block_table(seq_id)):
                where.setdefault(b, []).append((seq_id, i))
        for b, holders in where.items():
            (first, index), *others = holders
            for seq_id, i in others:
                assert i == index, f"block {b} sits at different positions in two sequences"
                n = min(manager.num_tokens(first), manager.num_tokens(seq_id), (i + 1) * bs)
                assert self.tokens[first][:n] == self.tokens[seq_id][:n], f"block {b} shared by different prefixes"


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)


def test_manager_shares_full_prompt_blocks_and_copies_the_last_one() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    assert manager.new_sequence(0, prompt) == 0
    manager.append(0, 8)
    assert manager.register_full_blocks(0, prompt) == 2
    assert manager.new_sequence(1, prompt + [9]) == 8  # both blocks shared
    assert manager.num_shared == 2
    assert manager.new_sequence(2, prompt) == 7  # the last prompt token is recomputed...
    copies = manager.append(2, 1)  # ...so its write copies the shared block first
    assert copies == [CopyOnWrite(manager.block_table(0)[1], manager.block_table(2)[1])]
    assert manager.new_sequence(3, [1, 2, 3, 0, 5]) == 0  # one different token: nothing shared


def test_freed_prefix_blocks_are_reused_until_handed_out() -> None:
    manager = BlockManager(num_blocks=2, block_size=2)
    manager.new_sequence(0, [1, 2, 3])
    manager.append(0, 3)
    manager.register_full_blocks(0, [1, 2, 3])
    kept = manager.block_table(0)[0]
    manager.free(0)
    assert manager.new_sequence(1, [1, 2, 7]) == 2 and manager.block_table(1) == (kept,)  # revived
    manager.free(1)
    manager.new_sequence(2, [])
    manager.append(2, 4)  # takes both blocks for other content
    assert not manager.is_cached(kept)
    assert all(manager._blocks[b].hash == h for h, b in manager._hash_to_block.items()), "a stale prefix entry"
    manager.free(2)
    assert manager.new_sequence(3, [1, 2, 7]) == 0


def test_equal_blocks_after_other_prefixes_are_not_shared_even_when_hashes_collide() -> None:
    with mock.patch.object(block_manager, "block_hash", HASHES["blind_to_prefix"]):
        manager = BlockManager(num_blocks=6, block_size=2)
        manager.new_sequence(0, [1, 2, 3, 4])
        manager.append(0, 4)
        manager.register_full_blocks(0, [1, 2, 3, 4])
        # (3, 4) hashes alike at position 0 and after (1, 2), but its K/V there are not the same.
        assert manager.new_sequence(1, [3, 4, 5]) == 0
        assert manager.new_sequence(2, [1, 2, 3, 4, 5]) == 4


def shared_prefix_len(cached: list[int], prompt: list[int], block_size: int) -> int:
    """What prefix sharing may reuse: the prompt's leading full blocks equal to the cached sequence's,
    leaving the last prompt token to compute."""
    blocks, bs = 0, block_size
    while (blocks + 1) * bs <= min(len(cached), len(prompt)) and (
        cached[blocks * bs : (blocks + 1) * bs] == prompt[blocks * bs : (blocks + 1) * bs]
    ):
        blocks += 1
    return min(blocks * block_size, max(len(prompt) - 1, 0))


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_truncating_a_whole_block_prefix_hit_keeps_its_shared_blocks(block_size: int) -> None:
    """A prompt of only cached whole blocks counts one token fewer than they hold; truncating it to that count
    (a stopped step's clean-up) keeps every shared block, and it can shrink no further."""
    from infer.cache.block_manager import BlockManager

    manager = BlockManager(8, block_size)
    prompt = list(range(2 * block_size))
    manager.new_sequence(0, prompt)
    manager.append(0, len(prompt))
    manager.register_full_blocks(0, prompt)
    assert manager.new_sequence(1, prompt) == len(prompt) - 1
    table = manager.block_table(1)
    assert manager.truncate(1, len(prompt) - 1) == [] and manager.block_table(1) == table
    assert [manager.ref_count(b) for b in table] == [2] * len(table)
    with pytest.raises(ValueError, match=f"truncated to {len(prompt) - 1}"):
        manager.truncate(1, len(prompt) - 2)


# The state machine reaches collisions only by chance, and the CI profile's derandomized runs may never
# draw one: the cases that matter are pinned as examples.
@example(cached=[1, 2, 3, 4], prompt=[5, 6, 7, 8, 9], block_size=2, hash_name="constant")
@example(cached=[1, 2, 3, 4], prompt=[1, 2, 5, 6, 7], block_size=2, hash_name="constant")
@example(cached=[1, 2, 3, 4], prompt=[1, 3, 3, 4, 5], block_size=2, hash_name="constant")
@example(cached=[1, 2, 3, 4], prompt=[3, 4, 1, 2, 5], block_size=2, hash_name="constant")
@example(cached=[1, 2, 3, 4], prompt=[3, 4, 5], block_size=2, hash_name="blind_to_prefix")
@example(cached=[7, 7, 7, 7, 7, 7], prompt=[7, 7, 7, 7, 7, 7, 7], block_size=3, hash_name="constant")
@example(cached=[1, 2, 3, 4], prompt=[1, 2, 5, 6, 3, 4, 5], block_size=2, hash_name="real")  # a hole ends the match
@given(cached=st.lists(st.integers(0, 2), max_size=12), prompt=st.lists(st.integers(0, 2), max_size=12),
       block_size=st.integers(1, 4), hash_name=st.sampled_from(sorted(HASHES)))
def test_prefix_sharing_never_shares_other_tokens(cached: list[int], prompt: list[int], block_size: int,
                                                  hash_name: str) -> None:
    with mock.patch.object(block_manager, "block_hash", HASHES[hash_name]):
        manager = BlockManager(num_blocks=12, block_size=block_size)
        manager.new_sequence(0, cached)
        manager.append(0, len(cached))
        manager.register_full_blocks(0, cached)
        shared = manager.new_sequence(1, prompt)
    most = shared_prefix_len(cached, prompt, block_size)
    # A colliding hash map keeps one block per hash, so it may miss a share; it may never over-share.
    assert shared == most if hash_name == "real" else shared <= most, f"{hash_name} hash shared {shared} of {most}"
    for i, block in enumerate(manager.block_table(1)):
        assert manager.registered_token_ids(block) == tuple(prompt[i * block_size : (i + 1) * block_size])


def test_a_block_registered_through_one_fork_is_checked_not_redone_for_the_other() -> None:
    """Forked before registration, both holders register the shared full block: the second finds it recorded,
    accepts the same tokens without a new entry, refuses other tokens, and goes on to its own later blocks."""
    manager = BlockManager(num_blocks=8, block_size=2)
    manager.new_sequence(0)
    manager.append(0, 3)
    manager.fork(0, 1)
    manager.fork(0, 2)
    shared = manager.block_table(0)[0]
    assert manager.register_full_blocks(0, [1, 2, 3]) == 1
    with pytest.raises(ValueError, match="differ from the tokens its shared block holds"):
        manager.register_full_blocks(2, [9, 9, 3])
    manager.append(1, 3)  # its own tokens past the shared block (copy-on-write of the partial one)
    assert manager.register_full_blocks(1, [1, 2, 3, 4, 5, 6]) == 2, "the blocks after the shared one"
    table = manager.block_table(1)
    assert table[0] == shared and [manager.registered_token_ids(b) for b in table] == [(1, 2), (3, 4), (5, 6)]


def test_forgetting_a_superseded_block_leaves_the_newer_copy_findable() -> None:
    """Two blocks with the same content: the newest holder owns the hash entry, so forgetting the older one
    (free, recorded, no longer findable) must not drop the entry of the other."""
    manager = BlockManager(num_blocks=4, block_size=2)
    for seq_id in (0, 1):
        manager.new_sequence(seq_id)  # no prompt given: no prefix hit, its own block
        manager.append(seq_id, 2)
        manager.register_full_blocks(seq_id, [1, 2])
    older, newer = manager.block_table(0)[0], manager.block_table(1)[0]
    manager.free(0)
    assert manager.registered_token_ids(older) == (1, 2) and not manager.is_cached(older)
    manager.forget(older)
    assert manager.is_cached(newer)
    manager.free(1)
    assert manager.new_sequence(2, [1, 2, 3]) == 2 and manager.block_table(2) == (newer,)


def test_manager_rejects_misuse_with_clear_errors() -> None:
    manager = BlockManager(num_blocks=2, block_size=4)
    manager.new_sequence(0)
    with pytest.raises(ValueError, match="already exists"):
        manager.new_sequence(0)
    with pytest.raises(ValueError, match="no live sequence 5"):
        manager.append(5, 1)
    with pytest.raises(PoolExhaustedError, match="needs 3 free KV blocks .* only 2 of 2 are free; raise num_blocks"):
        manager.append(0, 9)
    assert manager.num_tokens(0) == 0 and manager.num_free == 2
    with pytest.raises(ValueError, match=">= 1"):
        BlockManager(0, 4)


# ---- the paged cache with real models -----------------------------------------------------------


def nan_pool(config: ModelConfig, num_blocks: int, block_size: int) -> PagedKVPool:
    """A pool whose unwritten slots are NaN: reading one would poison the logits."""
    pool = PagedKVPool(config, num_blocks=num_blocks, block_size=block_size)
    pool.k_blocks.fill_(float("nan"))
    pool.v_blocks.fill_(float("nan"))
    return pool


def poison_free_blocks(pool: PagedKVPool) -> None:
    """Overwrite freed blocks that no prefix hit can find any more with NaN (a stand-in for another
    sequence's data): a cache that still read one would show it."""
    for b in pool.manager.free_block_ids():
        if not pool.manager.is_cached(b):
            pool.k_blocks[:, b] = float("nan")
            pool.v_blocks[:, b] = float("nan")


class Run:
    """One sequence in the shared pool, and the same sequence alone on a contiguous cache."""

    def __init__(
        self, model: Transformer, paged: PagedCache, tokens: list[int], alone: infer.KVCache | None = None
    ) -> None:
        self.model = model
        self.paged = paged
        self.alone = alone or infer.create_cache("contiguous", model.config, max_seq_len=paged.max_seq_len)
        self.tokens = tokens  # every token so far; the last one is not cached yet after a step

    @classmethod
    def start(cls, model: Transformer, pool: PagedKVPool, prompt: list[int], max_len: int = 48) -> Run:
        return cls(model, pool.new_sequence(prompt, max_seq_len=max_len), list(prompt))

    def fork(self, next_token: int) -> Run:
        """A copy of this run (sharing its blocks) that continues with `next_token` instead."""
        alone = infer.create_cache("contiguous", self.model.config, max_seq_len=self.paged.max_seq_len)
        alone.restore(self.alone.snapshot())
        return Run(self.model, self.paged.fork(), self.tokens[:-1] + [next_token], alone)

    def step(self, what: str) -> torch.Tensor:
        """Feed what is not cached yet (the prompt's rest, or the last token); both caches must give
        the same logits. Appends the greedy next token."""
        model = self.model
        with torch.no_grad():
            if self.alone.offset == 0:
                paged = model(torch.tensor([self.tokens[self.paged.offset :]]), self.paged)
                alone = model(torch.tensor([self.tokens]), self.alone)
            else:
                pending = self.tokens[self.alone.offset :]
                self.paged.extend_token_ids(pending)
                paged = model(torch.tensor([pending]), self.paged)
                alone = model(torch.tensor([pending]), self.alone)
        assert torch.isfinite(paged).all(), f"{what}: NaN logits, a freed or unwritten slot was read"
        assert_close(paged, alone, 1e-5, what)
        self.tokens.append(int(alone[0, -1].argmax()))
        return paged


def random_tokens(n: int, seed: int, vocab: int = 97) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_interleaved_sequences_match_each_alone(arch: str) -> None:
    model = random_model(tiny_config(arch), seed=1)
    pool = nan_pool(model.config, num_blocks=24, block_size=4)
    base = random_tokens(10, seed=2)
    runs = {
        "a": Run.start(model, pool, base + random_tokens(3, seed=3)),
        "b": Run.start(model, pool, random_tokens(6, seed=4)),
    }
    for name, run in runs.items():
        run.step(f"{arch} prefill {name}")
    runs["c"] = Run.start(model, pool, base[:8] + random_tokens(2, seed=5))  # shares a's 2 full prompt blocks
    runs["d"] = Run.start(model, pool, base[:8])  # shares them too; its last prompt token copies the second
    assert (runs["c"].paged.offset, runs["d"].paged.offset) == (8, 7)
    assert pool.stats().blocks_shared == 2
    for name in ("c", "d"):
        runs[name].step(f"{arch} prefill {name}")

    def finish(name: str) -> list[int]:
        run = runs.pop(name)
        run.paged.release()
        poison_free_blocks(pool)
        return run.tokens

    for turn in range(12):
        for name, run in list(runs.items()):
            run.step(f"{arch} turn {turn} decode {name}")
        if turn == 3:  # a ends; e starts with a's whole text and finds its full blocks, freed but cached
            a_tokens = finish("a")
            assert pool.stats().blocks_cached > 0
            runs["e"] = Run.start(model, pool, a_tokens)
            assert runs["e"].paged.offset == 4 * ((len(a_tokens) - 1) // 4)
            runs["e"].step(f"{arch} prefill e")
        if turn == 5:  # b ends; f takes blocks b left
            finish("b")
            runs["f"] = Run.start(model, pool, random_tokens(9, seed=6))
            runs["f"].step(f"{arch} prefill f")
        if turn == 8:
            finish("c")
            finish("d")
            runs["g"] = Run.start(model, pool, base[:8] + random_tokens(5, seed=7))
            assert runs["g"].paged.offset == 8  # e still holds a's first blocks
            runs["g"].step(f"{arch} prefill g")
    for name in list(runs):
        finish(name)
    assert pool.manager.num_free == pool.num_blocks and pool.stats().blocks_used == 0


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prefix_sharing_skips_prefill_and_copy_on_write_protects_the_owner(arch: str) -> None:
    model = random_model(tiny_config(arch), seed=2)
    pool = nan_pool(model.config, num_blocks=16, block_size=4)
    prompt = random_tokens(8, seed=8)  # two full blocks
    first = Run.start(model, pool, prompt)
    assert first.paged.offset == 0
    first.step("first prefill")
    before = first.paged.snapshot()
    longer = Run.start(model, pool, prompt + random_tokens(3, seed=9))
    assert longer.paged.offset == 8 and longer.paged.num_prefix_hit_tokens == 8  # prefills 3 tokens, not 11
    assert pool.stats().blocks_shared == 2
    longer.step("longer prefill over shared blocks")
    same = Run.start(model, pool, prompt)
    assert same.paged.offset == 7  # the last token is recomputed for its logits...
    same.step("same-prompt prefill of one token")
    ids = [pool.manager.block_table(r.paged.seq_ids[0])[1] for r in (first, longer, same)]
    assert ids[0] == ids[1] != ids[2]  # ...and its write went to a private copy of the shared block
    after = first.paged.snapshot()
    assert torch.equal(after.tensors["k"], before.tensors["k"]) and torch.equal(after.tensors["v"], before.tensors["v"])
    for turn in range(6):  # crosses into new blocks: none of the three disturbs another
        for run in (first, longer, same):
            run.step(f"{arch} turn {turn}")


def test_fork_shares_blocks_and_copies_on_divergence() -> None:
    model = random_model(tiny_config("qwen3"), seed=3)
    pool = nan_pool(model.config, num_blocks=12, block_size=4)
    parent = Run.start(model, pool, random_tokens(6, seed=10))
    parent.step("prefill")
    child = parent.fork((parent.tokens[-1] + 1) % model.config.vocab_size)
    assert pool.stats().blocks_shared == 2  # the full block and the partly filled one
    for turn in range(5):
        parent.step(f"parent {turn}")
        child.step(f"child {turn}")
    assert pool.stats().blocks_shared == 1  # the full block stays shared; the written one was copied


@settings(max_examples=25, deadline=None)
@given(
    split=st.lists(st.integers(1, 7), min_size=1, max_size=6),
    batch=st.integers(1, 3),
    block_size=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
)
def test_update_returns_exactly_what_was_written(split: list[int], batch: int, block_size: int, seed: int) -> None:
    config = tiny_config(num_layers=2, num_kv_heads=2, head_dim=4)
    total = sum(split)
    per_row = math.ceil(total / block_size)
    pool = nan_pool(config, num_blocks=(batch + 1) * per_row + 1, block_size=block_size)
    cache = infer.create_cache("paged", config, max_seq_len=total, batch_size=batch, pool=pool)
    neighbour = pool.new_sequence(max_seq_len=total)  # writes between our steps, so block ids interleave
    gen = torch.Generator().manual_seed(seed)
    k_all = torch.randn(2, batch + 1, 2, total, 4, generator=gen).to(TEST_DEVICE)  # row `batch`: the neighbour's
    v_all = torch.randn(2, batch + 1, 2, total, 4, generator=gen).to(TEST_DEVICE)
    start = 0
    for n in split:
        for c, rows in ((cache, slice(0, batch)), (neighbour, slice(batch, batch + 1))):
            for layer in range(2):
                new = slice(start, start + n)
                k, v = c.update(layer, k_all[layer, rows, :, new], v_all[layer, rows, :, new])
                assert torch.equal(k, k_all[layer, rows, :, : start + n])
                assert torch.equal(v, v_all[layer, rows, :, : start + n])
                assert c.key_positions(layer, n).tolist() == list(range(start + n))
            c.advance(n)
        start += n
    snapshot = cache.snapshot()
    assert torch.equal(snapshot.tensors["k"], k_all[:, :batch])
    assert torch.equal(snapshot.tensors["v"], v_all[:, :batch])


def test_pool_exhaustion_is_clear_and_changes_nothing() -> None:
    model = random_model(tiny_config("gemma3_text"), seed=4)
    pool = nan_pool(model.config, num_blocks=3, block_size=4)
    full = Run.start(model, pool, random_tokens(8, seed=11))
    full.step("prefill 8")  # two blocks, both full
    other = Run.start(model, pool, random_tokens(4, seed=12))
    other.step("prefill 4")  # the last block
    before = (fingerprint(pool.manager), pool.k_blocks.clone(), pool.v_blocks.clone())
    with torch.no_grad(), pytest.raises(infer.CacheFullError, match=r"need 1 free KV blocks but only 0 of 3"):
        model(torch.tensor([full.tokens[-1:]]), full.paged)
    assert full.paged.offset == 8
    assert fingerprint(pool.manager) == before[0]
    assert torch.allclose(pool.k_blocks, before[1], equal_nan=True, atol=0, rtol=0)
    assert torch.allclose(pool.v_blocks, before[2], equal_nan=True, atol=0, rtol=0)
    other.paged.release()
    poison_free_blocks(pool)
    full.step("decode after another sequence freed its block")


def test_snapshot_restore_reclaims_own_blocks_and_registers_tokens() -> None:
    model = random_model(tiny_config("llama"), seed=5)
    pool = nan_pool(model.config, num_blocks=4, block_size=4)
    run = Run.start(model, pool, random_tokens(9, seed=13))
    run.step("prefill 9")
    snapshot = run.paged.snapshot()
    assert snapshot.kind == "paged" and snapshot.offset == 9 and snapshot.token_ids == run.tokens[:9]
    alone = run.alone.snapshot()
    assert torch.equal(snapshot.tensors["k"], alone.tensors["k"])  # same layout as the contiguous kind
    for turn in range(6):
        run.step(f"decode {turn}")
    assert pool.manager.num_free == 0
    run.paged.restore(snapshot)  # fits only by giving back the cache's own blocks first
    run.alone.restore(alone)
    run.tokens = run.tokens[:10]
    assert run.paged.offset == 9
    for turn in range(3):
        run.step(f"decode after restore {turn}")
    hit = pool.new_sequence(run.tokens[:9])
    assert hit.offset == 8  # the restored blocks were registered under the snapshot's tokens
    hit.release()
    too_small = nan_pool(model.config, num_blocks=2, block_size=4).new_sequence(max_seq_len=12)
    with pytest.raises(PoolExhaustedError, match="needs 3 KV blocks"):
        too_small.restore(snapshot)
    assert too_small.offset == 0 and too_small.pool.manager.num_free == 2


def test_lifecycle_and_misuse() -> None:
    config = tiny_config("llama")
    cache = infer.create_cache("paged", config, max_seq_len=20, batch_size=2, block_size=4)
    assert isinstance(cache, PagedCache) and isinstance(cache, infer.KVCache)
    pool = cache.pool
    assert pool.num_blocks == 10  # 2 rows x ceil(20 / 4)
    assert cache.memory_bytes == pool.k_blocks.nbytes + pool.v_blocks.nbytes
    k = torch.randn(2, 2, 5, 8, device=pool.device)
    cache.update(0, k, k)
    cache.update(1, k, k)
    cache.advance(5)
    assert pool.stats().blocks_used == 4 and pool.stats().waste_slots == 6
    cache.reset()
    assert cache.offset == 0 and pool.manager.num_free == 10
    cache.release()
    with pytest.raises(ValueError, match="released"):
        cache.update(0, k, k)
    assert pool.manager.num_free == 10
    with pytest.raises(ValueError, match="either pool or block_size"):
        infer.create_cache("paged", config, max_seq_len=20, pool=pool, block_size=4)
    with pytest.raises(ValueError, match="dtype"):
        infer.create_cache("paged", config, max_seq_len=20, pool=pool, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim"):
        infer.create_cache("paged", tiny_config("llama", head_dim=4), max_seq_len=20, pool=pool)
    with pytest.raises(infer.CacheFullError, match="max_seq_len"):
        pool.new_sequence(list(range(30)), max_seq_len=20)
