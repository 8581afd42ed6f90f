"""KV block ownership: allocation, reference counts, and chained block hashes for prefix reuse.

A block holds `block_size` consecutive tokens of one or more sequences (shared prefixes). Once a
block is full and its KV computed, it is registered under a hash chained over every token
before it, so a later request with the same prefix reuses it instead of recomputing. The chain
starts from the request's cache salt (`Sequence.prefix_root`, a tenant's): requests of different
salts never share blocks, so one cannot learn from its cached tokens what another sent. Freed
blocks keep their hash until they are handed out again (least recently freed first), so the
prefix cache costs no memory of its own.

With KV tiers (kv_tiers.py), a cached block handed out again is first copied down a tier
(`pending_saves`), and a prefix lookup that runs out of pool hits goes on in the tiers: blocks
found there get fresh pool blocks and count as computed once their bytes are copied back
(`pending_loads`). The engine does both copies before the step's model run, saves first, so a
block that is saved and reused in the same step is read before it is overwritten.

With a flash tier, every block is also written through as soon as it is full and computed
(`take_new_full_blocks`): a process killed without warning leaves its sequences' KV on flash,
so a request resumed by the restarted process reloads its context instead of recomputing it.

With an int4 cache (`int4_staging`, kv_int4.py) a sequence's block table holds its full blocks
only: a block's pool block is handed out in the step that fills it, and until then the open
block's tokens are staged in units of a few tokens (`seq.stage_units`), taken as the block
fills and given back once no step reads them. A unit is one of the `stage_units_per_block`
slices of a pool block: a staging block is taken from the pool when no slice of one is free
and goes back once all its slices are, so sequences share staging blocks and one just past a
sealed block holds a slice, not a block. Staging and blocks come out of one pool, so what a
running sequence holds is what admission counts.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from minimill.engine.sequence import Sequence
from minimill.engine.window_pool import WindowBlocks, WindowLayout

if TYPE_CHECKING:
    import torch

    from minimill.engine.kv_tiers import KvTiers


class Block:
    __slots__ = ("block_hash", "block_id", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None  # set once full and computed
        self.token_ids: tuple[int, ...] = ()  # checked on a hash hit, so collisions cannot alias


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """A 128-bit hash of a block's tokens and every token before it (through `prev_hash`).

    Stable across processes and machines (flash tier files are named by it), and wide enough
    that distinct prefixes do not collide; the tokens are compared on every hit all the same.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update((prev_hash or 0).to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


@dataclass(slots=True)
class CachedPrefix:
    """A computed prefix found for a sequence: pool blocks first, then blocks from a tier."""

    block_ids: list[int] = field(default_factory=list)  # pool blocks, in order
    # Blocks after those, found in a tier: (chained hash, token ids, KV on the CPU).
    restored: list[tuple[int, tuple[int, ...], torch.Tensor]] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids) + len(self.restored)


class _Needs(NamedTuple):
    num_new_blocks: int  # pool blocks for the block table (restored ones included)
    num_units: int  # int4 staging units the sequence holds after
    num_new_units: int  # ... of them taken now
    fits: bool


