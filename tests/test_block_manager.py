"""Block manager: unit behaviour and a stateful hypothesis test (no double allocation, no leak)."""

from __future__ import annotations

import copy
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
    assert bm.allocate_slots(0, 5, 3) == [] and len(bm.get_block_table(0)) == 2
    assert bm.allocate_slots(0, 8, 1) == [] and bm.num_free_blocks == 1
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
    copies = bm.allocate_slots(1, 6, 1)  # the child writes into the shared partial block
    assert copies == [(partial, bm.get_block_table(1)[1])]
    assert bm.get_block_table(1)[0] == full and bm.blocks[full].ref_count == 2
    assert bm.blocks[partial].ref_count == 1
    bm.free(0)
    bm.free(1)
    assert bm.num_free_blocks == 6


class SequencesMachine(RuleBasedStateMachine):
    """Fork and free over ``self.seqs`` (seq id -> the test's model of its tokens), shared by the machines below;
    each subclass sets ``self.bm`` and ``self.seqs`` and adds its own rules and invariants."""

    bm: BlockManager
    seqs: dict

    def new_id(self) -> int:
        self.next_id = getattr(self, "next_id", 0) + 1
        return self.next_id - 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        child = self.new_id()
        self.bm.fork(parent, child)
        self.seqs[child] = copy.copy(self.seqs[parent])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.free(seq_id)
        del self.seqs[seq_id]

    def teardown(self) -> None:
        if hasattr(self, "bm"):
            for seq_id in list(self.seqs):
                self.bm.free(seq_id)
            assert self.bm.num_free_blocks == self.bm.num_blocks


