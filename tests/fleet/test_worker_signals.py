"""Worker shutdown: SIGTERM stops leasing, checkpoints unfinished work and exits cleanly (the
work resumes on another site); a local worker whose serve died exits by itself."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path

import pytest
from serve_process import MODEL, Serve, Worker

pytestmark = pytest.mark.slow


def test_sigterm_checkpoints_and_the_request_resumes_elsewhere(fleet_home: Path) -> None:
    serve = Serve(fleet_home, local_worker=False).start_and_wait()
    workers: list[Worker] = []
    try:
        tokens = [serve.cli("sites", "create", name).stdout.strip().splitlines()[-1]
                  for name in ("term-a", "term-b")]
        server = f"http://127.0.0.1:{serve.port}"
        worker_a = Worker(fleet_home, server, "term-a", tokens[0],
                          extra_env={"MINIMILL_WORKER_DRAIN_S": "0.5"}).start_and_wait()
        workers.append(worker_a)
        stream = serve.client(timeout=300).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Write a long story about a "
                                                              "lighthouse keeper."}],
            max_tokens=200, temperature=0, stream=True)
        chunks = iter(stream)
        first = ""
        while not first:
            chunk = next(chunks)
            first = "".join(c.delta.content or "" for c in chunk.choices)

        worker_a.popen.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        assert worker_a.popen.wait(timeout=30) == 0  # type: ignore[union-attr]
        log = worker_a.log_text()
        assert "checkpointing 1 unfinished requests before exit" in log

        worker_b = Worker(fleet_home, server, "term-b", tokens[1]).start_and_wait()
        workers.append(worker_b)
        pool = concurrent.futures.ThreadPoolExecutor(1)
        rest = pool.submit(lambda: [c.delta.content or "" for chunk in chunks
                                    for c in chunk.choices])
        text = first + "".join(rest.result(timeout=300))
        pool.shutdown()
        match = worker_b.wait_for_log(r"1 resume from checkpoints \((\d+) tokens\)", 10)
        assert int(match.group(1)) >= 1
        assert len(text) > len(first)
    finally:
        for worker in workers:
            worker.stop()
        serve.stop()


def test_local_worker_exits_when_serve_dies(fleet_home: Path) -> None:
    serve = Serve(fleet_home).start_and_wait()
    group = serve.pid  # serve leads its own process group; the worker is in it
    try:
        os.kill(serve.pid, signal.SIGKILL)  # serve alone, not its worker
        serve.popen.wait(timeout=10)  # type: ignore[union-attr]
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                break  # nothing is left in the group: the worker stopped by itself
            time.sleep(0.2)
        else:
            pytest.fail("the local worker outlived its serve by 30 s")
        assert "parent process" in serve.log_text()
    finally:
        serve.stop()