class BlockManager:
    """Owns every KV block; sequences hold block ids in `seq.block_table`."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 tiers: KvTiers | None = None, int4_staging: bool = False,
                 stage_units_per_block: int = 1, stage_unit_tokens: int | None = None,
                 window: WindowLayout | None = None, max_chunk: int = 0) -> None:
        """`window`: the layout of a model with sliding-window and full layers, whose
        sliding layers' blocks come from this pool too (window_pool.py); `max_chunk`: the
        most tokens a step computes for one sequence."""
        self.block_size = block_size
        self.window = None if window is None else WindowBlocks(
            self, window.window_groups, block_size, window.window, max_chunk,
            enable_prefix_caching)
        self.int4_staging = int4_staging
        self.stage_units_per_block = max(1, stage_units_per_block)  # 0: no int4 staging
        if stage_unit_tokens is None:
            from minimill.engine.kv_int4 import INT4_STAGE_UNIT

            stage_unit_tokens = INT4_STAGE_UNIT
        self.stage_unit_tokens = stage_unit_tokens  # tokens per staging unit
        # int4 staging blocks: block -> its slices handed out, and -> its free slices (only
        # blocks with some free), so a unit is taken from a shared block before a new one.
        self._stage_used: dict[int, int] = {}
        self._stage_free: dict[int, list[int]] = {}
        self._num_free_units = 0
        self.enable_prefix_caching = enable_prefix_caching
        self.tiers = tiers if enable_prefix_caching and tiers is not None \
            and tiers.enabled else None
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first; O(1) removal when a cached one is reused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        # request_id -> hashes of that sequence's full, computed blocks (a chain).
        self._seq_hashes: dict[str, list[int]] = {}
        # Copies the engine makes before the next model run (saves first):
        self.pending_saves: list[tuple[int, int, tuple[int, ...]]] = []  # (block, hash, tokens)
        # Blocks registered since the last take_new_full_blocks, to write through to flash.
        self.write_through = self.tiers is not None and self.tiers.flash is not None
        self._new_full: list[tuple[int, int, tuple[int, ...]]] = []  # (block, hash, tokens)
        self.pending_loads: list[tuple[int, torch.Tensor]] = []  # (block, KV from a tier)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Pool blocks a sequence of this many computed tokens holds in its block table."""
        if self.int4_staging:
            return num_tokens // self.block_size  # full blocks; the open one is staged
        return -(-num_tokens // self.block_size)

    @property
    def num_staging_blocks(self) -> int:
        """Pool blocks that int4 staging units are cut from right now."""
        return len(self._stage_used)

    def stage_units_needed(self, num_computed: int, num_total: int) -> int:
        """int4: staging units that a step computing tokens num_computed..num_total reads or
        writes: those holding the open block's staged tokens (sealed this step or not) and
        those the tokens after the last full block go to."""
        if not self.int4_staging:
            return 0
        unit = self.stage_unit_tokens
        staged, after = num_computed % self.block_size, num_total % self.block_size
        if num_total // self.block_size == num_computed // self.block_size:
            return -(-after // unit)  # still the same open block
        return max(-(-staged // unit), -(-after // unit))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Pool blocks holding a computed prefix of a sequence that has no blocks yet."""
        return self.find_prefix(seq, use_tiers=False).block_ids

    def find_prefix(self, seq: Sequence, use_tiers: bool = True) -> CachedPrefix:
        """The computed prefix of a sequence that has no blocks yet: pool blocks, then (with
        tiers) blocks a tier holds.

        At least the last token is always left to compute, so the caller gets logits for it.
        Takes no references: pass the result to `allocate_slots`.
        """
        found = CachedPrefix()
        if not self.enable_prefix_caching or seq.block_table:
            return found
        prev = seq.prefix_root
        bs = self.block_size
        tiers = self.tiers if use_tiers else None
        for start in range(0, seq.num_tokens - 1 - bs + 1, bs):
            tokens = tuple(seq.token_ids[start:start + bs])
            h = chain_hash(prev, tokens)
            block_id = None if found.restored else self._hash_to_block.get(h)
            if block_id is not None and self.blocks[block_id].token_ids == tokens:
                found.block_ids.append(block_id)
            elif tiers is not None and h in tiers and \
                    (kv := tiers.fetch(h, tokens)) is not None:
                found.restored.append((h, tokens, kv))
            else:
                break
            prev = h
        if self.window is not None:
            self._trim_to_window(seq, found)
        return found

    def _prefix_hashes(self, cached: CachedPrefix) -> list[int]:
        hashes = [self.blocks[b].block_hash for b in cached.block_ids]
        return [h for h in hashes if h is not None] + [h for h, _, _ in cached.restored]

    def _trim_to_window(self, seq: Sequence, found: CachedPrefix) -> None:
        """Keep only as much of a found prefix as the window pool holds the sliding layers'
        KV for (the rest is recomputed)."""
        assert self.window is not None
        usable = self.window.usable_prefix(seq, self._prefix_hashes(found))
        del found.restored[max(0, usable - len(found.block_ids)):]
        del found.block_ids[usable:]

    def pending_hashes(self, seq: Sequence) -> list[int]:
        """Chained hashes of the sequence's full blocks (computed or not), for the scheduler to
        spot waiting requests that share a prefix being computed right now."""
        hashes: list[int] = []
        prev = seq.prefix_root
        bs = self.block_size
        for start in range(0, seq.num_tokens - bs + 1, bs):
            prev = chain_hash(prev, tuple(seq.token_ids[start:start + bs]))
            hashes.append(prev)
        return hashes

    def can_allocate(self, seq: Sequence, num_new_tokens: int,
                     cached: CachedPrefix | None = None) -> bool:
        """Whether `allocate_slots(seq, num_new_tokens, cached)` would find room (no change)."""
        return self._needs(seq, num_new_tokens, cached or CachedPrefix(), whole_prompt=True).fits

    def _needs(self, seq: Sequence, num_new_tokens: int, cached: CachedPrefix,
               whole_prompt: bool = False) -> _Needs:
        """What `num_new_tokens` more computed tokens take from the pool, and whether it has it."""
        num_cached_tokens = cached.num_blocks * self.block_size
        total = seq.num_computed_tokens + num_cached_tokens + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(seq.block_table) - len(cached.block_ids)
        # Cached blocks that nobody holds right now come out of the free pool too.
        num_reclaimed = sum(1 for b in cached.block_ids if self.blocks[b].ref_count == 0)
        num_units = self.stage_units_needed(seq.num_computed_tokens + num_cached_tokens, total)
        num_new_units = max(0, num_units - len(seq.stage_units))
        num_released = max(0, len(seq.stage_units) - num_units)
        # New units come from free slices (those given back here included), then new blocks.
        num_unit_blocks = -(-max(0, num_new_units - self._num_free_units - num_released)
                            // self.stage_units_per_block)
        fits = num_new_blocks + num_reclaimed + num_unit_blocks <= len(self._free)
        if self.window is not None:
            fits = fits and num_new_blocks + num_reclaimed + num_unit_blocks \
                + self.window.blocks_needed(seq, self._prefix_hashes(cached), total,
                                            whole_prompt) <= len(self._free)
        return _Needs(num_new_blocks, num_units, num_new_units, fits)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       cached: CachedPrefix | list[int] | tuple[int, ...] = ()) -> bool:
        """Make room for `num_new_tokens` more computed tokens; False (and no change) if short.

        `cached` (from `find_prefix`) is attached first and counts as computed; blocks restored
        from a tier take fresh pool blocks, filled before the next model run.
        """
        if not isinstance(cached, CachedPrefix):
            cached = CachedPrefix(list(cached))
        num_new_blocks, num_units, num_new_units, fits = self._needs(seq, num_new_tokens, cached)
        if not fits:
            return False
        num_cached_tokens = cached.num_blocks * self.block_size
        if self.window is not None:
            self.window.attach_prefix(seq, self._prefix_hashes(cached))
        while len(seq.stage_units) > num_units:  # staged tokens no step reads any more
            self._release_unit(seq.stage_units.pop())
        if cached.num_blocks:
            hashes = self._seq_hashes.setdefault(seq.request_id, [])
            for block_id in cached.block_ids:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self._free[block_id]
                block.ref_count += 1
                seq.block_table.append(block_id)
                assert block.block_hash is not None
                hashes.append(block.block_hash)
            for h, tokens, kv in cached.restored:
                block_id = self._take_free_block()
                block = self.blocks[block_id]
                if h not in self._hash_to_block:
                    block.block_hash, block.token_ids = h, tokens
                    self._hash_to_block[h] = block_id
                self.pending_loads.append((block_id, kv))
                seq.block_table.append(block_id)
                hashes.append(h)
            num_new_blocks -= len(cached.restored)
            seq.num_computed_tokens += num_cached_tokens
            seq.num_cached_tokens += num_cached_tokens
        for _ in range(max(0, num_new_blocks)):
            seq.block_table.append(self._take_free_block())
        for _ in range(num_new_units):
            seq.stage_units.append(self._take_unit())
        if self.window is not None:
            self.window.grow(seq, seq.num_computed_tokens + num_new_tokens)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly full, computed blocks in the prefix cache (and give
        back the window blocks no later step reads)."""
        if self.enable_prefix_caching:
            self._register_full_blocks(seq)
        if self.window is not None:
            if self.enable_prefix_caching:
                self.window.register(seq, self._seq_hashes[seq.request_id])
            self.window.release_passed(seq)

    def _register_full_blocks(self, seq: Sequence) -> None:
        hashes = self._seq_hashes.setdefault(seq.request_id, [])
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        for i in range(len(hashes), num_full):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(hashes[-1] if hashes else seq.prefix_root, tokens)
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and h not in self._hash_to_block:
                block.block_hash = h
                block.token_ids = tokens
                self._hash_to_block[h] = block.block_id
                if self.write_through:
                    self._new_full.append((block.block_id, h, tokens))

    def take_new_full_blocks(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """(block id, chained hash, token ids) of blocks registered since the last call; their
        KV is intact until the next model run."""
        fresh, self._new_full = self._new_full, []
        return fresh

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix in the pool (tiers below are left as they are), so the
        next requests compute their prompts in full, as on a fresh engine (benchmarks run a
        workload twice). Only when no sequence holds a block: False, and nothing done, else."""
        if self.num_free_blocks != self.num_blocks:
            return False
        if self.window is not None:
            self.window.reset()
        for block in self.blocks:
            block.block_hash, block.token_ids = None, ()
        self._hash_to_block.clear()
        return True

    def cached_blocks(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """(block id, chained hash, token ids) of every computed block the pool holds."""
        return [(b, h, self.blocks[b].token_ids) for h, b in self._hash_to_block.items()]

    def take_transfers(self) -> tuple[list[tuple[int, int, tuple[int, ...]]],
                                      list[tuple[int, torch.Tensor]]]:
        """The saves and loads recorded since the last call (the engine performs them)."""
        saves, loads = self.pending_saves, self.pending_loads
        self.pending_saves, self.pending_loads = [], []
        return saves, loads

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; its blocks stay in the prefix cache until reused."""
        # Tail first, so the least reusable blocks are handed out again first.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table = []
        if self.window is not None:
            self.window.free(seq)
        for unit in seq.stage_units:
            self._release_unit(unit)
        seq.stage_units = []
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        self._seq_hashes.pop(seq.request_id, None)

    def _take_unit(self) -> int:
        """A staging unit (block * S + slice): a free slice of a staging block in use, else the
        first slice of a block taken from the pool."""
        per_block = self.stage_units_per_block
        if self._stage_free:
            block_id = next(reversed(self._stage_free))  # the latest: fill one block at a time
            free = self._stage_free[block_id]
            part = free.pop()
            if not free:
                del self._stage_free[block_id]
            self._num_free_units -= 1
        else:
            block_id, part = self._take_free_block(), 0
            if per_block > 1:
                self._stage_free[block_id] = list(range(per_block - 1, 0, -1))
                self._num_free_units += per_block - 1
            self._stage_used[block_id] = 0
        self._stage_used[block_id] += 1
        return block_id * per_block + part

    def _release_unit(self, unit: int) -> None:
        """Give back a staging unit; its block goes back to the pool once all its slices are
        free (it caches nothing, so it is handed out again first)."""
        per_block = self.stage_units_per_block
        block_id, part = divmod(unit, per_block)
        self._stage_used[block_id] -= 1
        if self._stage_used[block_id]:
            self._stage_free.setdefault(block_id, []).append(part)
            self._num_free_units += 1
            return
        del self._stage_used[block_id]
        self._num_free_units -= len(self._stage_free.pop(block_id, []))
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count == 0 and block.block_hash is None
        self._free[block_id] = None
        self._free.move_to_end(block_id, last=False)

    # The pool as the window blocks use it (window_pool.PoolAccess).
    def take_block(self) -> int:
        return self._take_free_block()

    def hold_block(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def release_block(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None

    def block_refs(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        if self.window is not None:
            self.window.forget(block_id)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self._hash_to_block.get(block.block_hash) == block_id:
                del self._hash_to_block[block.block_hash]
                if self.tiers is not None:
                    self.pending_saves.append((block_id, block.block_hash, block.token_ids))
            block.block_hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block_id
