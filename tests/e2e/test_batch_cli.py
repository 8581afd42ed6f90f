"""`minimill batch submit|status|results|cancel` as a user runs them, against a real serve."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from serve_process import Serve, chat_line, free_port, read_jsonl

pytestmark = pytest.mark.slow


def run_batch(serve: Serve, *args: str, key: str | None = None,
              base_url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {"MINIMILL_BASE_URL": base_url or serve.base_url, "MINIMILL_API_KEY": key or serve.key}
    return serve.cli("batch", *args, env=env, timeout=300)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_submit_follows_progress_and_downloads_results(serve: Serve, tmp_path: Path) -> None:
    lines = [chat_line(f"cli-{i}", f"Say the number {i}.", max_tokens=4) for i in range(12)]
    lines.append(chat_line("cli-bad", "hi", top_p=7))
    file = write_lines(tmp_path / "jobs.jsonl", lines)
    out = tmp_path / "answers.jsonl"
    result = run_batch(serve, "submit", str(file), "--output", str(out))
    assert result.returncode == 0, result.stderr
    assert "completed" in result.stderr
    assert sorted(r["custom_id"] for r in read_jsonl(out.read_bytes())) == \
        sorted(f"cli-{i}" for i in range(12))
    errors = read_jsonl((tmp_path / "answers.errors.jsonl").read_bytes())
    assert [r["custom_id"] for r in errors] == ["cli-bad"]


def test_no_wait_then_status_and_results(serve: Serve, tmp_path: Path) -> None:
    file = write_lines(tmp_path / "few.jsonl",
                       [chat_line(f"nw-{i}", "Hello.", max_tokens=3) for i in range(3)])
    created = run_batch(serve, "submit", str(file), "--no-wait")
    assert created.returncode == 0, created.stderr
    batch_id = created.stdout.strip()
    assert batch_id.startswith("batch_")
    deadline = time.time() + 120
    while time.time() < deadline:
        status = run_batch(serve, "status", batch_id)
        assert status.returncode == 0, status.stderr
        if ": completed" in status.stdout:
            break
        time.sleep(0.5)
    assert "3 completed, 0 failed of 3" in status.stdout
    results = run_batch(serve, "results", batch_id)
    assert results.returncode == 0, results.stderr
    assert sorted(json.loads(line)["custom_id"] for line in results.stdout.splitlines()) == \
        ["nw-0", "nw-1", "nw-2"]


def test_cancel_command(serve: Serve, tmp_path: Path) -> None:
    file = write_lines(tmp_path / "long.jsonl",
                       [chat_line(f"long-{i}", "Write a long poem.", max_tokens=300)
                        for i in range(20)])
    batch_id = run_batch(serve, "submit", str(file), "--no-wait").stdout.strip()
    result = run_batch(serve, "cancel", batch_id)
    assert result.returncode == 0, result.stderr
    assert f"batch {batch_id}: cancel" in result.stdout  # cancelling or cancelled


@pytest.mark.parametrize(("case", "expected"), [
    ("unknown-id", "not found"),
    ("bad-key", "API key was rejected"),
    ("refused", "cannot reach"),
])
def test_failures_are_one_clear_line(serve: Serve, case: str, expected: str) -> None:
    key = "mm-not-a-key" if case == "bad-key" else None
    base_url = f"http://127.0.0.1:{free_port()}/v1" if case == "refused" else None
    batch_id = "batch_doesnotexist" if case == "unknown-id" else "batch_x"
    result = run_batch(serve, "status", batch_id, key=key, base_url=base_url)
    assert result.returncode == 1
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
