"""Block ownership, reference counts and prefix reuse."""

from __future__ import annotations

from minimill.engine.block_manager import BlockManager
from minimill.engine.params import SamplingParams
from minimill.engine.sequence import Sequence

BS = 4


def make_seq(request_id: str, tokens: list[int], cache_salt: str | None = None) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(max_tokens=4, cache_salt=cache_salt),
                    seed=0, eos_token_ids=frozenset())


def compute(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """What a step does: allocate, then (after the model ran) mark computed and cache."""
    assert bm.allocate_slots(seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    bm.cache_full_blocks(seq)


def test_allocates_just_enough_blocks_and_frees_them() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    seq = make_seq("a", list(range(10)))
    compute(bm, seq, 10)
    assert len(seq.block_table) == 3  # ceil(10 / 4)
    assert bm.num_free_blocks == 5
    compute(bm, seq, 0)
    seq.append_token(99)
    compute(bm, seq, 1)  # 11 tokens still fit in 3 blocks
    assert len(seq.block_table) == 3
    for t in (100, 101):
        seq.append_token(t)
        compute(bm, seq, 1)
    assert len(seq.block_table) == 4
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == [] and seq.num_computed_tokens == 0


def test_refuses_without_change_when_short() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = make_seq("a", list(range(12)))
    assert not bm.allocate_slots(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2
    assert bm.allocate_slots(seq, 8)  # a chunk that fits
    assert bm.num_free_blocks == 0


def test_shared_prefix_is_reused_with_reference_counts() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    prefix = list(range(100, 108))  # two full blocks
    a = make_seq("a", [*prefix, 1, 2, 3])
    compute(bm, a, a.num_tokens)
    b = make_seq("b", [*prefix, 7, 8])
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_table[:2]
    assert bm.allocate_slots(b, b.num_tokens - 8, hits)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert all(bm.blocks[i].ref_count == 2 for i in a.block_table[:2])
    bm.free(a)
    assert all(bm.blocks[i].ref_count == 1 for i in b.block_table[:2])


def test_a_prefix_serves_only_sequences_of_the_same_cache_salt() -> None:
    bm = BlockManager(num_blocks=32, block_size=BS)
    prefix = list(range(200, 212))  # three full blocks
    a = make_seq("a", [*prefix, 1], cache_salt="tenant:a")
    compute(bm, a, a.num_tokens)
    assert bm.find_cached_prefix(make_seq("b", [*prefix, 2], cache_salt="tenant:b")) == []
    assert bm.find_cached_prefix(make_seq("u", [*prefix, 2])) == []  # unsalted: shared pool
    again = make_seq("a2", [*prefix, 3], cache_salt="tenant:a")
    assert bm.find_cached_prefix(again) == a.block_table[:3]
    assert bm.pending_hashes(again)[:3] != bm.pending_hashes(make_seq("u2", [*prefix, 3]))[:3]


def test_reset_prefix_cache_forgets_prefixes_only_when_the_pool_is_idle() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    prefix = list(range(100, 108))
    a = make_seq("a", [*prefix, 1])
    compute(bm, a, a.num_tokens)
    assert not bm.reset_prefix_cache()  # a still holds its blocks
    assert len(bm.find_cached_prefix(make_seq("b", [*prefix, 2]))) == 2
    bm.free(a)
    assert len(bm.find_cached_prefix(make_seq("b", [*prefix, 2]))) == 2  # cached while free
    assert bm.reset_prefix_cache()
    assert bm.find_cached_prefix(make_seq("c", [*prefix, 3])) == []
    assert bm.cached_blocks() == [] and bm.num_free_blocks == 16


def test_different_earlier_tokens_break_the_chain() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(bm, a, a.num_tokens)
    # Same second block, different first block: the hash chain must not match either.
    b = make_seq("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.find_cached_prefix(b) == []


def test_last_token_is_always_left_to_compute() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq("a", list(range(8)))
    compute(bm, a, 8)
    again = make_seq("b", list(range(8)))
    # Both blocks are cached, but the request needs logits for its last token.
    assert len(bm.find_cached_prefix(again)) == 1


def test_freed_blocks_stay_cached_until_reused() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq("a", list(range(9)))
    compute(bm, a, 9)
    first_block = a.block_table[0]
    bm.free(a)
    b = make_seq("b", list(range(9)))
    hits = bm.find_cached_prefix(b)
    assert hits[:1] == [first_block]
    assert bm.allocate_slots(b, b.num_tokens - len(hits) * BS, hits)
    assert bm.num_free_blocks == 4 - len(b.block_table)
    bm.free(b)
    # Filling the pool with other tokens evicts the cached blocks.
    c = make_seq("c", list(range(50, 66)))
    compute(bm, c, 16)
    assert bm.find_cached_prefix(make_seq("d", list(range(9)))) == []


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_seq("a", list(range(9)))
    compute(bm, a, 9)
    assert bm.find_cached_prefix(make_seq("b", list(range(9)))) == []


def test_int4_open_blocks_hold_staging_units_not_blocks() -> None:
    """int4 KV: the block table holds full blocks only; an open block holds one staging unit
    (a slice of a pool block) per started unit of tokens, taken as it fills and given back
    once no step reads it; sequences share staging blocks, and a staging block goes back to
    the pool once all its slices are free; a block's own pool block is handed out in the step
    that fills (seals) it."""
    bm = BlockManager(num_blocks=6, block_size=BS, int4_staging=True, stage_unit_tokens=2,
                      stage_units_per_block=2)
    a = make_seq("a", list(range(8)))
    compute(bm, a, 8)
    assert len(a.block_table) == 2 and a.stage_units == []  # two full blocks: nothing open
    assert bm.num_free_blocks == 4 and bm.num_staging_blocks == 0
    b = make_seq("b", list(range(9)))
    compute(bm, b, 9)  # 2 full blocks, 1 token open: one unit, no block for it
    assert len(b.block_table) == 2 and len(b.stage_units) == 1
    assert bm.num_free_blocks == 1 and bm.num_staging_blocks == 1
    staging = b.stage_units[0] // 2
    assert staging not in b.block_table and staging not in a.block_table
    b.append_token(9)
    compute(bm, b, 1)  # 2 of 4 tokens open: still one unit
    assert len(b.stage_units) == 1
    b.append_token(10)
    compute(bm, b, 1)  # 3 of 4: a second unit, the other slice of the same staging block
    assert [u // 2 for u in b.stage_units] == [staging, staging]
    assert bm.num_free_blocks == 1 and bm.num_staging_blocks == 1
    a.append_token(8)
    assert bm.allocate_slots(a, 1)  # a's 9th token opens a block: a new staging block
    assert len(a.block_table) == 2 and len(a.stage_units) == 1 and bm.num_free_blocks == 0
    c = make_seq("c", [5])
    assert bm.allocate_slots(c, 1)  # no free block, but a free slice of a's staging block
    assert c.stage_units[0] // 2 == a.stage_units[0] // 2 and bm.num_staging_blocks == 2
    b.append_token(11)
    blocks, units = bm.num_free_blocks, list(b.stage_units)
    assert not bm.allocate_slots(b, 1)  # b's 12th token fills its block: no block is free
    assert b.stage_units == units and len(b.block_table) == 2 and bm.num_free_blocks == blocks
    bm.free(c)
    assert bm.num_free_blocks == 0  # a still holds the other slice
    bm.free(a)
    assert bm.num_free_blocks == 3 and bm.num_staging_blocks == 1  # a's two blocks, staging
    # b's 12th token fills its third block: a block for it now, its units read by the seal.
    assert bm.allocate_slots(b, 1)
    assert len(b.block_table) == 3 and len(b.stage_units) == 2 and bm.num_free_blocks == 2
    b.num_computed_tokens += 1
    bm.cache_full_blocks(b)
    b.append_token(12)
    compute(bm, b, 1)  # a fresh open block: one unit is enough, the other goes back
    assert len(b.block_table) == 3 and len(b.stage_units) == 1 and bm.num_free_blocks == 2
    bm.free(b)
    assert b.stage_units == [] and b.block_table == [] and bm.num_free_blocks == 6
    assert bm.num_staging_blocks == 0


def test_int4_prefill_across_blocks_keeps_the_units_its_seal_reads() -> None:
    """A chunk that seals a block holding staged tokens and opens the next keeps every unit
    the seal reads, however few the new open block needs."""
    bm = BlockManager(num_blocks=8, block_size=BS, int4_staging=True,
                      enable_prefix_caching=False, stage_unit_tokens=2, stage_units_per_block=1)
    seq = make_seq("a", list(range(13)))
    compute(bm, seq, 3)  # 3 staged tokens: two units
    assert seq.block_table == [] and len(seq.stage_units) == 2
    compute(bm, seq, 2)  # seals block 0 (3 staged + 1 new), 1 token open
    assert len(seq.block_table) == 1 and len(seq.stage_units) == 2
    compute(bm, seq, 8)  # seals blocks 1 and 2, 1 open: only unit 0 is read or written
    assert len(seq.block_table) == 3 and len(seq.stage_units) == 1
    assert bm.num_free_blocks == 8 - 4

