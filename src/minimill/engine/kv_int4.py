"""The int4 KV cache: its layout, where a step's tokens go, and the portable PyTorch path
(quantize, seal, write, attend) that the compiled kernels (csrc/kv_int4.cpp) are tested against.

An int4 cache (kv_dtype "int4", a uint8 pool) is group-wise, as in KIVI: one block is one group
of G = block_size tokens (INT4_GROUP). A sealed (full) block holds, per layer and kv head,
    K: 4-bit values [head_dim, G / 2] bytes (channel-major; token 2j in the low nibble, 2j + 1
       in the high one), then head_dim float16 scales and head_dim float16 minimums: one
       range per channel over the block's G tokens (keys have per-channel outliers, which a
       per-token range would spread over every other channel)
    V: 4-bit values [G, head_dim / 2] (token-major; channel 2j low, 2j + 1 high), then G
       float16 scales and G float16 minimums: one range per token
with value = minimum + scale * q, q in 0..15; each region is padded to the same size,
G * head_dim / 2 + 4 * max(G, head_dim) bytes.

The open (not yet full) last block of a sequence has no pool block of its own: its tokens
are staged in the int8 layout of attention.py (about 4x the resolution), in units of
U = INT4_STAGE_UNIT tokens, so an open block takes one unit per started U tokens (up to
G / U). A unit holds U tokens' K and V of every layer (per layer and kv head, U * (head_dim + 3)
int8 bytes of K and as many of V), and S = stage_units_per_block of them fit in one pool block
(inside each layer's K and V regions), so staging units are slices of pool blocks, seen through
`stage_view`, and several sequences' units share a block. Unit u lives in pool block u // S, at
slice u % S. When the block's last token arrives, the block manager hands out a pool block for
it and the block is quantized there as a whole ("sealed") from the staged tokens and the new
ones; the units are no longer read, and the block manager takes back those the next open block
does not need. So a running sequence holds its sealed blocks plus a few units: with short
sequences the per-sequence cost past the sealed blocks is a fraction of a block, not one or two
blocks (block_manager.py). Prefix caching only shares full blocks, so only sealed blocks are
shared.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minimill.engine.attention import (
    AttentionMetadata,
    Int4Step,
    attend_gathered,
    block_elems,
    unpacked_k,
    unpacked_v,
    write_kv_reference,
)

# Tokens per int4 group (= block): 64 keeps the per-channel ranges' cost at 4 bytes per
# channel per 64 tokens (3.56x fewer bytes than bf16 for a 64-dim head); 32 would not reach
# 3.5x.
INT4_GROUP = 64
# Tokens per staging unit of an open block (G / U units stage a whole group). Small units keep
# what an open block holds close to what its tokens need: a sequence just past a sealed block
# holds one unit, 1/S of a pool block (S = 8 for SmolLM2's 64-dim heads). Measured at bench
# kv's 48 MB: int4 ran 97 sequences at once with 8-token units, against bf16's 33.
INT4_STAGE_UNIT = 4
INT4_UNITS_PER_GROUP = INT4_GROUP // INT4_STAGE_UNIT


def int4_step(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, stage_units: list[list[int]], kv_stage: torch.Tensor,
              device: torch.device) -> Int4Step:
    """Where each new token goes in an int4 cache: a block that fills this step is sealed
    from its staged tokens plus the new ones into its pool block (the block table holds full
    blocks only); tokens of a block still open go to the sequence's staging units."""
    bs = block_size
    unit = INT4_STAGE_UNIT
    per_group = bs // unit
    slots: list[int] = []
    stage_tokens: list[int] = []
    stage_mapping: list[int] = []
    seal_blocks: list[int] = []
    seal_stage: list[int] = []
    seal_tokens: list[int] = []
    seal_rows: list[int] = []
    seal_offsets: list[int] = []
    open_seqs: list[int] = []
    open_blocks: list[int] = []
    token = 0
    for s, (q_len, seq_len, table) in enumerate(zip(query_lens, seq_lens, block_tables,
                                                      strict=True)):
        units = stage_units[s]
        row = [*units, *[-1] * (per_group - len(units))]
        slots.extend(row)
        for pos in range(seq_len - q_len, seq_len):
            b, offset = pos // bs, pos % bs
            if (b + 1) * bs <= seq_len:  # the block is full once this step is written
                if offset == 0 or pos == seq_len - q_len:
                    seal_blocks.append(table[b])
                    # Tokens before this step's first come from staging (a unit that holds
                    # none of them can be any block: its tokens are all overwritten).
                    seal_stage.extend(max(u, 0) for u in row)
                seal_tokens.append(token)
                seal_rows.append(len(seal_blocks) - 1)
                seal_offsets.append(offset)
            else:
                if offset // unit >= len(units):
                    raise ValueError("an open int4 block needs a staging unit per "
                                     f"{unit} tokens")
                stage_tokens.append(token)
                stage_mapping.append(units[offset // unit] * unit + offset % unit)
            token += 1
        if seq_len % bs:
            open_seqs.append(s)
            open_blocks.append(seq_len // bs)

    def longs(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return Int4Step(
        kv_stage=kv_stage,
        stage_slots=torch.tensor(slots, dtype=torch.int32, device=device).view(-1, per_group),
        stage_tokens=longs(stage_tokens), stage_mapping=longs(stage_mapping),
        seal_blocks=longs(seal_blocks), seal_stage=longs(seal_stage).view(-1, per_group),
        seal_tokens=longs(seal_tokens), seal_rows=longs(seal_rows),
        seal_offsets=longs(seal_offsets), open_seqs=longs(open_seqs),
        open_blocks=longs(open_blocks))


def stage_elems(head_dim: int) -> int:
    """Elements (int8) of one staging unit of one layer, K or V, and kv head."""
    return block_elems(INT4_STAGE_UNIT, head_dim, torch.int8)


def stage_units_per_block(head_dim: int) -> int:
    """Staging units that one pool block holds (S): each layer's K and V regions are cut in
    slices of a unit's K (or V) of every kv head."""
    return block_elems(INT4_GROUP, head_dim, torch.uint8) // stage_elems(head_dim)


def stage_blocks_per_sequence(head_dim: int) -> int:
    """Pool blocks that one sequence's staging can take at most (a whole open block's units,
    in blocks shared with nobody)."""
    return -(-INT4_UNITS_PER_GROUP // stage_units_per_block(head_dim))


def stage_view(pool: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The int4 pool [blocks, layers, 2, kv_heads, block elements] seen as staging units:
    int8 [blocks, S, layers, 2 (K, V), kv_heads, unit elements], unit u at [u // S, u % S]
    (per layer, K of every kv head then V, in the u % S-th slice of that layer's K and V
    regions)."""
    num_blocks, layers, _two, heads, elems = pool.shape
    unit_elems = stage_elems(head_dim)
    per_block = elems // unit_elems
    if per_block < 1:
        raise ValueError("an int4 staging unit does not fit in a pool block")
    flat = pool.view(torch.int8)
    return flat.as_strided(
        (num_blocks, per_block, layers, 2, heads, unit_elems),
        (layers * 2 * heads * elems, 2 * heads * unit_elems, 2 * heads * elems,
         heads * unit_elems, unit_elems, 1), flat.storage_offset())


def stage_layer_views(kv_stage: torch.Tensor, layer: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V staging of one layer, each [blocks, S, kv_heads, unit elements] (views)."""
    return kv_stage[:, :, layer, 0], kv_stage[:, :, layer, 1]


def staged_units(stage: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
    """The units `units` (ids, any shape) of one layer's K or V staging: [..., kv_heads,
    unit elements] (a copy)."""
    per_block = stage.shape[1]
    return stage[units // per_block, units % per_block]


def quantize_int4(x: torch.Tensor, dim: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit over `dim`: (uint8 codes 0..15, float16 scales, float16 minimums),
    value ~ minimum + scale * code. Codes are computed from the float16 minimum and scale, so
    dequantizing gives what attention reads."""
    x = x.float()
    low = x.amin(dim, keepdim=True).to(torch.float16).float()
    span = x.amax(dim, keepdim=True) - low
    # A step 2^-10 larger, then rounded to float16: the range still fits in 15 steps.
    scale = torch.where(span > 0, span / 15 * (1 + 2**-10), torch.ones_like(span))
    scale = scale.to(torch.float16).float()
    codes = torch.round((x - low) / scale).clamp_(0, 15).to(torch.uint8)
    return codes, scale.to(torch.float16).squeeze(dim), low.to(torch.float16).squeeze(dim)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes 0..15 -> [..., n] bytes, element 2j in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] float32 codes."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2).float()


def _int4_meta(blocks: torch.Tensor, values_bytes: int, n: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 scales [..., n], float32 minimums [..., n]) after the packed values."""
    meta = blocks[..., values_bytes:values_bytes + 4 * n].contiguous().view(torch.float16)
    return meta[..., :n].float(), meta[..., n:].float()


def dequantize_int4_k(blocks: torch.Tensor, block_size: int, head_dim: int) -> torch.Tensor:
    """Sealed int4 K blocks [..., block elements] -> float32 [..., block_size, head_dim]."""
    nbytes = block_size * head_dim // 2
    codes = _unpack_nibbles(blocks[..., :nbytes].unflatten(-1, (head_dim, block_size // 2)))
    scales, lows = _int4_meta(blocks, nbytes, head_dim)  # per channel
    return (lows[..., :, None] + scales[..., :, None] * codes).transpose(-1, -2)


def dequantize_int4_v(blocks: torch.Tensor, block_size: int, head_dim: int) -> torch.Tensor:
    """Sealed int4 V blocks [..., block elements] -> float32 [..., block_size, head_dim]."""
    nbytes = block_size * head_dim // 2
    codes = _unpack_nibbles(blocks[..., :nbytes].unflatten(-1, (block_size, head_dim // 2)))
    scales, lows = _int4_meta(blocks, nbytes, block_size)  # per token
    return lows[..., :, None] + scales[..., :, None] * codes


def seal_int4(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
    """Quantize whole groups k, v [m, kv_heads, block_size, head_dim] into pool blocks."""
    _m, _heads, block_size, head_dim = k.shape
    nbytes = block_size * head_dim // 2
    codes, scales, lows = quantize_int4(k, dim=-2)  # per channel over the block's tokens
    packed = _pack_nibbles(codes.transpose(-1, -2))  # [m, heads, d, bs / 2]
    k_cache[blocks, :, :nbytes] = packed.flatten(-2)
    k_cache[blocks, :, nbytes:nbytes + 4 * head_dim] = torch.cat(
        (scales, lows), dim=-1).view(torch.uint8)
    codes, scales, lows = quantize_int4(v, dim=-1)  # per token
    v_cache[blocks, :, :nbytes] = _pack_nibbles(codes).flatten(-2)
    v_cache[blocks, :, nbytes:nbytes + 4 * block_size] = torch.cat(
        (scales, lows), dim=-1).view(torch.uint8)


def write_kv_int4_reference(k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k_stage: torch.Tensor, v_stage: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, meta: AttentionMetadata) -> None:
    """k, v: [num_tokens, kv_heads, head_dim] into one layer's int4 cache: blocks that fill
    this step are sealed, the other tokens go to their sequence's staging units."""
    step = meta.int4
    assert step is not None
    unit = INT4_STAGE_UNIT
    # Sealing first: it reads the staged tokens of a block that this step's tokens of the
    # sequence's next (open) block then overwrite in the same staging units.
    if step.seal_blocks.numel():
        group_k = _staged_group(k_stage, step.seal_stage, unpacked_k)  # [m, heads, bs, d]
        group_v = _staged_group(v_stage, step.seal_stage, unpacked_v)
        group_k[step.seal_rows, :, step.seal_offsets] = k[step.seal_tokens].float()
        group_v[step.seal_rows, :, step.seal_offsets] = v[step.seal_tokens].float()
        seal_int4(k_cache, v_cache, step.seal_blocks, group_k, group_v)
    if step.stage_tokens.numel():
        # One slice of the pool blocks at a time: each is a plain [blocks, heads, elems] view.
        per_block = k_stage.shape[1]
        units, offsets = step.stage_mapping // unit, step.stage_mapping % unit
        for part in range(per_block):
            rows = (units % per_block == part).nonzero().flatten()
            if rows.numel():
                tokens = step.stage_tokens[rows]
                write_kv_reference(k_stage[:, part], v_stage[:, part], k[tokens], v[tokens],
                                   units[rows] // per_block * unit + offsets[rows], unit)


def _staged_group(stage: torch.Tensor, units: torch.Tensor,
                  unpack: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """float32 [rows, kv_heads, G, d]: the tokens of each row's staging units (ids [rows,
    G / U]), in order."""
    return torch.cat([unpack(staged_units(stage, units[:, i]), INT4_STAGE_UNIT)
                      for i in range(units.shape[1])], dim=-2)


def paged_attention_int4_reference(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                                   k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   k_stage: torch.Tensor, v_stage: torch.Tensor,
                                   meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """paged_attention_reference over an int4 cache: sealed blocks from the pool, each
    sequence's open last block from its staging units, and this step's own tokens from their
    exact K and V (k_new, v_new [tokens, kv_heads, d], as written this step), all in float32.

    A prompt chunk thus attends to itself at full precision and to what came before through
    the compressed cache; a decoding token reads the tokens before it from the cache."""
    step = meta.int4
    assert step is not None
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = meta.block_tables.shape[0]
    kv_heads = k_cache.shape[1]
    bs = meta.block_size
    if num_seqs == 0:
        return q.new_empty(num_tokens, num_heads * head_dim)
    tables = meta.block_tables.long()
    keys = dequantize_int4_k(k_cache[tables], bs, head_dim)  # [seqs, width, heads, bs, d]
    values = dequantize_int4_v(v_cache[tables], bs, head_dim)
    if step.open_seqs.numel():
        units = step.stage_slots.long()[step.open_seqs].clamp(min=0)  # [o, G / U]
        keys[step.open_seqs, step.open_blocks] = _staged_group(k_stage, units, unpacked_k)
        values[step.open_seqs, step.open_blocks] = _staged_group(v_stage, units, unpacked_v)
    keys = keys.transpose(1, 2).reshape(num_seqs, kv_heads, -1, head_dim)
    values = values.transpose(1, 2).reshape(num_seqs, kv_heads, -1, head_dim)
    # This step's tokens: sequence and position of each.
    q_lens = meta.query_start[1:] - meta.query_start[:-1]
    seq_of = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), q_lens)
    pos = torch.arange(num_tokens, device=q.device) - meta.query_start[seq_of] \
        + (meta.seq_lens - q_lens)[seq_of]
    keys[seq_of, :, pos] = k_new.float()
    values[seq_of, :, pos] = v_new.float()
    # Past each sequence's length the gathered bytes are anything (table padding, unwritten
    # staging, staging units' bytes read as int4): masked out, but a NaN there would still
    # reach the output through a zero weight.
    written = torch.arange(keys.shape[2], device=q.device)[None, :] < meta.seq_lens[:, None]
    keys = torch.where(written[:, None, :, None], keys, 0.0)
    values = torch.where(written[:, None, :, None], values, 0.0)
    return attend_gathered(q, keys, values, meta, scale)
