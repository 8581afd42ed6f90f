"""`minimill bench ingest` as a real process, on a small batch: it runs a control plane and a
heartbeating client, and prints its figures beside their targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_bench_ingest_prints_memory_and_heartbeat_figures(e2e_home: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "minimill.cli", "bench", "ingest", "--json", "--lines", "1500"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "MINIMILL_HOME": str(e2e_home)})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert (report["lines"], report["output_lines"]) == (1500, 1500)
    assert report["batch_status"] == "completed"
    assert report["file_bytes"] > 1500 * 3900
    assert report["idle_rss_mb"] > 0 and report["peak_rss_mb"] >= report["idle_rss_mb"]
    assert report["peak_over_idle_mb"] == pytest.approx(
        report["peak_rss_mb"] - report["idle_rss_mb"], abs=0.2)
    assert report["heartbeats"] > 0 and report["client_errors"] == 0
    assert report["longest_heartbeat_gap_s"] >= report["heartbeat_interval_s"] * 0.9
    assert isinstance(report["meets_targets"], bool)
    by_phase = report["longest_heartbeat_gap_by_phase_s"]
    assert {"ingest", "serve_and_finalize"} <= set(by_phase)
    assert max(by_phase.values()) == report["longest_heartbeat_gap_s"]
