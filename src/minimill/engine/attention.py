"""Paged attention over the KV cache, in groups of similar sequences.

Cache layout per layer: [num_kv_heads, num_blocks, block_size, 2 (K, V), head_dim]. A group
gathers its sequences' blocks by block table into a padded, contiguous
[num_kv_heads * num_seqs, kv_len, head_dim] batch and runs scaled_dot_product_attention once.
The query heads that share a KV head become extra query rows of that KV head
([kv_heads * seqs, 1, group * q_len, head_dim]), so GQA needs no copies of K/V.

Decodes (one query token each) form groups of similar context length; prompt chunks form
groups of similar chunk length. The metadata (gather indices, masks) is built once per step
by `build_metadata` and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionGroup:
    row_start: int  # the group's query tokens are rows [row_start, row_end) of the flat batch
    row_end: int
    num_seqs: int
    q_len: int  # padded query length (1 for decodes)
    kv_len: int  # padded context length, a multiple of block_size
    block_ids: torch.Tensor  # [num_seqs * kv_len // block_size], padded with block 0
    # [num_seqs * q_len] flat-batch row of each padded query (pads repeat a real row);
    # None when q_len == 1 (rows are then row_start + seq index).
    q_rows: torch.Tensor | None
    # Real (not padding) queries: rows of the flat batch, and their index among padded ones.
    q_dst: torch.Tensor | None
    q_src: torch.Tensor | None
    # Additive mask [kv_heads * num_seqs, 1, group * q_len or 1, kv_len] in the model dtype.
    mask: torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot (block * block_size + offset) per token
    groups: list[AttentionGroup]
    # Reused buffer for gathered K/V (model dtype, at least `workspace_numel` elements). Fresh
    # tensors over 32 MB come straight from mmap on Linux, and their page faults would cost
    # more than the gather itself.
    workspace: torch.Tensor | None = None

    def workspace_numel(self, kv_heads: int, head_dim: int) -> int:
        return max((kv_heads * g.num_seqs * g.kv_len * 2 * head_dim for g in self.groups),
                   default=0)


@dataclass(slots=True)
class SeqSpan:
    """One scheduled sequence as attention sees it (built by the model runner)."""

    row_start: int  # first row of its new tokens in the flat batch
    q_len: int  # new tokens this step
    start_pos: int  # position of its first new token (= tokens already computed)
    block_table: list[int]


def build_metadata(spans: list[SeqSpan], block_size: int, num_kv_heads: int, group_size: int,
                   dtype: torch.dtype, device: torch.device) -> AttentionMetadata:
    """Spans must come decodes first, each part ordered as it should be grouped."""
    slot_mapping = _slot_mapping(spans, block_size, device)
    groups = [_build_group(g, block_size, num_kv_heads, group_size, dtype, device)
              for g in _partition(spans)]
    return AttentionMetadata(slot_mapping, groups)


def _partition(spans: list[SeqSpan]) -> list[list[SeqSpan]]:
    """Consecutive spans with the same kind and similar sizes, so padding stays small."""
    parts: list[list[SeqSpan]] = []
    for span in spans:
        if parts:
            first, last = parts[-1][0], parts[-1][-1]
            same_kind = (first.q_len == 1) == (span.q_len == 1)
            kv, first_kv = span.start_pos + span.q_len, first.start_pos + first.q_len
            similar = (abs(kv - first_kv) <= max(64, first_kv // 4)
                       and abs(span.q_len - first.q_len) <= max(32, first.q_len // 4))
            if same_kind and similar and span.row_start == last.row_start + last.q_len:
                parts[-1].append(span)
                continue
        parts.append([span])
    return parts


def _slot_mapping(spans: list[SeqSpan], block_size: int, device: torch.device) -> torch.Tensor:
    slots: list[int] = []
    for s in spans:
        table = s.block_table
        for pos in range(s.start_pos, s.start_pos + s.q_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    return torch.tensor(slots, dtype=torch.long, device=device)


def _build_group(spans: list[SeqSpan], block_size: int, num_kv_heads: int, group_size: int,
                 dtype: torch.dtype, device: torch.device) -> AttentionGroup:
    n = len(spans)
    q_len = max(s.q_len for s in spans)
    kv_lens = [s.start_pos + s.q_len for s in spans]
    num_kv_blocks = -(-max(kv_lens) // block_size)
    kv_len = num_kv_blocks * block_size
    ids: list[int] = []
    for s in spans:
        table = s.block_table[:num_kv_blocks]
        ids.extend(table)
        ids.extend([0] * (num_kv_blocks - len(table)))  # masked out; any block will do
    block_ids = torch.tensor(ids, dtype=torch.long)
    starts = torch.tensor([s.start_pos for s in spans])
    q_lens = torch.tensor([s.q_len for s in spans])
    j = torch.arange(q_len)
    q_pos = starts[:, None] + j[None, :]  # [n, q_len]
    valid = j[None, :] < q_lens[:, None]  # [n, q_len]
    k_pos = torch.arange(kv_len)
    allowed = k_pos[None, None, :] <= q_pos[:, :, None]  # causal, [n, q_len, kv_len]
    # Padded queries look at key 0 only, so no row is fully masked (which would give NaN).
    allowed = torch.where(valid[:, :, None], allowed, k_pos[None, None, :] == 0)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    if q_len == 1:
        # [kv_heads * n, 1, 1, kv_len], broadcast over the group's query heads.
        mask = mask.view(1, n, 1, kv_len).expand(num_kv_heads, n, 1, kv_len)
        mask = mask.reshape(num_kv_heads * n, 1, 1, kv_len)
        q_rows = q_dst = q_src = None
    else:
        mask = mask.view(1, n, 1, q_len, kv_len).expand(num_kv_heads, n, group_size, q_len,
                                                        kv_len)
        mask = mask.reshape(num_kv_heads * n, 1, group_size * q_len, kv_len)
        row_starts = torch.tensor([s.row_start for s in spans])
        rows = row_starts[:, None] + torch.minimum(j[None, :], q_lens[:, None] - 1)
        flat_rows, flat_valid = rows.reshape(-1), valid.reshape(-1)
        q_rows = flat_rows.to(device)
        q_dst = flat_rows[flat_valid].to(device)
        q_src = flat_valid.nonzero().squeeze(1).to(device)
    return AttentionGroup(spans[0].row_start, spans[-1].row_start + spans[-1].q_len, n, q_len,
                          kv_len, block_ids.to(device), q_rows, q_dst, q_src, mask.to(device))


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, kv_heads, head_dim] into kv_cache [kv_heads, blocks, block_size, 2, d]."""
    kv_heads, _, _, _, head_dim = kv_cache.shape
    kv = torch.stack((k, v), dim=2).transpose(0, 1)  # [kv_heads, num_tokens, 2, d]
    kv_cache.view(kv_heads, -1, 2, head_dim)[:, slot_mapping] = kv


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim] -> [num_tokens, heads * head_dim]."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = kv_cache.shape[0]
    group = num_heads // kv_heads
    out = q.new_empty(num_tokens, num_heads * head_dim)
    for g in meta.groups:
        n, q_len, kv_len = g.num_seqs, g.q_len, g.kv_len
        qg = q[g.row_start:g.row_end] if g.q_rows is None else q[g.q_rows]
        # [n * q_len, kv_heads * group, d] -> [kv_heads * n, 1, group * q_len, d]
        qg = qg.view(n, q_len, kv_heads, group, head_dim).permute(2, 0, 3, 1, 4)
        qg = qg.reshape(kv_heads * n, 1, group * q_len, head_dim)
        # One gather for K and V together; SDPA reads both through strided views.
        if meta.workspace is None:
            kv = kv_cache.index_select(1, g.block_ids)
        else:
            numel = kv_heads * n * kv_len * 2 * head_dim
            kv = meta.workspace[:numel].view(kv_heads, g.block_ids.shape[0], *kv_cache.shape[2:])
            torch.index_select(kv_cache, 1, g.block_ids, out=kv)
        kv = kv.view(kv_heads * n, 1, kv_len, 2, head_dim)
        o = F.scaled_dot_product_attention(qg, kv[..., 0, :], kv[..., 1, :], attn_mask=g.mask,
                                           scale=scale)
        # [kv_heads * n, 1, group * q_len, d] -> [n * q_len, heads * d]
        o = o.view(kv_heads, n, group, q_len, head_dim).permute(1, 3, 0, 2, 4)
        o = o.reshape(n * q_len, num_heads * head_dim)
        if g.q_rows is None:
            out[g.row_start:g.row_end] = o
        else:
            assert g.q_dst is not None and g.q_src is not None
            out[g.q_dst] = o[g.q_src]
    return out
