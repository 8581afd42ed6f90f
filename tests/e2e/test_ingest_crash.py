"""kill -9 of a control plane in the middle of a batch's ingest: another process resumes it at
the last committed group, and every line of the file ends up queued exactly once (a duplicate
custom_id after the crash point is still caught). SQLite and PostgreSQL."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from serve_process import Serve, chat_line
from sqlalchemy import select

from minimill.control.store import open_store
from minimill.control.tables import requests

pytestmark = pytest.mark.slow
NUM_LINES = 20_000
INGEST_ENV = {"MINIMILL_INGEST_GROUP_LINES": "100", "MINIMILL_INGEST_CLAIM_TTL_S": "2"}


def batch_job_processes(parent: int) -> list[int]:
    """The children of `parent` that run batch jobs (anyio's worker processes)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"anyio.to_process" in cmdline:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie waiting for its reaper does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres",
                                                            marks=pytest.mark.postgres)])
def test_kill9_mid_ingest_resumes_without_duplicates(
        e2e_home: Path, tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    db = request.getfixturevalue("pg_url") if backend == "postgres" else None
    path = tmp_path / "big.jsonl"
    lines = [chat_line(f"i-{i:05d}", f"Tell me about {i}.") for i in range(NUM_LINES)]
    lines[-1] = chat_line("i-00003", "a duplicate, found after the crash")
    path.write_text("\n".join(lines) + "\n")

    first = Serve(e2e_home, local_worker=False, extra_env=INGEST_ENV, db=db).start_and_wait()
    try:
        client = first.client()
        uploaded = client.files.create(file=path.open("rb"), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                      endpoint="/v1/chat/completions")
        deadline = time.time() + 300
        while time.time() < deadline:
            before = client.batches.retrieve(batch.id)
            if before.request_counts is not None and before.request_counts.total >= 1000:
                break
            time.sleep(0.02)
        assert before.status == "validating"  # caught in the middle of the ingest
        assert before.request_counts is not None
        assert 0 < before.request_counts.total < NUM_LINES
        # The ingest runs in a process of the control plane's own; kill -9 of the control
        # plane alone takes it along (it must not go on ingesting beside the next one).
        jobs = batch_job_processes(first.pid)
        assert jobs, "no batch-jobs process under the control plane"
        os.kill(first.pid, signal.SIGKILL)
        # At once (the kernel's parent-death signal), not once its job is done.
        deadline = time.time() + 2
        while any(alive(pid) for pid in jobs) and time.time() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in jobs), "the batch-jobs process outlived its parent"
    finally:
        first.kill9()

    second = Serve(e2e_home, local_worker=False, extra_env=INGEST_ENV, db=db,
                   port=first.port).start_and_wait()
    try:
        client = second.client()
        deadline = time.time() + 600
        while time.time() < deadline:
            done = client.batches.retrieve(batch.id)
            if done.status != "validating":
                break
            time.sleep(0.2)
        assert done.status == "in_progress"
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.failed) == (NUM_LINES, 1)
        store = open_store(second.db_url())
        try:
            with store.read() as conn:
                rows = conn.execute(select(requests.c.line_no, requests.c.custom_id,
                                           requests.c.error)
                                    .where(requests.c.batch_id == batch.id)).all()
        finally:
            store.close()
        assert sorted(r.line_no for r in rows) == list(range(1, NUM_LINES + 1))
        assert Counter(r.custom_id for r in rows)["i-00003"] == 2
        (duplicate,) = [r for r in rows if r.error]
        assert duplicate.line_no == NUM_LINES
        assert duplicate.error["code"] == "duplicate_custom_id"
        client.batches.cancel(batch.id)
    finally:
        second.stop()
