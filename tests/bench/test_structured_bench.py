"""`minimill bench structured` at a tiny size: the real model under response_format grammars
against the same work unconstrained; every answer that ends matches its schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WORKLOAD = Path(__file__).parents[2] / "benchmarks" / "workloads" / "throughput-256.jsonl"


@pytest.mark.timeout(900)
def test_structured_bench_reports_ratio_validity_and_compile_times(model_file: Path,
                                                                   tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    for entry in model_file.parent.parent.iterdir():
        (home / "models" / entry.name).symlink_to(entry)
    done = subprocess.run(
        [sys.executable, "-m", "minimill.cli", "bench", "structured", "--json",
         "--workload", str(WORKLOAD), "--limit", "8", "--rounds", "1"],
        env={**os.environ, "MINIMILL_HOME": str(home)}, capture_output=True, text=True,
        timeout=880)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["requests"] == 8 and report["cpu"]["model"]
    assert report["valid_answers"] + report["invalid_answers"] + \
        report["cut_at_max_tokens"] == 8
    assert report["invalid_answers"] == 0, report["invalid_examples"]
    assert report["valid_answers"] > 0
    assert report["ratio"] > 0 and report["ratio_target"] == 0.95
    assert len(report["rounds"]) == 1
    assert set(report["grammar_compile"]) == set(report["schemas"])
    for times in report["grammar_compile"].values():
        assert times["cached_ms"] <= times["cold_ms"]
