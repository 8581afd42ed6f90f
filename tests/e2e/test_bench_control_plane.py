"""`minimill bench control-plane` as a real process, with tiny sizes: real `serve` processes,
simulated sites speaking the fleet protocol over HTTP, a batch and streaming realtime calls.
Every request completes exactly once, also with two control-plane processes on one PostgreSQL
store while one of them is killed with SIGKILL halfway (its sites move to the other)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest


def _bench(*args: str) -> tuple[dict[str, Any], str]:
    """The report, and what the run said on stderr meanwhile."""
    done = subprocess.run(
        [sys.executable, "-m", "minimill.cli", "bench", "control-plane", "--json", *args],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report, done.stderr


def test_bench_control_plane_reports_exactly_once_completion() -> None:
    # Requests outlast the checkpoint interval (1 s): each is heartbeated at least once.
    report, said = _bench("--sites", "5", "--requests", "50", "--request-s", "1.5")
    # Its stages on stderr (not a terminal: as lines), the JSON alone on stdout.
    assert "sqlite x1, 5 sites: starting the control plane and the sites ... done in" in said
    assert "sqlite x1, 5 sites: 50 requests ... done in" in said
    assert report["cpu_model"]
    (run,) = report["runs"]
    assert (run["store"], run["processes"], run["sites"], run["requests"]) == (
        "sqlite", 1, 5, 50)
    assert run["exactly_once"], run
    assert run["lost"] == run["duplicates"] == run["unfinished"] == 0
    assert run["realtime_answered"] == 5
    assert run["control_plane_cpu_ms_per_request"] > 0
    assert run["completed_per_s"] > 0
    for route in ("lease", "heartbeat", "complete"):
        assert run["latency"][route]["n"] > 0
    assert run["rows_written_per_request"] is None  # measured on PostgreSQL only


@pytest.mark.postgres
def test_two_processes_on_postgresql_complete_everything_once_while_one_is_killed(
        pg_url: str) -> None:
    report, _ = _bench("--sites", "6", "--requests", "120", "--request-s", "0.5",
                    "--capacity", "2", "--db", pg_url, "--processes", "2", "--no-compare",
                    "--kill-one")
    (run,) = report["runs"]
    assert (run["store"], run["processes"]) == ("postgresql", 2)
    assert run["killed_one_process"], run
    assert run["failovers"] > 0  # the killed process's sites went on through the other
    assert run["exactly_once"], run
    assert run["lost"] == run["duplicates"] == run["unfinished"] == 0
    assert run["rows_written_per_request"] > 0
