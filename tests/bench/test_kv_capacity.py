"""What a KV budget holds per KV dtype (bench kv's arithmetic), for DeepSeek-V3's latent
cache against the per-head keys and values it stands for."""

from __future__ import annotations

import json

import pytest

from minimill.bench.kv_bench import KvBenchOptions, run_kv_bench
from minimill.bench.kv_capacity import capacity
from minimill.models.shapes import NAMED_SHAPES

GIB = 1 << 30


def test_deepseek_v3_latent_cache_against_the_uncompressed_one() -> None:
    mc = NAMED_SHAPES["deepseek-v3"]
    report = capacity(mc, "bfloat16", ("int8", "int4"), 64 * GIB, 4096)
    bf16, int8, int4 = (report["kv"][k] for k in ("bfloat16", "int8", "int4"))
    # 512 latent + 64 rotary values per token and layer: 1152 bytes in bf16, and for int8
    # one byte each plus a float16 scale and an int8 zero point.
    assert bf16["bytes_per_token_per_layer"] == 1152
    assert bf16["bytes_per_token"] == 61 * 1152
    assert int8["bytes_per_token"] == 61 * 579
    assert int4["supported"] is False
    assert "int4 is not supported" in int4["reason"]
    full = report["uncompressed_equivalent"]
    assert full["values_per_token_per_layer"] == 128 * (128 + 64 + 128)
    assert full["bytes_per_token"] == 61 * 40960 * 2
    assert bf16["bytes_ratio_vs_uncompressed"] == pytest.approx(40960 / 576, abs=0.01)
    # 64 GiB of pool: 238 sequences of 4096 tokens as latents, 3 as per-head K and V.
    assert bf16["sequences_at_budget"] == 64 * GIB // (61 * 1152 * 4096)
    assert full["sequences_at_budget"] == 3
    assert int8["sequences_at_budget"] >= 1.98 * bf16["sequences_at_budget"]


def test_a_model_without_mla_has_no_uncompressed_equivalent() -> None:
    report = capacity(NAMED_SHAPES["llama3-8b"], "bfloat16", ("int8", "int4"), GIB, 1024)
    assert "uncompressed_equivalent" not in report
    assert report["kv"]["bfloat16"]["bytes_per_token"] == 32 * 2 * 8 * 128 * 2
    assert report["kv"]["int4"]["bytes_per_token"] < report["kv"]["int8"]["bytes_per_token"]


def test_bench_kv_sizes_a_named_shape_without_loading_it(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    run_kv_bench(KvBenchOptions(json_out=True, shape="deepseek-v3", dtype="bfloat16",
                                budget_mb=10240, context_tokens=4096))
    report = json.loads(capsys.readouterr().out)
    assert report["shape"] == "deepseek-v3" and report["layers"] == 61
    assert report["kv"]["bfloat16"]["sequences_at_budget"] == 37
    assert report["uncompressed_equivalent"]["sequences_at_budget"] == 0
