"""Paged KV block allocator: free list, reference counts, block tables, fork and copy-on-write.

A sequence's KV cache is a list of fixed-size blocks (its block table). Blocks are reference counted so
sequences can share them (``fork``); a shared block that is about to be written is first copied
(copy-on-write), and the copy is reported to the caller, who moves the cached KV before the next forward.
``Block.block_hash`` is where prefix caching keeps the hash of a full block.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class BlockManager:
    """Owns every KV block; sequences are known by integer ids."""

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def get_block_table(self, seq_id: int) -> list[int]:
        return self.block_tables.get(seq_id, [])

    def _first_written_block(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.block_size

    def num_new_blocks_needed(self, seq_id: int, num_computed_tokens: int, num_tokens: int) -> int:
        """Free blocks needed so ``num_tokens`` tokens fit, with writes from ``num_computed_tokens`` on."""
        table = self.block_tables.get(seq_id, [])
        needed = max(0, -(-num_tokens // self.block_size) - len(table))
        first = self._first_written_block(num_computed_tokens)
        needed += sum(1 for block_id in table[first:] if self.blocks[block_id].ref_count > 1)
        return needed

    def allocate_slots(self, seq_id: int, num_computed_tokens: int, num_tokens: int) -> list[tuple[int, int]] | None:
        """Make the sequence's table hold ``num_tokens`` tokens, with private blocks from ``num_computed_tokens`` on.

        Returns the (src, dst) block copies that copy-on-write requires, or None (and changes nothing) when the
        free list is too short.
        """
        if self.num_new_blocks_needed(seq_id, num_computed_tokens, num_tokens) > len(self.free_block_ids):
            return None
        table = self.block_tables.setdefault(seq_id, [])
        copies: list[tuple[int, int]] = []
        for i in range(self._first_written_block(num_computed_tokens), len(table)):
            src = table[i]
            if self.blocks[src].ref_count > 1:
                self.blocks[src].ref_count -= 1
                table[i] = self._take_free_block()
                copies.append((src, table[i]))
        while len(table) * self.block_size < num_tokens:
            table.append(self._take_free_block())
        return copies

    def has_private_slot(self, seq_id: int, position: int) -> bool:
        """True when the token at ``position`` can be written without allocating or copying (the common decode
        step): a cheap check that spares ``allocate_slots`` for most sequences."""
        table = self.block_tables.get(seq_id)
        index = position // self.block_size
        return table is not None and index < len(table) and self.blocks[table[index]].ref_count == 1

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """Give ``child`` the parent's blocks by reference (its later writes copy first)."""
        if child_seq_id in self.block_tables:
            raise ValueError(f"sequence {child_seq_id} already has a block table")
        table = list(self.block_tables.get(parent_seq_id, []))
        for block_id in table:
            self.blocks[block_id].ref_count += 1
        self.block_tables[child_seq_id] = table

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references; blocks nobody references go back to the free list."""
        for block_id in reversed(self.block_tables.pop(seq_id, [])):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                block.block_hash = None
                self.free_block_ids.append(block_id)

    def _take_free_block(self) -> int:
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"block {block_id} on the free list has ref_count {block.ref_count}"
        block.ref_count = 1
        return block_id