class BlockManagerMachine(SequencesMachine):
    """Random allocate / append / fork / free; the invariants check every reference count."""

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 8]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.seqs: dict[int, int] = {}  # seq id -> tokens it holds

    @rule(num_tokens=st.integers(1, 40))
    def add(self, num_tokens: int) -> None:
        seq_id = self.new_id()
        before = self.bm.num_free_blocks
        if self.bm.allocate_slots(seq_id, 0, num_tokens) is None:
            assert self.bm.num_free_blocks == before and self.bm.get_block_table(seq_id) == []
            self.bm.free(seq_id)
        else:
            self.seqs[seq_id] = num_tokens

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), extra=st.integers(1, 10))
    def append(self, data: st.DataObject, extra: int) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        old = self.seqs[seq_id]
        table_before = list(self.bm.get_block_table(seq_id))
        copies = self.bm.allocate_slots(seq_id, old, extra)
        if copies is None:
            assert self.bm.get_block_table(seq_id) == table_before
            return
        self.seqs[seq_id] = old + extra
        table = self.bm.get_block_table(seq_id)
        for src, dst in copies:
            assert src in table_before and dst in table and dst not in table_before
        # every block written from here on is private
        for block_id in table[old // self.bm.block_size :]:
            assert self.bm.blocks[block_id].ref_count == 1

    @invariant()
    def accounting(self) -> None:
        bm = self.bm
        refs = Counter(b for seq_id in self.seqs for b in bm.get_block_table(seq_id))
        free = list(bm.free_block_ids)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        assert not set(free) & set(refs), "a referenced block is on the free list"
        assert len(free) + len(refs) == bm.num_blocks, "a block leaked"
        for block in bm.blocks:
            assert block.ref_count == refs.get(block.block_id, 0)
        for seq_id, n in self.seqs.items():
            assert len(bm.get_block_table(seq_id)) == -(-n // bm.block_size)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_rejects_empty_pool() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)


def test_prefix_cache_reuses_full_blocks_and_evicts_least_recently_used() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    tokens = [1, 2, 3, 4, 5]
    assert bm.allocate_slots(0, 0, 5) == []
    bm.cache_full_blocks(0, tokens, 5)
    first, second, _ = bm.get_block_table(0)
    assert bm.num_cached_blocks == 2  # the partial last block is never cached
    assert bm.find_cached_prefix(tokens) == [first, second]
    assert bm.find_cached_prefix([1, 2, 3, 4]) == [first]  # the last token is always recomputed
    assert bm.find_cached_prefix([1, 2, 3, 9, 9]) == [first]
    assert bm.find_cached_prefix(tokens, lora_id=1) == []  # another adapter's KV is not reused
    bm.free(0)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2  # freed, still reusable
    # A second sequence reuses both blocks, then frees them: its last block becomes the older entry.
    bm.allocate_cached_prefix(1, bm.find_cached_prefix(tokens))
    assert bm.get_block_table(1) == [first, second] and bm.num_free_blocks == 2
    bm.free(1)
    # Needing all 4 blocks: the 2 never-cached ones go first, then `second` (freed first), then `first`.
    assert bm.allocate_slots(2, 0, 6) == []
    assert bm.find_cached_prefix(tokens) == [first] and bm.num_cached_blocks == 1
    assert bm.allocate_slots(2, 6, 2) == []
    assert bm.find_cached_prefix(tokens) == [] and bm.num_cached_blocks == 0
    bm.free(2)
    assert bm.num_free_blocks == 4


def test_a_sequence_running_across_a_weight_change_is_never_cached() -> None:
    """Its first token's KV came from the old weights, and every later token attends to it: when its block
    fills after the reset, no entry is made (nor for a sample forked from it); a sequence started afterwards is
    cached again."""
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    assert bm.allocate_slots(0, 0, 1) == []
    bm.reset_prefix_cache()
    bm.fork(0, 1)
    assert bm.allocate_slots(0, 1, 3) is not None  # a copy-on-write copy of the shared block
    assert bm.allocate_slots(1, 1, 3) == []
    bm.cache_full_blocks(0, [0, 0, 1, 0], 4)
    bm.cache_full_blocks(1, [0, 0, 1, 0], 4)
    assert bm.find_cached_prefix([0, 0, 1, 0, 0]) == [] and bm.num_cached_blocks == 0
    bm.free(0)
    bm.free(1)
    swapped = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=True, num_cpu_blocks=2)
    assert swapped.allocate_slots(0, 0, 1) == []
    swapped.reset_prefix_cache()
    swapped.swap_out([0])
    swapped.swap_in([0])
    assert swapped.allocate_slots(0, 1, 3) == []
    swapped.cache_full_blocks(0, [0, 0, 1, 0], 4)
    assert swapped.num_cached_blocks == 0  # swapping out and in keeps it stale
    assert bm.allocate_slots(2, 0, 4) == []
    bm.cache_full_blocks(2, [0, 0, 1, 0], 4)
    assert bm.find_cached_prefix([0, 0, 1, 0, 0]) == bm.get_block_table(2)


def test_kv_waste_counts_shared_blocks_once() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate_slots(0, 0, 6)  # 6 tokens in 2 blocks
    bm.fork(0, 1)
    assert bm.kv_waste_fraction({0: 6, 1: 6}) == pytest.approx(2 / 8)
    bm.allocate_slots(1, 6, 1)  # the child copies the partial block and writes a seventh token
    assert bm.kv_waste_fraction({0: 6, 1: 7}) == pytest.approx((2 + 1) / 12)


class PrefixCacheMachine(SequencesMachine):
    """Sequences over a two-token alphabet (so prefixes repeat) are admitted through the prefix cache, extended,
    forked and freed, and the model's weights change (``reset_prefix_cache``). A model of every block's KV
    content checks that a cache hit and every cached block hold exactly the KV that recomputing would give (a
    slot's KV depends on every token up to its own, and on the weights), through copy-on-write and eviction."""

    @initialize(num_blocks=st.integers(1, 16), block_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
        self.seqs: dict[int, list[int]] = {}  # seq id -> tokens, all computed
        self.content: dict[int, list[tuple | None]] = {}  # block id -> (weights, token prefix) each slot encodes
        self.weights = 0  # bumped when the model's weights change

    def _write(self, seq_id: int, start: int, copies: list[tuple[int, int]]) -> None:
        bs, table, tokens = self.bm.block_size, self.bm.get_block_table(seq_id), self.seqs[seq_id]
        for src, dst in copies:
            self.content[dst] = list(self.content[src])
        for pos in range(start, len(tokens)):
            block_id = table[pos // bs]
            assert self.bm.blocks[block_id].ref_count == 1, "a shared block was written"
            self.content.setdefault(block_id, [None] * bs)[pos % bs] = (self.weights, tuple(tokens[: pos + 1]))
        self.bm.cache_full_blocks(seq_id, tokens, len(tokens))

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=12))
    def add(self, tokens: list[int]) -> None:
        bs = self.bm.block_size
        cached = self.bm.find_cached_prefix(tokens)
        for j, block_id in enumerate(cached):
            expected = [(self.weights, tuple(tokens[: j * bs + i + 1])) for i in range(bs)]
            assert self.content[block_id] == expected, "a cache hit holds the KV of another prefix, or old weights"
        if self.bm.num_blocks_to_admit(len(tokens), cached) > self.bm.num_free_blocks:
            return
        seq_id = self.new_id()
        self.bm.allocate_cached_prefix(seq_id, cached)
        copies = self.bm.allocate_slots(seq_id, len(cached) * bs, len(tokens) - len(cached) * bs)
        assert copies is not None, "admission said the blocks fit"
        self.seqs[seq_id] = list(tokens)
        self._write(seq_id, len(cached) * bs, copies)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 1), min_size=1, max_size=6))
    def append(self, data: st.DataObject, extra: list[int]) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        old = len(self.seqs[seq_id])
        copies = self.bm.allocate_slots(seq_id, old, len(extra))
        if copies is not None:
            self.seqs[seq_id] += extra
            self._write(seq_id, old, copies)

    @rule()
    def change_weights(self) -> None:
        self.weights += 1
        self.bm.reset_prefix_cache()

    @invariant()
    def accounting(self) -> None:
        bm = self.bm
        refs = Counter(b for seq_id in self.seqs for b in bm.get_block_table(seq_id))
        free, evictable = set(bm.free_block_ids), set(bm.evictable)
        assert len(free) == len(bm.free_block_ids) and not free & evictable and not (free | evictable) & set(refs)
        assert len(free) + len(evictable) + len(refs) == bm.num_blocks, "a block leaked"
        for block in bm.blocks:
            assert block.ref_count == refs.get(block.block_id, 0)
            assert (block.block_id in evictable) <= (block.prefix_id is not None)
            assert (block.block_id in free) <= (block.prefix_id is None)
        for key, block_id in bm.cached_blocks.items():
            assert bm.blocks[block_id].key == key
            assert tuple(slot[1][-1] for slot in self.content[block_id]) == key[1], "a cached block changed"


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
