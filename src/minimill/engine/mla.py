"""Multi-head latent attention (DeepSeek-V3, Kimi K2) over a cache of latents.

MLA compresses each token's keys and values into one latent: c = RMSNorm(x W_a) of
kv_lora_rank values, from which every head's non-rotary key (W_UK c) and value (W_UV c) are
projected, plus one rotary key k_r of qk_rope_head_dim values that all heads share. The cache
holds only [c, k_r] per token and layer (576 values for DeepSeek-V3 against 128 heads x 320
for the keys and values it stands for), and attention runs on it directly, in the absorbed
form: each head's non-rotary query is taken into latent space (q_c = q_nope W_UK), so

    score = q_c . c + q_r . k_r        out = W_UV (sum softmax(score) c)

which is multi-query attention with one key head of kv_lora_rank + qk_rope_head_dim values
whose value is the key's first kv_lora_rank values. The heads are folded into the query rows,
so a sequence's attention is one SDPA over its gathered latents.

The latent pool is the KV pool with one part and one head (attention.allocate_kv_cache), laid
out as a V cache is (bf16 pairs, int8 with per-token scales and zero points): block manager,
prefix reuse and tiers see blocks as always.

The checkpoint's interleaved rotary dimensions (HF's rope_interleave) are reordered at load,
into the first-half / second-half pairing the engine's rotary tables use: the rows of q's and
k_r's projections are permuted, which changes no score.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minimill.engine.attention import (
    AttentionMetadata,
    causal_layout,
    unpacked_v,
    write_values_reference,
)
from minimill.engine.kernels import TorchKernels
from minimill.engine.rope import rotate
from minimill.models.types import ModelConfig

# Most (query, head, key) scores one attention call computes (float32: 256 MiB).
_MAX_SCORES = 1 << 26


@dataclass(slots=True)
class MlaWeights:
    # Matrices as kernels.prepare_weight left them.
    # x -> [q_a (q_lora_rank) or q (heads * qk), c (kv_lora_rank), k_r (rope)] in one GEMM.
    a: torch.Tensor  # [q_width + kv_lora_rank + rope, hidden]
    a_bias: torch.Tensor | None
    q_width: int  # q_lora_rank, or heads * (nope + rope) where q has no bottleneck
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    q_b: torch.Tensor | None  # [heads * (nope + rope), q_lora_rank]
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    w_uk: torch.Tensor  # [heads, nope, kv_lora_rank]: q_nope -> latent space
    w_uv: torch.Tensor  # [heads, kv_lora_rank, v_head_dim]: latent -> each head's output


def _deinterleaved(rows: torch.Tensor) -> torch.Tensor:
    """Rotary rows [..., d, in] paired (0, 1), (2, 3), ... -> pairs (i, i + d / 2)."""
    return torch.cat([rows[..., 0::2, :], rows[..., 1::2, :]], dim=-2)


def load_mla(prefix: str, config: ModelConfig, w: Callable[[str], torch.Tensor],
             pack: Callable[[torch.Tensor], torch.Tensor]) -> MlaWeights:
    """One layer's MLA weights under `prefix` ("model.layers.N.self_attn.") in HF naming."""
    heads, rank = config.num_attention_heads, config.kv_lora_rank
    nope, rope, v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    kv_a = w(prefix + "kv_a_proj_with_mqa.weight")  # [rank + rope, hidden]
    if config.q_lora_rank is None:
        q_first = w(prefix + "q_proj.weight")
        q_b = None
    else:
        q_first = w(prefix + "q_a_proj.weight")
        q_b = w(prefix + "q_b_proj.weight")
    if config.rope_interleave:
        kv_a = torch.cat([kv_a[:rank], _deinterleaved(kv_a[rank:])])
        per_head = (q_first if q_b is None else q_b).unflatten(0, (heads, nope + rope))
        per_head = torch.cat([per_head[:, :nope], _deinterleaved(per_head[:, nope:])], dim=1)
        if q_b is None:
            q_first = per_head.flatten(0, 1)
        else:
            q_b = per_head.flatten(0, 1)
    a_bias = None
    if config.attention_bias:
        kv_bias = w(prefix + "kv_a_proj_with_mqa.bias")
        if config.rope_interleave:
            kv_bias = torch.cat([kv_bias[:rank], _deinterleaved(kv_bias[rank:, None])[:, 0]])
        q_bias = (w(prefix + "q_a_proj.bias") if q_b is not None
                  else kv_bias.new_zeros(q_first.shape[0]))
        a_bias = torch.cat([q_bias, kv_bias]).contiguous()
    kv_b = w(prefix + "kv_b_proj.weight").unflatten(0, (heads, nope + v_dim))  # [h, n + v, r]
    return MlaWeights(
        a=pack(torch.cat([q_first, kv_a])), a_bias=a_bias, q_width=q_first.shape[0],
        q_a_norm=None if q_b is None else w(prefix + "q_a_layernorm.weight").contiguous(),
        q_b=None if q_b is None else pack(q_b),
        kv_a_norm=w(prefix + "kv_a_layernorm.weight").contiguous(),
        w_uk=kv_b[:, :nope].contiguous(),
        w_uv=kv_b[:, nope:].transpose(1, 2).contiguous())


