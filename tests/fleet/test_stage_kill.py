"""A site whose engine runs in pipeline stages loses one stage to SIGKILL mid-batch: the whole
site goes down cleanly (the other stage and the engine stop, the worker hands every unfinished
lease back with its checkpoint and exits with status 3), and the work resumes on another site
at once (long before its lease would expire), each request completed exactly once and ending
as an uninterrupted greedy run of it does."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from fleet_checks import (
    accepted_completions,
    batch_records,
    engine_peer_pids,
    leased_with_tokens,
    wait_until,
)
from proxy import fleet_proxy
from resume_reference import assert_results_match_reference, finished_requests
from serve_process import Serve, Worker, chat_line, free_port

pytestmark = pytest.mark.slow

NUM_LINES = 4
MAX_TOKENS = 160
# Leases long enough that an expiry cannot be what frees the requests in this test.
LEASE_TTL_S = 300.0
ENGINE_DIED_STATUS = 3


def test_a_killed_stage_takes_its_site_down_and_the_work_resumes_elsewhere(
        fleet_home: Path, tmp_path: Path) -> None:
    serve = Serve(fleet_home, local_worker=False, extra_env={
        "MINIMILL_LEASE_TTL_S": str(LEASE_TTL_S),
        "MINIMILL_CHECKPOINT_INTERVAL_S": "0.2"}).start_and_wait()
    workers: list[Worker] = []
    try:
        tokens = {name: serve.cli("sites", "create", name).stdout.strip().splitlines()[-1]
                  for name in ("staged", "plain")}
        upstream = f"http://127.0.0.1:{serve.port}"
        with fleet_proxy(upstream, free_port()) as staged_link, \
                fleet_proxy(upstream, free_port()) as plain_link:
            staged = Worker(fleet_home, staged_link.url, "staged", tokens["staged"],
                            extra_args=("--pipeline-stages", "2")).start_and_wait()
            workers.append(staged)
            path = tmp_path / "jobs.jsonl"
            path.write_text("\n".join(
                chat_line(f"s-{i}", f"Write a long essay about the bridges of city {i}.",
                          MAX_TOKENS) for i in range(NUM_LINES)) + "\n")
            client = serve.client()
            uploaded = client.files.create(file=path.open("rb"), purpose="batch")
            batch = client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                          endpoint="/v1/chat/completions")
            # Every request leased by the staged site, each with tokens checkpointed.
            wait_until(lambda: len(leased_with_tokens(staged_link)) == NUM_LINES, 180,
                       "checkpoints of every request from the staged site")
            stages = wait_until(lambda: engine_peer_pids(staged.pid), 10, "the stage process")
            assert len(stages) == 1, stages  # two stages: the engine process and one more

            os.kill(stages[0], signal.SIGKILL)
            killed_at = time.monotonic()
            assert staged.popen is not None
            assert staged.popen.wait(timeout=120) == ENGINE_DIED_STATUS
            log = staged.log_text()
            # The cause, as the engine saw it first: the stage's exit, or a send it failed.
            assert re.search(r"the engine died \(.*pipeline stage 1 (ended \(exit code -9\)"
                             r"|is unreachable)", log), log[-3000:]
            assert f"exiting with status {ENGINE_DIED_STATUS}: the engine of site 'staged' " \
                   "died" in log
            # Nothing of the site is left running.
            wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in stages), 30,
                       "the stage process to be reaped")
            handed_back = {request_id for exchange in staged_link.find("/release")
                           if exchange.status == 200
                           for request_id in exchange.response["released"]}
            finished_there = set(accepted_completions(staged_link))
            assert handed_back, "the staged site handed nothing back"
            assert len(handed_back | finished_there) == NUM_LINES

            plain = Worker(fleet_home, plain_link.url, "plain", tokens["plain"])
            workers.append(plain)
            plain.start_and_wait()
            plain.wait_for_log(r"resume from checkpoints", 60)
            done = wait_until(lambda: (b := client.batches.retrieve(batch.id)).status in (
                "completed", "failed", "cancelled", "expired") and b, 300, "the batch")
            waited = time.monotonic() - killed_at
            assert waited < LEASE_TTL_S / 2, f"the batch ended {waited:.0f}s after the kill"
            assert done.status == "completed"
            records = batch_records(client, done)
            assert sorted(r["custom_id"] for r in records) == \
                sorted(f"s-{i}" for i in range(NUM_LINES))
            assert all(r["response"]["status_code"] == 200 for r in records)
            # Each request completed exactly once, by one site or the other.
            completions = accepted_completions(staged_link, plain_link)
            assert sorted(completions.values()) == [1] * NUM_LINES, completions
            assert set(accepted_completions(plain_link)) == handed_back
        for worker in workers:
            worker.stop()  # idle now; the reference run below gets the CPU
        # The resumed text is what one uninterrupted greedy run gives.
        compared = assert_results_match_reference(finished_requests(serve.db_url(),
                                                                    batch_id=batch.id))
        assert set(compared.resumed) == handed_back
    finally:
        for worker in workers:
            worker.stop()
        serve.stop()
