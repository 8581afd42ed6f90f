"""`minimill bench sessions` at a tiny size: real serve processes, the official openai client,
prefix reuse and KV tiers on vs off, and a restart whose next turn finds its KV on flash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_sessions_bench_runs_and_reuse_pays(model_file: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    for entry in model_file.parent.parent.iterdir():
        (home / "models" / entry.name).symlink_to(entry)
    done = subprocess.run(
        [sys.executable, "-m", "minimill.cli", "bench", "sessions", "--json",
         "--sessions", "2", "--turns", "3", "--tool-tokens", "100", "--max-tokens", "4",
         "--restart-after", "2", "--probe-tokens", "256", "--dtype", "float32"],
        env={**os.environ, "MINIMILL_HOME": str(home)}, capture_output=True, text=True,
        timeout=880)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["cpu"]["model"] and report["dtype"] == "float32"
    # Off computes every prompt token; on reuses each session's earlier turns.
    assert report["prefill_tokens_off"] == report["prompt_tokens"]
    assert report["cached_tokens_reported_off"] == 0
    assert report["cached_tokens_reported"] > 0
    assert report["prefill_tokens_on"] + report["cached_tokens_reported"] == \
        report["prompt_tokens"]
    assert report["prefill_tokens_on"] < report["prefill_tokens_off"]
    # Greedy answers do not depend on where the KV came from.
    assert report["answers_same_on_off"] == 1.0 and report["restore_same_tokens"]
    assert report["restored_tokens_flash"] > 0 and report["restore_s_per_1k"] > 0
    restart = report["restart"]
    # After the restart, the next turn's earlier context came back from flash.
    assert restart["turn_after_restart_cached_tokens"] > \
        restart["turn_after_restart_prompt_tokens"] // 2