def latent_view(kv_cache: torch.Tensor, layer: int) -> torch.Tensor:
    """One layer's latents in the pool, [blocks, 1, block elements] (a view)."""
    return kv_cache[:, layer, 0]


def mla_attention(ops: TorchKernels, x: torch.Tensor, positions: torch.Tensor,
                  cos_sin: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                  weights: MlaWeights, config: ModelConfig, scale: float) -> torch.Tensor:
    """x: [tokens, hidden] (normed) -> each head's attention output [tokens, heads * v_dim],
    before o_proj; writes the tokens' latents into `cache` (latent_view) first."""
    heads, rank = config.num_attention_heads, config.kv_lora_rank
    nope, eps = config.qk_nope_head_dim, config.rms_norm_eps
    tokens = x.shape[0]
    a = ops.linear(x, weights.a, weights.a_bias)
    if weights.q_b is not None:
        assert weights.q_a_norm is not None
        q_in = ops.rms_norm(a[:, :weights.q_width].contiguous(), weights.q_a_norm, eps)
        q = ops.linear(q_in, weights.q_b)
    else:
        q = a[:, :weights.q_width]
    q = q.reshape(tokens, heads, -1)  # [tokens, heads, nope + rope]
    latent = a[:, weights.q_width:]
    c_kv = ops.rms_norm(latent[:, :rank].contiguous(), weights.kv_a_norm, eps)
    table = cos_sin[positions]  # [tokens, rope]
    k_rope = rotate(latent[:, rank:], table)
    # The latent goes to the cache from the model dtype and float32 (as K and V do).
    write_values_reference(cache, torch.cat([c_kv.float(), k_rope], dim=-1)[:, None],
                           meta.slot_mapping, meta.block_size, as_k=False)
    q_rope = rotate(q[..., nope:], table[:, None]).to(x.dtype)
    # [heads, tokens, nope] @ [heads, nope, rank]: each head's query in latent space.
    q_latent = torch.bmm(q[..., :nope].transpose(0, 1), weights.w_uk).transpose(0, 1)
    out_latent = _attend_latents(torch.cat([q_latent, q_rope], dim=-1), cache, meta, rank,
                                 scale)
    # [heads, tokens, rank] @ [heads, rank, v_dim]: back out of latent space.
    out = torch.bmm(out_latent.transpose(0, 1), weights.w_uv).transpose(0, 1)
    return out.reshape(tokens, -1)


def _attend_latents(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                    rank: int, scale: float) -> torch.Tensor:
    """q: [tokens, heads, rank + rope] over the cached latents -> [tokens, heads, rank].

    Gathers every sequence's blocks into a padded batch (an int8 cache dequantized to float32,
    attention then in float32) and runs SDPA with (query, head) pairs as its rows, over as many
    query positions at a time as keep its scores under _MAX_SCORES (a long prompt chunk's
    128 heads x its queries x its keys would not fit)."""
    num_tokens, heads, width = q.shape
    num_seqs = meta.block_tables.shape[0]
    if num_seqs == 0:
        return q.new_empty(num_tokens, heads, rank)
    compute = torch.float32 if cache.dtype == torch.int8 else q.dtype
    keys = unpacked_v(cache[meta.block_tables.long()], meta.block_size)  # [s, w, 1, bs, d]
    keys = keys.reshape(num_seqs, 1, -1, width).to(compute)
    rows, valid, mask = causal_layout(meta, None, q.device)
    queries = q[rows].to(compute)  # [seqs, max_q, heads, width]
    out = queries.new_empty(num_seqs, meta.max_query_len, heads, rank)
    step = max(1, _MAX_SCORES // (num_seqs * heads * keys.shape[2]))
    for start in range(0, meta.max_query_len, step):
        chunk = queries[:, start:start + step]
        n = chunk.shape[1]
        out[:, start:start + n] = F.scaled_dot_product_attention(
            chunk.reshape(num_seqs, 1, n * heads, width), keys, keys[..., :rank],
            attn_mask=mask[:, None, start:start + n].repeat_interleave(heads, dim=2),
            scale=scale).view(num_seqs, n, heads, rank)
    result = q.new_empty(num_tokens, heads, rank)
    result[rows[valid]] = out[valid].to(q.dtype)
    return result
