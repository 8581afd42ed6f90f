"""`minimill bench fairness` as a real process, with tiny sizes: a real serve and worker (the
fake engine), two tenants' batches through the official client. The light tenant's p50 beside
a tenant with ten times its load stays near its p50 alone (in one FIFO it would wait for the
heavy tenant's whole batch: five times as long here), and the site stays busy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_bench_fairness_prints_the_light_tenants_p50_beside_the_target() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "minimill.cli", "bench", "fairness", "--json",
         "--light-requests", "4", "--capacity", "8", "--rate", "320", "--max-tokens", "16"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["light_requests"] == 4 and report["heavy_requests"] == 40
    assert report["ratio_target"] == 1.5
    assert report["p50_ratio"] == pytest.approx(
        report["light_p50_beside_heavy_s"] / report["light_p50_alone_s"], abs=0.002)
    assert report["p50_ratio"] < 2.5
    assert report["busy_share_beside"] > 0.6
    assert report["light_share_of_slots_beside"] > 0
