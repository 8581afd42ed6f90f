"""Attention over the paged KV cache: the step's metadata, the cache layout, and the portable
PyTorch path that every fast path (csrc/cpu_kernels.cpp) is tested against.

One KV tensor holds every layer: [num_blocks, layers, 2 (K, V), kv_heads, block_size * head_dim],
so one block of one sequence, across all layers, is one contiguous run of bytes (what a tier
below the device pool copies). (A model with sliding-window and full layers holds one group of
its layers per block instead, window_pool.py: `layers` is then the group's size.) Inside a
block, per kv head, K is stored transposed and V plainly, with values of a 2-byte dtype kept
in pairs (P = 2; P = 1 for float32) so that one 32-bit lane holds two of them, which is what
bf16 dot-product instructions read:
    K: [head_dim / P, block_size, P]   a vector register holds one dimension pair of many keys
    V: [block_size / P, head_dim, P]   ... or many dimensions of one key pair
An int8 cache (kv_dtype "int8") keeps, per block, layer and kv head, K [head_dim, block_size]
and V [block_size, head_dim] as int8, each followed by block_size float16 scales and then
block_size int8 zero points, one of each per token (value = scale * (int8 - zero), over the
token's head_dim values, asymmetric: a range [min(x, 0), max(x, 0)] in 255 steps, so a
lopsided vector keeps up to twice the resolution of a symmetric one): about half the bytes of
bf16. Attention dequantizes as it reads, never into a copy. An int4 cache (a uint8 pool) has
its own layout, its staging of open blocks and its reference path in kv_int4.py. A model
with multi-head latent attention (DeepSeek-V3) caches one latent vector per token and layer
instead of K and V: its pool has one part and one head, laid out as V is (mla.py).

A step's tokens are the new tokens of every scheduled sequence back to back (decodes and prompt
chunks in any order). Sequence s owns query rows [query_start[s], query_start[s + 1]) and, once
this step's K/V are written, seq_lens[s] tokens of KV; query row j sits at position
seq_len - q_len + j and attends causally to keys 0..position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class Int4Step:
    """What an int4 cache's writes and reads need beyond the metadata's block tables, built
    by kv_int4.int4_step beside the metadata (indices into the step's tokens and the pool)."""

    kv_stage: torch.Tensor  # stage_view: [blocks, S, layers, 2, kv_heads, unit elems]
    stage_slots: torch.Tensor  # [num_seqs, G / U] int32: each sequence's units (-1: none)
    stage_tokens: torch.Tensor  # [n] int64: tokens written into an open block's staging
    stage_mapping: torch.Tensor  # [n] int64: unit block * INT4_STAGE_UNIT + offset in it
    seal_blocks: torch.Tensor  # [m] int64: pool blocks that fill (and are sealed) this step
    seal_stage: torch.Tensor  # [m, G / U] int64: the units holding their earlier tokens
    seal_tokens: torch.Tensor  # [k] int64: this step's tokens that land in sealed blocks
    seal_rows: torch.Tensor  # [k] int64: ... index into seal_blocks
    seal_offsets: torch.Tensor  # [k] int64: ... offset in the block
    open_seqs: torch.Tensor  # [o] int64: sequences whose last block is open after the writes
    open_blocks: torch.Tensor  # [o] int64: ... its index (past the table's full blocks)


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the model runner, read by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset of each token
    # (empty for an int4 cache, which places tokens through `int4`)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, rows padded with block 0
    query_start: torch.Tensor  # [num_seqs + 1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [num_seqs] int32, tokens of KV after this step's writes
    max_query_len: int
    max_seq_len: int
    block_size: int
    int4: Int4Step | None = None  # set for an int4 cache (kv_int4.py)
    # A model with sliding-window and full layers (window_pool.py): per group of layers,
    # the metadata over its block tables (this one first: the full layers').
    groups: list[AttentionMetadata] | None = None


def build_metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                   block_size: int, device: torch.device,
                   int4: Int4Step | None = None) -> AttentionMetadata:
    """Metadata for sequences with these new-token counts, total lengths and block tables
    (for an int4 cache with its placement of the step's tokens, kv_int4.int4_step)."""
    slots: list[int] = []
    # An int4 cache places tokens with its own indices (and its block tables hold full blocks
    # only): no slot mapping.
    for q_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        if int4 is not None:
            break
        for pos in range(seq_len - q_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max((-(-n // block_size) for n in seq_lens), default=1)
    # One tensor from one flat list: a tensor per row costs more than the rows' Python.
    padded: list[int] = []
    for table in block_tables:
        used = table[:width]
        padded.extend(used)
        padded.extend([0] * (width - len(used)))
    tables = torch.tensor(padded, dtype=torch.int32).view(len(block_tables), width)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=tables.to(device),
        query_start=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_query_len=max(query_lens, default=0), max_seq_len=max(seq_lens, default=0),
        block_size=block_size, int4=int4)


def block_elems(block_size: int, head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements of one block of one layer, K or V, and kv head (int8: values, scales, zero
    points)."""
    if kv_dtype == torch.int8:
        return block_size * (head_dim + 3)
    if kv_dtype == torch.uint8:  # int4 (kv_int4.py): packed values, two float16 per range
        return block_size * head_dim // 2 + 4 * max(block_size, head_dim)
    return block_size * head_dim


def allocate_kv_cache(num_blocks: int, num_layers: int, num_kv_heads: int, block_size: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device,
                      prefault: bool = False, kv_parts: int = 2) -> torch.Tensor:
    """The KV pool, zeroed: [num_blocks, layers, kv_parts, kv_heads, block elements];
    kv_parts is 2 (K and V) but for MLA's latent cache (mla.py: one part, one head).

    `prefault` (CPU): have the OS back every page now. Otherwise the first write to each page
    waits while the OS zeroes it, inside a kernel the other cores wait on: the first pass
    through a 2 GiB pool costs a 2-core machine ~7% of its throughput (bench engine)."""
    shape = (num_blocks, num_layers, kv_parts, num_kv_heads,
             block_elems(block_size, head_dim, dtype))
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # Anonymous memory: the OS zeroes pages on first touch, so a large pool costs neither
    # start-up time nor resident memory until it is used.
    import contextlib
    import math
    import mmap

    numel = math.prod(shape)
    # Private, not mmap's default shared mapping: the kernel gives shared anonymous memory
    # (shmem) huge pages only when an administrator allowed it, private memory whenever asked.
    buffer = mmap.mmap(-1, max(numel * dtype.itemsize, 1),
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # Huge pages where the kernel allows them: each step touches a few blocks of every running
    # sequence in every layer, scattered over the pool, and 4 KiB pages would miss the TLB.
    with contextlib.suppress(AttributeError, OSError):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    pool = torch.frombuffer(buffer, dtype=dtype, count=numel)
    if prefault:
        pool.view(torch.uint8)[::mmap.PAGESIZE].zero_()  # one write per page
    return pool.view(shape)


def kv_pack(dtype: torch.dtype) -> int:
    """Values per 32-bit lane in the cache layout: 2 for 2-byte dtypes, else 1."""
    return 2 if dtype.itemsize == 2 else 1


def layer_views(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer, each [blocks, kv_heads, block elements] (views: writes go to the
    pool)."""
    return kv_cache[:, layer, 0], kv_cache[:, layer, 1]


def int8_parts(blocks: torch.Tensor, block_size: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 values [..., bs * d], float16 scales [..., bs], int8 zero points [..., bs]) of
    int8 blocks (views)."""
    values = blocks[..., :-3 * block_size]
    scales = blocks[..., -3 * block_size:-block_size].view(torch.float16)
    return values, scales, blocks[..., -block_size:]


def dequantized(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                 ) -> torch.Tensor:
    """[..., bs, d] int8 values, [..., bs] scales and zero points -> float32 [..., bs, d]."""
    return (values.float() - zeros.float()[..., None]) * scales.float()[..., None]


def unpacked_k(k_blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., kv_heads, block elements] in the K layout -> [..., kv_heads, bs, d]."""
    if k_blocks.dtype == torch.int8:
        values, scales, zeros = int8_parts(k_blocks, block_size)
        head_dim = values.shape[-1] // block_size
        return dequantized(values.unflatten(-1, (head_dim, block_size)).transpose(-1, -2),
                            scales, zeros)
    p = kv_pack(k_blocks.dtype)
    head_dim = k_blocks.shape[-1] // block_size
    k = k_blocks.unflatten(-1, (head_dim // p, block_size, p))  # [..., d/p, bs, p]
    return k.movedim(-2, -3).flatten(-2)  # [..., bs, d/p, p] -> [..., bs, d]


def unpacked_v(v_blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., kv_heads, block elements] in the V layout -> [..., kv_heads, bs, d]."""
    if v_blocks.dtype == torch.int8:
        values, scales, zeros = int8_parts(v_blocks, block_size)
        return dequantized(values.unflatten(-1, (block_size, -1)), scales, zeros)
    p = kv_pack(v_blocks.dtype)
    head_dim = v_blocks.shape[-1] // block_size
    v = v_blocks.unflatten(-1, (block_size // p, head_dim, p))  # [..., bs/p, d, p]
    return v.transpose(-1, -2).flatten(-3, -2)  # [..., bs/p, p, d] -> [..., bs, d]


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-vector asymmetric int8 over the last dimension: (int8 values, float16 scales, int8
    zero points), value ~ scale * (int8 - zero). The range [min(x, 0), max(x, 0)] is cut in
    255 steps; it holds 0, so the zero point fits in int8. Values are rounded with the float16
    scale, so dequantizing gives what attention reads (the C++ kernel quantizes the same way)."""
    x = x.float()
    low = x.amin(-1, keepdim=True).clamp(max=0)
    high = x.amax(-1, keepdim=True).clamp(min=0)
    span = high - low
    # Rounded up to float16 (a step 2^-10 larger, then to nearest), so that the range still
    # fits in 255 steps and no value is clipped.
    scale = torch.where(span > 0, span / 255 * (1 + 2**-10), torch.ones_like(span))
    scale = scale.to(torch.float16).float()
    zero = (torch.round(-low / scale) - 128).clamp_(-128, 127)
    values = (torch.round(x / scale) + zero).clamp_(-128, 127).to(torch.int8)
    return values, scale.to(torch.float16).squeeze(-1), zero.to(torch.int8).squeeze(-1)


def write_kv_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, slot_mapping: torch.Tensor, block_size: int) -> None:
    """k, v: [num_tokens, kv_heads, head_dim] into one layer's cache at their slots."""
    write_values_reference(k_cache, k, slot_mapping, block_size, as_k=True)
    write_values_reference(v_cache, v, slot_mapping, block_size, as_k=False)


def write_values_reference(cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor,
                           block_size: int, as_k: bool) -> None:
    """x: [num_tokens, kv_heads, head_dim] into one layer's K cache (`as_k`) or V cache
    ([blocks, kv_heads, block elements]) at their slots."""
    num_tokens, kv_heads, head_dim = x.shape
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    if cache.dtype == torch.int8:
        values, scales, zeros = int8_parts(cache, block_size)
        q, s, z = quantize_int8(x)
        if as_k:  # K: [kv_heads, d, bs] -> [blocks, bs, kv_heads, d] at (b, o)
            view = values.unflatten(-1, (head_dim, block_size)).permute(0, 3, 1, 2)
        else:  # V: [kv_heads, bs, d] -> [blocks, bs, kv_heads, d]
            view = values.unflatten(-1, (block_size, head_dim)).transpose(1, 2)
        view[blocks, offsets] = q
        scales.transpose(1, 2)[blocks, offsets] = s
        zeros.transpose(1, 2)[blocks, offsets] = z
        return
    p = kv_pack(cache.dtype)
    if as_k:
        # K [blocks, kv_heads, d/p, bs, p] at (block, offset): [tokens, kv_heads, d/p, p].
        k_view = cache.unflatten(-1, (head_dim // p, block_size, p)).permute(0, 3, 1, 2, 4)
        k_view[blocks, offsets] = x.to(cache.dtype).view(num_tokens, kv_heads, head_dim // p, p)
        return
    # V [blocks, kv_heads, bs/p, d, p] indexed at (block, offset // p, offset % p).
    v_view = cache.unflatten(-1, (block_size // p, head_dim, p)).permute(0, 2, 4, 1, 3)
    v_view[blocks, offsets // p, offsets % p] = x.to(cache.dtype)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float,
                              window: int | None = None,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim] -> [num_tokens, heads * head_dim]; with a `window`,
    each query sees only keys within the last `window` positions (its own included); `sinks`
    (float32 [heads], gpt-oss) add one logit per head that has no value.

    Gathers every sequence's blocks into a padded batch and runs one SDPA with a causal,
    length-aware mask: simple and obviously right, not fast.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = meta.block_tables.shape[0]
    kv_heads = k_cache.shape[1]
    block_size = meta.block_size
    if num_seqs == 0:
        return q.new_empty(num_tokens, num_heads * head_dim)
    tables = meta.block_tables.long()
    # [seqs, width, kv_heads, bs, d] -> [seqs, kv_heads, width * bs, d]
    # An int8 cache is dequantized to float32, and attention runs in float32, as it does in
    # the CPU kernel.
    compute = torch.float32 if k_cache.dtype == torch.int8 else q.dtype
    keys = unpacked_k(k_cache[tables], block_size).transpose(1, 2).reshape(
        num_seqs, kv_heads, -1, head_dim).to(compute)
    values = unpacked_v(v_cache[tables], block_size).transpose(1, 2).reshape(
        num_seqs, kv_heads, -1, head_dim).to(compute)
    return attend_gathered(q, keys, values, meta, scale, window, sinks)


def _attend_with_sinks(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       mask: torch.Tensor, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """SDPA with one more logit per head that has no value; queries [seqs, heads, q, d], keys
    and values [seqs, kv_heads, k, d], mask [seqs, 1, q, k]."""
    group = queries.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    logits = (queries @ keys.transpose(-1, -2)).float() * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    sink = sinks.float()[None, :, None, None].expand(*logits.shape[:-1], 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return (probs.to(values.dtype) @ values).to(queries.dtype)


def causal_layout(meta: AttentionMetadata, window: int | None, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the step's query rows sit in a padded [seqs, max_q] batch over keys gathered per
    sequence ([seqs, width * block_size]): (rows [seqs, max_q], the step's row of each,
    valid [seqs, max_q], which are real, mask [seqs, max_q, keys], which keys each sees)."""
    width = meta.block_tables.shape[1]
    starts = meta.query_start.long()
    q_lens = starts[1:] - starts[:-1]
    seq_lens = meta.seq_lens.long()
    j = torch.arange(meta.max_query_len, device=device)
    valid = j[None, :] < q_lens[:, None]  # [seqs, max_q]
    # Padded query rows repeat the sequence's last row (never an empty mask row).
    rows = starts[:-1, None] + torch.minimum(j[None, :], (q_lens - 1).clamp(min=0)[:, None])
    q_pos = (seq_lens - q_lens)[:, None] + torch.minimum(j[None, :], q_lens[:, None] - 1)
    k_pos = torch.arange(width * meta.block_size, device=device)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :]
                                                         < seq_lens[:, None, None])
    if window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - window
    return rows, valid, mask


def attend_gathered(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    window: int | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal, length-aware SDPA of the step's queries over keys and values gathered per
    sequence ([seqs, kv_heads, width * block_size, d], in the compute dtype)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = meta.block_tables.shape[0]
    rows, valid, mask = causal_layout(meta, window, q.device)
    queries = q[rows].transpose(1, 2).to(keys.dtype)  # [seqs, heads, max_q, d]
    if sinks is not None:
        out = _attend_with_sinks(queries, keys, values, mask[:, None], scale, sinks)
    else:
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask[:, None],
                                             scale=scale, enable_gqa=True)
    out = out.transpose(1, 2).reshape(num_seqs, meta.max_query_len, num_heads * head_dim)
    result = q.new_empty(num_tokens, num_heads * head_dim)
    result[rows[valid]] = out[valid].to(q.dtype)
    return result
