"""`minimill serve --workers K` on PostgreSQL: K API processes on one port and one store, one
local worker, the janitor's ticks in one process at a time; an API process killed with SIGKILL
is replaced and the janitor moves on. On SQLite the flag is refused, by name."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from serve_process import MODEL, Serve, minimill_cmd

from minimill.bench.proc_tree import process_tree
from minimill.control.janitor_lock import JANITOR_APPLICATION

pytestmark = [pytest.mark.slow]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""  # gone meanwhile


def _api_processes(serve: Serve) -> list[int]:
    return [p for p in process_tree(serve.pid) if "minimill.serve.api_worker" in _cmdline(p)]


def _local_workers(serve: Serve) -> list[int]:
    return [p for p in process_tree(serve.pid) if " worker --server " in _cmdline(p)]


def _janitors(pg_url: str) -> list[int]:
    """The pids of the processes that hold the janitor's lock, as PostgreSQL sees them."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        names = conn.execute(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
            "WHERE l.locktype = 'advisory' AND l.granted AND a.application_name LIKE %s",
            (JANITOR_APPLICATION + " %",)).fetchall()
    return [int(name.rsplit(" ", 1)[1]) for (name,) in names]


def _wait(predicate: Callable[[], list[int]], what: str, timeout_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"no {what} after {timeout_s:.0f}s")


def _answers(serve: Serve) -> str:
    # A fresh connection per call: the kernel may hand it to either API process.
    with serve.client() as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=3,
            temperature=0)
    return reply.choices[0].message.content or ""


@pytest.mark.postgres
def test_two_api_processes_one_local_worker_one_janitor(e2e_home: Path, pg_url: str) -> None:
    serve = Serve(e2e_home, db=pg_url, workers=2).start_and_wait()
    try:
        (child,) = _wait(lambda: _api_processes(serve), "second API process")
        assert len(_local_workers(serve)) == 1
        holders = _wait(lambda: _janitors(pg_url), "janitor")
        assert len(holders) == 1 and holders[0] in (serve.pid, child)
        answers = {_answers(serve) for _ in range(6)}
        assert len(answers) == 1 and answers.pop()  # greedy: the same answer every time

        os.kill(child, signal.SIGKILL)
        (replacement,) = _wait(lambda: [p for p in _api_processes(serve) if p != child],
                               "replacement API process")
        # The lock went with the dead process's connection; a live one ticks now.
        holders = _wait(lambda: [p for p in _janitors(pg_url) if p != child], "janitor")
        assert len(holders) == 1 and holders[0] in (serve.pid, replacement)
        assert _answers(serve)
        assert len(_local_workers(serve)) == 1
    finally:
        code = serve.stop()
    assert code == 0
    assert not Path(f"/proc/{replacement}").exists() or "api_worker" not in _cmdline(replacement)


def test_workers_refused_on_sqlite(tmp_path: Path) -> None:
    done = subprocess.run(minimill_cmd("serve", "--workers", "2", "--no-local-worker",
                                       "--port", "0"),
                          env={**os.environ, "MINIMILL_HOME": str(tmp_path)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--workers 2 needs --db postgresql://" in done.stderr
