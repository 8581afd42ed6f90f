"""A worker killed with -9 and started again does not leave what its site held waiting for
the leases to expire. Without a KV flash tier it gives those leases back while its engine
loads; with one it takes them back with its first lease call and resumes them from the KV it
had written through to flash. Either way the request resumes long before its lease would
have expired, from the checkpoint it had, and ends as an uninterrupted run does."""

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


@pytest.mark.parametrize("kv_flash", [False, True], ids=["gives-back", "takes-back"])
def test_a_restarted_worker_does_not_leave_its_killed_runs_leases_waiting(
        fleet_home: Path, kv_flash: bool) -> None:
    # Leases long enough that an expiry cannot be what frees the request in this test.
    serve = Serve(fleet_home, local_worker=False,
                  extra_env={"MINIMILL_LEASE_TTL_S": str(LEASE_TTL_S)}).start_and_wait()
    workers: list[Worker] = []
    site = f"site-{'flash' if kv_flash else 'plain'}"
    flash = ("--kv-flash-dir", str(fleet_home / f"kv-{site}")) if kv_flash else ()
    try:
        token = site_token(serve, site)
        server = f"http://127.0.0.1:{serve.port}"
        worker = Worker(fleet_home, server, site, token, extra_args=flash).start_and_wait()
        workers.append(worker)
        messages = [{"role": "user", "content": "Write a long essay on the history of Rome."}]
        pool = concurrent.futures.ThreadPoolExecutor(1)
        answer = pool.submit(serve.client(timeout=600).chat.completions.create, model=MODEL,
                             messages=messages, max_tokens=96, temperature=0)
        time.sleep(3.0)  # leased at once; some tokens generated, checkpointed every 0.5 s
        worker.kill9()
        killed_at = time.monotonic()
        assert not answer.done()

        again = Worker(fleet_home, server, site, token, extra_args=flash)
        workers.append(again)
        offset = again.log_path.stat().st_size
        again.start_and_wait()
        again.wait_for_log(r"leased 1 requests; 1 resume from checkpoints", 30, offset)
        result = answer.result(timeout=240)
        waited = time.monotonic() - killed_at
        assert waited < LEASE_TTL_S / 2, f"the request waited {waited:.0f}s after the kill"
        log = again.log_text()[offset:]
        assert ("gave back 1 leases the previous run of this site held" in log) != kv_flash
        assert result.choices[0].finish_reason == "length"
        usage = result.usage
        assert usage is not None and usage.completion_tokens == 96
        assert usage.prompt_tokens_details is not None
        # The restarted engine's pool starts empty: KV it did not compute came from flash.
        cached = usage.prompt_tokens_details.cached_tokens or 0
        assert (cached > 0) == kv_flash, cached
        reference = serve.client(timeout=600).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=96, temperature=0)
        assert result.choices[0].message.content == reference.choices[0].message.content
    finally:
        for w in workers:
            w.stop()
        serve.stop()
