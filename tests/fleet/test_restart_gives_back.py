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
# Far more tokens than a CPU site streams between two checkpoints (every 0.5 s), so
# the request is still running when its first streamed token arrives.
MAX_TOKENS = 256


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
        stream = serve.client(timeout=600).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True})
        chunks = iter(stream)
        # A streamed token reached the client: the site has checkpointed the request (a
        # stream's tokens come through its checkpoints), so its restart resumes from there.
        before = []
        for chunk in chunks:
            before.append(chunk)
            if chunk.choices and chunk.choices[0].delta.content:
                break
        assert not any(c.choices and c.choices[0].finish_reason for c in before)
        worker.kill9()
        killed_at = time.monotonic()
        pool = concurrent.futures.ThreadPoolExecutor(1)
        rest = pool.submit(list, chunks)

        again = Worker(fleet_home, server, site, token, extra_args=flash)
        workers.append(again)
        offset = again.log_path.stat().st_size
        again.start_and_wait()
        again.wait_for_log(r"leased 1 requests; 1 resume from checkpoints", 30, offset)
        streamed = before + rest.result(timeout=240)
        waited = time.monotonic() - killed_at
        assert waited < LEASE_TTL_S / 2, f"the request waited {waited:.0f}s after the kill"
        log = again.log_text()[offset:]
        assert ("gave back 1 leases the previous run of this site held" in log) != kv_flash
        finish = [c.choices[0].finish_reason for c in streamed
                  if c.choices and c.choices[0].finish_reason]
        assert finish == ["length"], finish
        usage = streamed[-1].usage
        assert usage is not None and usage.completion_tokens == MAX_TOKENS
        assert usage.prompt_tokens_details is not None
        # The restarted engine's pool starts empty: KV it did not compute came from flash.
        cached = usage.prompt_tokens_details.cached_tokens or 0
        assert (cached > 0) == kv_flash, cached
        content = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        reference = serve.client(timeout=600).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert content == reference.choices[0].message.content
    finally:
        for w in workers:
            w.stop()
        serve.stop()
