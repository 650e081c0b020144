"""Block manager: unit behaviour and a stateful hypothesis test (no double allocation, no leak)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_backend.core.block_manager import BlockManager


def test_allocate_append_free() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate_slots(0, 0, 5) == []
    assert len(bm.get_block_table(0)) == 2 and bm.num_free_blocks == 2
    assert bm.allocate_slots(0, 5, 8) == [] and len(bm.get_block_table(0)) == 2
    assert bm.allocate_slots(0, 8, 9) == [] and bm.num_free_blocks == 1
    assert bm.allocate_slots(1, 0, 8) is None  # needs 2, 1 free: nothing changes
    assert bm.get_block_table(1) == [] and bm.num_free_blocks == 1
    bm.free(0)
    assert bm.num_free_blocks == 4


def test_fork_shares_then_copies_on_write() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    bm.allocate_slots(0, 0, 6)  # one full block, one partial
    bm.fork(0, 1)
    assert bm.get_block_table(1) == bm.get_block_table(0)
    assert bm.num_free_blocks == 4
    full, partial = bm.get_block_table(0)
    copies = bm.allocate_slots(1, 6, 7)  # the child writes into the shared partial block
    assert copies == [(partial, bm.get_block_table(1)[1])]
    assert bm.get_block_table(1)[0] == full and bm.blocks[full].ref_count == 2
    assert bm.blocks[partial].ref_count == 1
    bm.free(0)
    bm.free(1)
    assert bm.num_free_blocks == 6


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free; the invariants check every reference count."""

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 8]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.lengths: dict[int, int] = {}  # seq id -> tokens it holds
        self.next_id = 0

    @rule(num_tokens=st.integers(1, 40))
    def add(self, num_tokens: int) -> None:
        seq_id, self.next_id = self.next_id, self.next_id + 1
        before = self.bm.num_free_blocks
        if self.bm.allocate_slots(seq_id, 0, num_tokens) is None:
            assert self.bm.num_free_blocks == before and self.bm.get_block_table(seq_id) == []
            self.bm.free(seq_id)
        else:
            self.lengths[seq_id] = num_tokens

    @precondition(lambda self: self.lengths)
    @rule(data=st.data(), extra=st.integers(1, 10))
    def append(self, data: st.DataObject, extra: int) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.lengths)))
        old = self.lengths[seq_id]
        table_before = list(self.bm.get_block_table(seq_id))
        copies = self.bm.allocate_slots(seq_id, old, old + extra)
        if copies is None:
            assert self.bm.get_block_table(seq_id) == table_before
            return
        self.lengths[seq_id] = old + extra
        table = self.bm.get_block_table(seq_id)
        for src, dst in copies:
            assert src in table_before and dst in table and dst not in table_before
        # every block written from here on is private
        for block_id in table[old // self.bm.block_size :]:
            assert self.bm.blocks[block_id].ref_count == 1

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.lengths)))
        child, self.next_id = self.next_id, self.next_id + 1
        self.bm.fork(parent, child)
        self.lengths[child] = self.lengths[parent]

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.lengths)))
        self.bm.free(seq_id)
        del self.lengths[seq_id]

    @invariant()
    def accounting(self) -> None:
        bm = self.bm
        refs = Counter(b for seq_id in self.lengths for b in bm.get_block_table(seq_id))
        free = list(bm.free_block_ids)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        assert not set(free) & set(refs), "a referenced block is on the free list"
        assert len(free) + len(refs) == bm.num_blocks, "a block leaked"
        for block in bm.blocks:
            assert block.ref_count == refs.get(block.block_id, 0)
        for seq_id, n in self.lengths.items():
            assert len(bm.get_block_table(seq_id)) == -(-n // bm.block_size)

    def teardown(self) -> None:
        if hasattr(self, "bm"):
            for seq_id in list(self.lengths):
                self.bm.free(seq_id)
            assert self.bm.num_free_blocks == self.bm.num_blocks


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_rejects_empty_pool() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
