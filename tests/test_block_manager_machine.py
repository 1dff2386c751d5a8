"""The block manager as a Hypothesis state machine against a plain model of its rules (no hashing, no tensors):

- a block is free or held; held blocks count the sequences that hold them;
- a free block is handed out oldest-freed first; a freed sequence gives its blocks back tail first (so a prompt's
  leading blocks, the likeliest prefix hits, are reused last); a truncated step's blocks go back to the front, in
  the order they were taken, as if the step had never run;
- `append` takes exactly `num_blocks_to_append` free blocks: new ones for the tokens past the last block, plus one
  copy when the partly filled last block is shared (copy-on-write); it takes none when it cannot take them all.

Prefix sharing is left to tests/test_paged.py (it revives cached blocks from the middle of the free list); here
sequences start empty, grow, fork, shrink and end, with the pool often one block short."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from infer.cache.block_manager import BlockManager, PoolExhaustedError


class BlockManagerMachine(RuleBasedStateMachine):
    """The manager and the model side by side; every rule does the same to both."""

    @initialize(num_blocks=st.integers(1, 8), block_size=st.integers(1, 4))
    def start(self, num_blocks: int, block_size: int) -> None:
        self.manager = BlockManager(num_blocks, block_size)
        self.bs = block_size
        self.free = list(range(num_blocks))  # the model's free list, oldest first
        self.refs = [0] * num_blocks
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, int] = {}
        self.next_id = 0

    def blocks_for(self, n: int) -> int:
        return -(-n // self.bs)

    @rule()
    def new_sequence(self) -> None:
        sid = self.next_id
        self.next_id += 1
        assert self.manager.new_sequence(sid) == 0
        self.tables[sid], self.tokens[sid] = [], 0

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), n=st.integers(0, 6))
    def append(self, data: st.DataObject, n: int) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tables)))
        table, have = self.tables[sid], self.tokens[sid]
        index = have // self.bs  # the block the next token goes to, if the sequence holds it
        copy = n > 0 and index < len(table) and self.refs[table[index]] > 1
        expected = (self.blocks_for(have + n) - len(table) if n else 0) + int(copy)
        assert self.manager.num_blocks_to_append(sid, n) == expected
        if expected > len(self.free):
            try:
                self.manager.append(sid, n)
            except PoolExhaustedError:
                return
            raise AssertionError("append took more blocks than were free")
        copies = self.manager.append(sid, n)
        if copy:
            dst = self.free.pop(0)
            assert [(c.src, c.dst) for c in copies] == [(table[index], dst)]
            self.refs[table[index]] -= 1
            self.refs[dst] = 1
            table[index] = dst
        else:
            assert copies == []
        while len(table) < self.blocks_for(have + n):
            block = self.free.pop(0)
            self.refs[block] = 1
            table.append(block)
        self.tokens[sid] = have + n

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tables)))
        new = self.next_id
        self.next_id += 1
        self.manager.fork(sid, new)
        self.tables[new], self.tokens[new] = list(self.tables[sid]), self.tokens[sid]
        for block in self.tables[new]:
            self.refs[block] += 1

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free_sequence(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tables)))
        released = []
        for block in reversed(self.tables.pop(sid)):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                released.append(block)
        del self.tokens[sid]
        self.free += released
        assert self.manager.free(sid) == released

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tables)))
        keep_tokens = data.draw(st.integers(0, self.tokens[sid]))
        table = self.tables[sid]
        keep = self.blocks_for(keep_tokens)
        released = []
        for block in reversed(table[keep:]):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                released.append(block)
        del table[keep:]
        self.tokens[sid] = keep_tokens
        self.free = list(reversed(released)) + self.free
        assert self.manager.truncate(sid, keep_tokens) == released

    @invariant()
    def books_match_the_model(self) -> None:
        if not hasattr(self, "manager"):
            return
        assert list(self.manager.free_block_ids()) == self.free, "free list order"
        assert self.manager.num_free == len(self.free)
        for block, count in enumerate(self.refs):
            assert self.manager.ref_count(block) == count, f"block {block}'s holders"
        for sid, table in self.tables.items():
            assert list(self.manager.block_table(sid)) == table, f"sequence {sid}'s table"
            assert self.manager.num_tokens(sid) == self.tokens[sid]


TestBlockManagerMachine = BlockManagerMachine.TestCase
