"""KV block ownership: allocation, reference counts, and chained block hashes for prefix reuse.

A block holds `block_size` consecutive tokens of one or more sequences (shared prefixes). Once a
block is full and its KV computed, it is registered under a hash chained over every token
before it, so a later request with the same prefix reuses it instead of recomputing. Freed
blocks keep their hash until they are handed out again (least recently freed first), so the
prefix cache costs no memory of its own.
"""

from __future__ import annotations

from collections import OrderedDict

from minimill.engine.sequence import Sequence


class Block:
    __slots__ = ("block_hash", "block_id", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None  # set once full and computed
        self.token_ids: tuple[int, ...] = ()  # checked on a hash hit, so collisions cannot alias


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((prev_hash, token_ids))


class BlockManager:
    """Owns every KV block; sequences hold block ids in `seq.block_table`."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first; O(1) removal when a cached one is reused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        # request_id -> hashes of that sequence's full, computed blocks (a chain).
        self._seq_hashes: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding a computed prefix of a sequence that has no blocks yet.

        At least the last token is always left to compute, so the caller gets logits for it.
        Takes no references: pass the result to `allocate_slots`.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return []
        hits: list[int] = []
        prev: int | None = None
        bs = self.block_size
        for start in range(0, seq.num_tokens - 1 - bs + 1, bs):
            tokens = tuple(seq.token_ids[start:start + bs])
            h = chain_hash(prev, tokens)
            block_id = self._hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            prev = h
        return hits

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       cached_block_ids: list[int] | tuple[int, ...] = ()) -> bool:
        """Make room for `num_new_tokens` more computed tokens; False (and no change) if short.

        `cached_block_ids` (from `find_cached_prefix`) are attached first and count as computed.
        """
        num_cached_tokens = len(cached_block_ids) * self.block_size
        total = seq.num_computed_tokens + num_cached_tokens + num_new_tokens
        num_new_blocks = (self.blocks_needed(total) - len(seq.block_table)
                          - len(cached_block_ids))
        # Cached blocks that nobody holds right now come out of the free pool too.
        num_reclaimed = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        if num_new_blocks + num_reclaimed > len(self._free):
            return False
        if cached_block_ids:
            hashes = self._seq_hashes.setdefault(seq.request_id, [])
            for block_id in cached_block_ids:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self._free[block_id]
                block.ref_count += 1
                seq.block_table.append(block_id)
                assert block.block_hash is not None
                hashes.append(block.block_hash)
            seq.num_computed_tokens += num_cached_tokens
            seq.num_cached_tokens += num_cached_tokens
        for _ in range(max(0, num_new_blocks)):
            seq.block_table.append(self._take_free_block())
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(seq.request_id, [])
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        for i in range(len(hashes), num_full):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(hashes[-1] if hashes else None, tokens)
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and h not in self._hash_to_block:
                block.block_hash = h
                block.token_ids = tokens
                self._hash_to_block[h] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; its blocks stay in the prefix cache until reused."""
        # Tail first, so the least reusable blocks are handed out again first.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        self._seq_hashes.pop(seq.request_id, None)

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self._hash_to_block.get(block.block_hash) == block_id:
                del self._hash_to_block[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block_id
