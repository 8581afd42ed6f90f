"""What a KV pool of a fixed size holds, per KV dtype, from the engine's own arithmetic
(EngineConfig: blocks, bytes per block) and nothing run: `minimill bench kv --shape NAME`,
and a part of every `bench kv` report.

For a model with multi-head latent attention (DeepSeek-V3), also what the same budget would
hold if each head's keys and values were cached as they are computed (what MLA's latent
stands for: num_heads * (qk_nope + qk_rope + v_head_dim) values per token and layer, in the
model dtype), the cache a non-absorbed MLA implementation keeps.
"""

from __future__ import annotations

from typing import Any

from minimill.models.types import ModelConfig


def capacity(mc: ModelConfig, dtype: str, kv_dtypes: tuple[str, ...], budget_bytes: int,
             context_tokens: int) -> dict[str, Any]:
    """Per KV dtype (the model dtype first): bytes per token (all layers, and per layer) and
    how many sequences of `context_tokens` tokens fit `budget_bytes`; a KV dtype the model
    cannot use says why."""
    from minimill.engine.config import DTYPES, EngineConfig
    from minimill.engine.params import InvalidRequestError

    rows: dict[str, dict[str, Any]] = {}
    layers = mc.num_hidden_layers
    block_size = EngineConfig(dtype=dtype, device="cpu").block_size  # int4 has its own
    for kv_dtype in dict.fromkeys((dtype, *kv_dtypes)):
        try:
            config = EngineConfig(dtype=dtype, kv_dtype=kv_dtype, device="cpu",
                                  kv_cache_memory_bytes=budget_bytes, model_config=mc)
        except InvalidRequestError as exc:
            rows[kv_dtype] = {"supported": False, "reason": str(exc)}
            continue
        assert config.num_kv_blocks is not None
        per_token = config.kv_bytes_per_token(mc)
        # A sequence's blocks; int4 also stages its open block in pool blocks.
        blocks = -(-context_tokens // config.block_size)
        if config.kv_dtype == "int4":
            from minimill.engine.kv_int4 import stage_blocks_per_sequence

            blocks += stage_blocks_per_sequence(mc.head_dim)
        row: dict[str, Any] = {"bytes_per_token": round(per_token, 1),
                               "bytes_per_token_per_layer": round(per_token / layers, 2),
                               "sequences_at_budget": config.num_kv_blocks // blocks}
        layout = config.window_layout(mc)
        if layout is not None:
            row.update(_windowed(config, layout, mc, budget_bytes, context_tokens))
        rows[kv_dtype] = row
    report: dict[str, Any] = {"context_tokens": context_tokens,
                              "budget_mb": round(budget_bytes / (1 << 20), 1), "kv": rows}
    if mc.is_mla:
        values = mc.num_attention_heads * (mc.qk_nope_head_dim + mc.qk_rope_head_dim
                                           + mc.v_head_dim)
        per_token = layers * values * DTYPES[dtype].itemsize
        per_sequence = -(-context_tokens // block_size) * block_size * per_token
        uncompressed = {"values_per_token_per_layer": values,
                        "bytes_per_token": per_token,
                        "sequences_at_budget": budget_bytes // per_sequence}
        report["uncompressed_equivalent"] = uncompressed
        for row in rows.values():
            if row.get("supported", True):
                row["bytes_ratio_vs_uncompressed"] = round(per_token / row["bytes_per_token"],
                                                           2)
    return report


def _windowed(config: Any, layout: Any, mc: ModelConfig, budget_bytes: int,
              context_tokens: int) -> dict[str, Any]:
    """A model with sliding-window and full layers (window_pool.py): a pool block holds
    one group of layers; a decoding sequence holds a block per block_size tokens for its full
    layers, and for each sliding group only the blocks its window reaches. Beside it, what one
    group of every layer (window_pool off) holds of the same budget."""
    from minimill.engine.config import EngineConfig

    assert config.num_kv_blocks is not None
    bs = config.block_size
    full = -(-context_tokens // bs)
    window = min(full, -(-(layout.window - 1) // bs) + 2)
    blocks = full + layout.window_groups * window
    one_pool = EngineConfig(dtype=config.dtype, kv_dtype=config.kv_dtype, device="cpu",
                            kv_cache_memory_bytes=budget_bytes, window_pool=False,
                            model_config=mc)
    assert one_pool.num_kv_blocks is not None
    block_bytes = config.kv_block_bytes(mc)
    return {
        "bytes_per_token": round(blocks * block_bytes / context_tokens, 1),
        "bytes_per_token_per_layer": round(blocks * block_bytes / context_tokens
                                           / mc.num_hidden_layers, 2),
        "sequences_at_budget": config.num_kv_blocks // blocks,
        "window": {"window_tokens": layout.window, "layers_per_group": layout.group_layers,
                   "sliding_groups": layout.window_groups,
                   "window_blocks_per_sequence": window},
        "one_pool_sequences_at_budget": one_pool.num_kv_blocks // full,
        "one_pool_bytes_per_token": round(one_pool.kv_bytes_per_token(mc), 1),
    }
