"""Sliding-window layers' KV, bounded whatever the context, out of the one KV pool.

A model that interleaves sliding-window and full layers (Gemma 3, gpt-oss) lays its layers
out in groups of equal size (`WindowLayout`): the full layers are group 0, the sliding layers
fill groups 1..K. A pool block holds one group's layers for `block_size` tokens, so every
block is the same size and full and sliding layers draw from the same free list: the pool
serves many short sequences or a few long ones alike, as one pool over every layer does.

A sequence's full layers hold a block per `block_size` tokens (`seq.block_table`, prefix
cached as before). Its sliding layers hold a "window block" per `block_size` tokens: one pool
block per sliding group (`seq.window_table[i]`, a K-tuple), and only while the window can
still reach it: a sliding layer's query at position p reads keys p - window + 1 .. p, so once
a sequence has computed n tokens its window blocks before the one holding position
n - window + 1 are read by no later step and go back to the pool (`release_passed`). A
sequence holds at most `chunk_bound` window blocks (the window and one step's chunk), so a
128k-token context's sliding layers take what those of a window-long one do.

The block tables keep their logical indexing (a released entry is handed to the kernels as
block 0: they skip the blocks before every query's window and never read it), so the
attention kernels run unchanged, one table per group.

Prefix reuse: a window block is registered under the chained hash of the same tokens' full
block, and a released one keeps its hash until one of its pool blocks is handed out again.
A prefix found for the full layers is used up to where the window blocks its next query
reads are found too (`usable_prefix`); the rest is recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

from minimill.engine.sequence import Sequence
from minimill.models.types import ModelConfig

WindowBlock = tuple[int, ...]  # one pool block per sliding group


@dataclass(frozen=True, slots=True)
class WindowLayout:
    """Where each layer's KV sits: (group, slot); group 0 holds the full layers, groups
    1..window_groups the sliding ones, `group_layers` slots each."""

    group_layers: int
    window_groups: int
    window: int
    places: tuple[tuple[int, int], ...]  # per layer: (group, slot in the group)

    @staticmethod
    def of(config: ModelConfig) -> WindowLayout | None:
        """The layout for a model with both sliding-window and full layers, else None (a
        model whose every layer slides, or none, keeps one group of every layer)."""
        layers = config.num_hidden_layers
        sliding = [i for i in range(layers) if config.is_sliding(i)]
        full = [i for i in range(layers) if not config.is_sliding(i)]
        if not sliding or not full or config.sliding_window is None:
            return None
        per_group = len(full)
        places: list[tuple[int, int]] = [(0, 0)] * layers
        for slot, i in enumerate(full):
            places[i] = (0, slot)
        for n, i in enumerate(sliding):
            places[i] = (1 + n // per_group, n % per_group)
        return WindowLayout(per_group, -(-len(sliding) // per_group), config.sliding_window,
                            tuple(places))


def first_live_block(num_computed: int, window: int, block_size: int) -> int:
    """The first block a query at position `num_computed` (the next to compute) still reads."""
    return max(0, num_computed - window + 1) // block_size


def chunk_bound(window: int, max_chunk: int, block_size: int) -> int:
    """Most window blocks a sequence holds at once: a step computing up to `max_chunk` tokens
    reads the window before its first token and writes the chunk's blocks."""
    return -(-(window - 1 + max_chunk) // block_size) + 2


class PoolAccess(Protocol):
    """What the window blocks need of the block manager, which owns the free list."""

    def take_block(self) -> int:
        """A free pool block, held once."""

    def hold_block(self, block: int) -> None:
        """Hold a block once more (out of the free list if it was free)."""

    def release_block(self, block: int) -> None:
        """Drop a hold (into the free list at the last)."""

    def block_refs(self, block: int) -> int: ...


class WindowBlocks:
    """The sequences' window blocks (`seq.window_table`) and their prefix cache."""

    def __init__(self, pool: PoolAccess, groups: int, block_size: int, window: int,
                 max_chunk: int, enable_prefix_caching: bool) -> None:
        self.pool = pool
        self.groups = groups
        self.block_size = block_size
        self.window = window
        self.bound = chunk_bound(window, max_chunk, block_size)
        self.enable_prefix_caching = enable_prefix_caching
        # hash -> (window block, its tokens); pool block -> the hash it is cached under.
        self._cached: dict[int, tuple[WindowBlock, tuple[int, ...]]] = {}
        self._hash_of: dict[int, int] = {}

    def held(self, seq: Sequence) -> int:
        """Window blocks the sequence holds: its table past the released ones, which are
        always the table's start (what the window passed, or a reused prefix's)."""
        table = seq.window_table
        released = min(first_live_block(seq.num_computed_tokens, self.window, self.block_size),
                       len(table))
        while released and table[released - 1] is not None:  # not yet given back
            released -= 1
        return len(table) - released

    def usable_prefix(self, seq: Sequence, hashes: Seq[int]) -> int:
        """How many of the prefix blocks with these chained hashes (found for the full
        layers) a sequence can reuse: the most whose next query finds every window block it
        reads cached."""
        bs = self.block_size
        count = len(hashes)
        while count:
            first = first_live_block(count * bs, self.window, bs)
            missing = next((i for i in range(count - 1, first - 1, -1)
                            if self._find(hashes[i], seq.token_ids[i * bs:(i + 1) * bs])
                            is None), None)
            if missing is None:
                return count
            # Every longer prefix than `missing` reads window block `missing` too.
            count = missing
        return 0

    def _find(self, h: int, tokens: Seq[int]) -> WindowBlock | None:
        entry = self._cached.get(h)
        if entry is None or entry[1] != tuple(tokens):
            return None
        return entry[0]

    def blocks_needed(self, seq: Sequence, prefix_hashes: Seq[int], total_tokens: int,
                      whole_prompt: bool = False) -> int:
        """Pool blocks taken from the free list to hold `total_tokens` computed tokens (on a
        sequence without window blocks, after reusing the prefix with these hashes, whose
        blocks nobody holds come out of the free list too). `whole_prompt`: the most a
        prompt computed chunk by chunk holds at once (the window's passed blocks go back as
        its chunks are computed)."""
        bs = self.block_size
        needed = -(-total_tokens // bs)
        held, reclaimed = self.held(seq), 0
        if not seq.window_table and prefix_hashes:
            first = first_live_block(len(prefix_hashes) * bs, self.window, bs)
            reused = [self._cached[h][0] for h in prefix_hashes[first:]]
            held = len(reused)
            reclaimed = sum(1 for wb in reused for b in wb if self.pool.block_refs(b) == 0)
            fresh = needed - len(prefix_hashes)
        else:
            fresh = needed - len(seq.window_table)
        if whole_prompt:
            fresh = min(fresh, max(0, self.bound - held))
        return reclaimed + max(0, fresh) * self.groups

    def attach_prefix(self, seq: Sequence, prefix_hashes: Seq[int]) -> None:
        """Give a sequence without window blocks those of its reused prefix (the hashes of
        its blocks; those the window passed marked released). Before any block is taken for
        anything else: taking one could uncache these."""
        if seq.window_table or not prefix_hashes:
            return
        first = first_live_block(len(prefix_hashes) * self.block_size, self.window,
                                 self.block_size)
        seq.window_table.extend([None] * first)
        for h in prefix_hashes[first:]:
            window_block = self._cached[h][0]
            for b in window_block:
                self.pool.hold_block(b)
            seq.window_table.append(window_block)

    def grow(self, seq: Sequence, total_tokens: int) -> None:
        """Give the sequence window blocks for `total_tokens` computed tokens."""
        for _ in range(-(-total_tokens // self.block_size) - len(seq.window_table)):
            seq.window_table.append(tuple(self.pool.take_block() for _ in range(self.groups)))

    def register(self, seq: Sequence, hashes: Seq[int]) -> None:
        """Cache the sequence's full, computed window blocks under the full layers' chained
        hashes of the same tokens (`hashes[i]`: block i's)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i, h in enumerate(hashes[:len(seq.window_table)]):
            window_block = seq.window_table[i]
            if window_block is None or h in self._cached or window_block[0] in self._hash_of:
                continue
            self._cached[h] = (window_block, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            for b in window_block:
                self._hash_of[b] = h

    def forget(self, block: int) -> None:
        """A pool block is handed out again: the window block it was part of is no longer
        cached (its other blocks stay free, as plain blocks)."""
        h = self._hash_of.pop(block, None)
        if h is None:
            return
        window_block, _ = self._cached.pop(h)
        for b in window_block:
            self._hash_of.pop(b, None)

    def release_passed(self, seq: Sequence) -> None:
        """Give back the window blocks no later query of the sequence reads."""
        first = first_live_block(seq.num_computed_tokens, self.window, self.block_size)
        table = seq.window_table
        # Released entries are the table's start: walk back from the first live block to them.
        i = min(first, len(table)) - 1
        while i >= 0 and (window_block := table[i]) is not None:
            for b in window_block:
                self.pool.release_block(b)
            table[i] = None
            i -= 1

    def free(self, seq: Sequence) -> None:
        for window_block in reversed(seq.window_table):  # tail first: least reusable first
            if window_block is not None:
                for b in window_block:
                    self.pool.release_block(b)
        seq.window_table = []

    def reset(self) -> None:
        self._cached.clear()
        self._hash_of.clear()


def group_tables(tables: list[list[WindowBlock | None]], group: int) -> list[list[int]]:
    """One sliding group's block tables (a released entry as block 0: never read)."""
    return [[0 if wb is None else wb[group] for wb in table] for table in tables]
