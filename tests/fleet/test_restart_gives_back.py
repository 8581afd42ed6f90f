"""A worker killed with -9 and started again gives back what its site still held, at once:
the request resumes (here on the restarted worker itself) long before its lease would have
expired, from the checkpoint it had, and ends as an uninterrupted run does."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import pytest
from serve_process import MODEL, Serve, Worker

pytestmark = pytest.mark.slow

LEASE_TTL_S = 300.0


def site_token(serve: Serve, name: str) -> str:
    result = serve.cli("sites", "create", name, "--price-per-hour", "0.1")
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_a_restarted_worker_gives_back_its_killed_runs_leases(fleet_home: Path) -> None:
    # Leases long enough that an expiry cannot be what frees the request in this test.
    serve = Serve(fleet_home, local_worker=False,
                  extra_env={"MINIMILL_LEASE_TTL_S": str(LEASE_TTL_S)}).start_and_wait()
    workers: list[Worker] = []
    try:
        token = site_token(serve, "site-r")
        server = f"http://127.0.0.1:{serve.port}"
        worker = Worker(fleet_home, server, "site-r", token).start_and_wait()
        workers.append(worker)
        messages = [{"role": "user", "content": "Write a long essay on the history of Rome."}]
        pool = concurrent.futures.ThreadPoolExecutor(1)
        answer = pool.submit(serve.client(timeout=600).chat.completions.create, model=MODEL,
                             messages=messages, max_tokens=96, temperature=0)
        time.sleep(3.0)  # leased at once; some tokens generated, checkpointed every 0.5 s
        worker.kill9()
        killed_at = time.monotonic()
        assert not answer.done()

        again = Worker(fleet_home, server, "site-r", token)
        workers.append(again)
        offset = again.log_path.stat().st_size
        again.start_and_wait()
        again.wait_for_log(r"gave back 1 leases the previous run of this site held", 30,
                           offset)
        again.wait_for_log(r"leased 1 requests; 1 resume from checkpoints", 30, offset)
        result = answer.result(timeout=240)
        waited = time.monotonic() - killed_at
        assert waited < LEASE_TTL_S / 2, f"the request waited {waited:.0f}s after the kill"
        assert result.choices[0].finish_reason == "length"
        assert result.usage is not None and result.usage.completion_tokens == 96
        reference = serve.client(timeout=600).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=96, temperature=0)
        assert result.choices[0].message.content == reference.choices[0].message.content
    finally:
        for w in workers:
            w.stop()
        serve.stop()
