"""Paged KV block allocator: free list, reference counts, block tables, fork, copy-on-write, prefix caching and
swap space.

A sequence's KV cache is a list of fixed-size blocks (its block table). Blocks are reference counted so
sequences can share them (``fork``); a shared block that is about to be written is first copied
(copy-on-write), and the copy is reported to the caller, who moves the cached KV before the next forward.

Prefix caching: once a block is full its content never changes, so it is registered under the key
``(parent block's prefix id, its tokens, LoRA id)`` and gets a ``prefix_id``: a number naming the exact token
prefix it ends. A new sequence walks its tokens block by block through these keys and reuses every block it
finds, skipping their prefill. The keys hold the tokens themselves, not a hash of them, so two different
prefixes never collide. A freed
block that holds a cached prefix stays reusable ("evictable") until its memory is needed: blocks that were never
cached are handed out first, then evictable ones, least recently used first. The partial last block of a
sequence is never registered, so it is never shared through the cache.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass

BlockKey = tuple[int, tuple[int, ...], int]  # (parent prefix_id or ROOT, the block's tokens, LoRA id)
ROOT = -1  # the parent of a sequence's first block


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    prefix_id: int | None = None  # id of the token prefix this full block ends, when it is cached
    key: BlockKey | None = None  # where ``BlockManager.cached_blocks`` holds it


class BlockManager:
    """Owns every KV block; sequences are known by integer ids."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
        num_cpu_blocks: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # free and holding no cached prefix
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free but cached, least recently used first
        self.cached_blocks: dict[BlockKey, int] = {}
        self.block_tables: dict[int, list[int]] = {}
        self.prefix_ids_of: dict[int, list[int]] = {}  # seq id -> prefix_id of each of its leading full blocks
        self.uncached_seq_ids: set[int] = set()  # sequences whose blocks never enter the cache (stop_caching)
        self._next_prefix_id = itertools.count()
        # Swap space: CPU blocks of preempted sequences, reference counted like device blocks.
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free_block_ids: deque[int] = deque(range(num_cpu_blocks))
        self.cpu_ref_counts = [0] * num_cpu_blocks
        self.cpu_block_tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose prefix a new sequence could reuse (in use or evictable)."""
        return len(self.cached_blocks)

    def get_block_table(self, seq_id: int) -> list[int]:
        return self.block_tables.get(seq_id, [])

    def kv_waste_fraction(self, num_tokens: dict[int, int]) -> float:
        """Share of the slots in blocks in use that hold no token, given each sequence's tokens in the cache.
        A block shared by several sequences counts once."""
        bs = self.block_size
        fill: dict[int, int] = {}
        for seq_id, table in self.block_tables.items():
            n = num_tokens.get(seq_id, 0)
            for j, block_id in enumerate(table):
                fill[block_id] = max(fill.get(block_id, 0), min(bs, max(0, n - j * bs)))
        used = self.num_used_blocks
        return 1.0 - sum(fill.values()) / (used * bs) if used else 0.0

    # ------------------------------------------------------------------ prefix caching
    def find_cached_prefix(self, token_ids: list[int], lora_id: int = 0) -> list[int]:
        """Blocks holding the longest cached prefix of ``token_ids``; changes nothing. The last token is never
        covered: its forward must run to give the next token's logits."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        parent = ROOT
        bs = self.block_size
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            block_id = self.cached_blocks.get((parent, tuple(token_ids[start : start + bs]), lora_id))
            if block_id is None:
                break
            found.append(block_id)
            parent = self._prefix_id(block_id)
        return found

    def _prefix_id(self, block_id: int) -> int:
        prefix_id = self.blocks[block_id].prefix_id
        if prefix_id is None:
            raise RuntimeError(f"block {block_id} holds no cached prefix")
        return prefix_id

    def num_blocks_to_admit(self, num_tokens: int, cached: list[int]) -> int:
        """Free blocks that admitting a sequence of ``num_tokens`` tokens, reusing ``cached``, takes from the
        pool: new blocks for the rest, plus the cached blocks that are now evictable."""
        new = max(0, -(-num_tokens // self.block_size) - len(cached))
        return new + sum(1 for block_id in cached if self.blocks[block_id].ref_count == 0)

    def allocate_cached_prefix(self, seq_id: int, cached: list[int]) -> None:
        """Start ``seq_id``'s (empty) block table with the blocks ``find_cached_prefix`` returned."""
        if self.block_tables.get(seq_id):
            raise ValueError(f"sequence {seq_id} already has blocks")
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.evictable[block_id]
            block.ref_count += 1
        self.block_tables[seq_id] = list(cached)
        self.prefix_ids_of[seq_id] = [self._prefix_id(b) for b in cached]

    def cache_full_blocks(self, seq_id: int, token_ids: list[int], num_computed_tokens: int, lora_id: int = 0) -> None:
        """Register the sequence's blocks that its computed tokens have filled since the last call. A block
        whose prefix is already cached elsewhere stays unregistered; the sequence continues from that entry."""
        if not self.enable_prefix_caching or seq_id in self.uncached_seq_ids:
            return
        ids = self.prefix_ids_of.setdefault(seq_id, [])
        table = self.block_tables.get(seq_id, [])
        bs = self.block_size
        for i in range(len(ids), min(num_computed_tokens // bs, len(table))):
            key = (ids[-1] if ids else ROOT, tuple(token_ids[i * bs : (i + 1) * bs]), lora_id)
            existing = self.cached_blocks.get(key)
            block = self.blocks[existing if existing is not None else table[i]]
            if existing is None and block.prefix_id is None:
                block.prefix_id, block.key = next(self._next_prefix_id), key
                self.cached_blocks[key] = block.block_id
            ids.append(self._prefix_id(block.block_id))

    # ------------------------------------------------------------------ allocation
    def _first_written_block(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.block_size

    def num_new_blocks_needed(self, seq_id: int, num_computed_tokens: int, num_tokens: int) -> int:
        """Free blocks needed so ``num_tokens`` tokens fit, with writes from ``num_computed_tokens`` on."""
        table = self.block_tables.get(seq_id, [])
        needed = max(0, -(-num_tokens // self.block_size) - len(table))
        first = self._first_written_block(num_computed_tokens)
        needed += sum(1 for block_id in table[first:] if self.blocks[block_id].ref_count > 1)
        return needed

    def allocate_slots(
        self, seq_id: int, num_computed_tokens: int, num_new_tokens: int
    ) -> list[tuple[int, int]] | None:
        """Make the sequence's table hold ``num_new_tokens`` more tokens after its ``num_computed_tokens``, with
        private blocks from ``num_computed_tokens`` on.

        Returns the (src, dst) block copies that copy-on-write requires, or None (and changes nothing) when the
        free list is too short.
        """
        num_tokens = num_computed_tokens + num_new_tokens
        if self.num_new_blocks_needed(seq_id, num_computed_tokens, num_tokens) > self.num_free_blocks:
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
        self.prefix_ids_of[child_seq_id] = list(self.prefix_ids_of.get(parent_seq_id, []))
        if parent_seq_id in self.uncached_seq_ids:
            self.uncached_seq_ids.add(child_seq_id)

    def undo_copies(self, seq_id: int, copies: list[tuple[int, int]]) -> None:
        """Take back copy-on-write copies that will not be made (the sequence is preempted in the step that
        planned them): its table points at the shared source again, and the unwritten copy is freed."""
        table = self.block_tables.get(seq_id, [])
        for src, dst in copies:
            table[table.index(dst)] = src
            self.blocks[src].ref_count += 1
            self.blocks[dst].ref_count -= 1
            if self.blocks[dst].ref_count == 0:
                self.free_block_ids.append(dst)  # a fresh copy: never cached

    # ------------------------------------------------------------------ swap space
    def can_swap_out(self, seq_ids: list[int]) -> bool:
        distinct = {b for seq_id in seq_ids for b in self.block_tables.get(seq_id, [])}
        return len(distinct) <= len(self.cpu_free_block_ids)

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move the sequences' blocks to CPU blocks (a block they share is copied once) and release their device
        blocks. Returns the (device block, CPU block) copies to make before the device blocks are reused."""
        mapping: dict[int, int] = {}
        for seq_id in seq_ids:
            cpu_table = []
            for block_id in self.block_tables.get(seq_id, []):
                if block_id not in mapping:
                    mapping[block_id] = self.cpu_free_block_ids.popleft()
                self.cpu_ref_counts[mapping[block_id]] += 1
                cpu_table.append(mapping[block_id])
            uncached = seq_id in self.uncached_seq_ids
            self.free(seq_id)
            self.cpu_block_tables[seq_id] = cpu_table
            if uncached:  # its KV travels to the CPU and back: still never cached
                self.uncached_seq_ids.add(seq_id)
        return list(mapping.items())

    def num_blocks_to_swap_in(self, seq_ids: list[int]) -> int:
        return len({c for seq_id in seq_ids for c in self.cpu_block_tables.get(seq_id, [])})

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Give the swapped sequences device blocks again (shared ones shared again). Returns the (CPU block,
        device block) copies to make before the next forward. The caller checked the free blocks suffice."""
        mapping: dict[int, int] = {}
        for seq_id in seq_ids:
            table = []
            for cpu_id in self.cpu_block_tables.pop(seq_id):
                if cpu_id in mapping:
                    self.blocks[mapping[cpu_id]].ref_count += 1
                else:
                    mapping[cpu_id] = self._take_free_block()
                table.append(mapping[cpu_id])
                self._release_cpu_block(cpu_id)
            self.block_tables[seq_id] = table
        return list(mapping.items())

    def _release_cpu_block(self, cpu_id: int) -> None:
        self.cpu_ref_counts[cpu_id] -= 1
        if self.cpu_ref_counts[cpu_id] == 0:
            self.cpu_free_block_ids.append(cpu_id)

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references. Blocks nobody references go back to the pool; cached ones stay
        reusable, the sequence's last blocks first in line for eviction."""
        for cpu_id in self.cpu_block_tables.pop(seq_id, []):
            self._release_cpu_block(cpu_id)
        self.prefix_ids_of.pop(seq_id, None)
        self.uncached_seq_ids.discard(seq_id)
        for block_id in reversed(self.block_tables.pop(seq_id, [])):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.prefix_id is None:
                    self.free_block_ids.append(block_id)
                else:
                    self.evictable[block_id] = None

    def stop_caching(self, seq_id: int) -> None:
        """The sequence's blocks never enter the prefix cache (nor those of samples forked from it), until it is
        freed: its KV is not what its token ids say (old weights, or a prompt given as embeddings)."""
        self.uncached_seq_ids.add(seq_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (KV computed before the model's weights changed): no later sequence reuses
        one. Blocks in use stay with their sequences; cached free ones go back to the pool. A sequence that holds
        blocks now (on the device or swapped out) computed some of its KV with the old weights, and the tokens
        after them attend to it: none of its blocks is offered to the cache again."""
        self.uncached_seq_ids.update(self.block_tables, self.cpu_block_tables)
        for block_id in self.evictable:
            self.blocks[block_id].prefix_id = None
            self.free_block_ids.append(block_id)
        self.evictable.clear()
        for block in self.blocks:
            block.key = None
        self.cached_blocks.clear()

    def _take_free_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:  # evict the least recently used cached block
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            if block.key is not None:  # always, for an evictable block
                del self.cached_blocks[block.key]
            block.prefix_id = block.key = None
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"block {block_id} on the free list has ref_count {block.ref_count}"
        block.ref_count = 1
        return block_id
