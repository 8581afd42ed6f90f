"""A site whose engine spreads a mixture of experts over expert-parallel ranks loses one rank
to SIGKILL mid-batch: the site goes down as for a dead pipeline stage (the engine and the
other ranks stop, the worker hands its unfinished leases back with their checkpoints and
exits with status 3, its log naming the rank), and a second site finishes the batch, each
request completed exactly once."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from fleet_checks import (
    accepted_completions,
    batch_records,
    engine_peer_pids,
    leased_with_tokens,
    wait_until,
)
from proxy import fleet_proxy
from serve_process import Serve, Worker, free_port

from minimill.models.loader import load_model
from tiny_hf import save_tiny

pytestmark = pytest.mark.slow

NUM_LINES = 4
MAX_TOKENS = 400
LEASE_TTL_S = 300.0  # long enough that no expiry frees the requests here
ENGINE_DIED_STATUS = 3
NAME = "tiny-qwen3-moe"


def test_a_killed_rank_takes_its_site_down_and_the_work_finishes_elsewhere(
        fleet_home: Path, tmp_path: Path, model_file: Path) -> None:
    source = tmp_path / NAME
    save_tiny("qwen3_moe", source, load_model(str(model_file), torch.float32))
    serve = Serve(fleet_home, local_worker=False, model=NAME, extra_env={
        "MINIMILL_LEASE_TTL_S": str(LEASE_TTL_S),
        "MINIMILL_CHECKPOINT_INTERVAL_S": "0.2"})
    assert serve.cli("pull", str(source), "--name", NAME).returncode == 0
    serve.start_and_wait()
    workers: list[Worker] = []
    try:
        tokens = {name: serve.cli("sites", "create", name).stdout.strip().splitlines()[-1]
                  for name in ("ranked", "plain")}
        upstream = f"http://127.0.0.1:{serve.port}"
        with fleet_proxy(upstream, free_port()) as ranked_link, \
                fleet_proxy(upstream, free_port()) as plain_link:
            ranked = Worker(fleet_home, ranked_link.url, "ranked", tokens["ranked"],
                            extra_args=("--model", NAME, "--expert-parallel", "2"))
            workers.append(ranked)
            ranked.start_and_wait()
            path = tmp_path / "jobs.jsonl"
            path.write_text("\n".join(json.dumps({
                "custom_id": f"e-{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": NAME, "max_tokens": MAX_TOKENS, "temperature": 0,
                         "messages": [{"role": "user", "content": f"Tell me about bridge {i}."}]}
            }) for i in range(NUM_LINES)) + "\n")
            client = serve.client()
            uploaded = client.files.create(file=path.open("rb"), purpose="batch")
            batch = client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                          endpoint="/v1/chat/completions")
            wait_until(lambda: len(leased_with_tokens(ranked_link)) == NUM_LINES, 180,
                       "checkpoints of every request from the expert-parallel site")
            ranks = wait_until(lambda: engine_peer_pids(ranked.pid), 10, "the rank process")
            assert len(ranks) == 1, ranks  # two ranks: the engine process and one more

            os.kill(ranks[0], signal.SIGKILL)
            assert ranked.popen is not None
            assert ranked.popen.wait(timeout=120) == ENGINE_DIED_STATUS
            log = ranked.log_text()
            assert "expert-parallel rank 1 ended (exit code -9)" in log, log[-3000:]
            assert f"exiting with status {ENGINE_DIED_STATUS}: the engine of site 'ranked' " \
                   "died" in log
            wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in ranks), 30,
                       "the rank process to be reaped")
            handed_back = {request_id for exchange in ranked_link.find("/release")
                           if exchange.status == 200
                           for request_id in exchange.response["released"]}
            assert handed_back, "the expert-parallel site handed nothing back"
            assert len(handed_back | set(accepted_completions(ranked_link))) == NUM_LINES

            plain = Worker(fleet_home, plain_link.url, "plain", tokens["plain"],
                           extra_args=("--model", NAME))
            workers.append(plain)
            plain.start_and_wait()
            done = wait_until(lambda: (b := client.batches.retrieve(batch.id)).status in (
                "completed", "failed", "cancelled", "expired") and b, 300, "the batch")
            assert done.status == "completed"
            records = batch_records(client, done)
            assert sorted(r["custom_id"] for r in records) == \
                sorted(f"e-{i}" for i in range(NUM_LINES))
            assert all(r["response"]["status_code"] == 200 for r in records)
            completions = accepted_completions(ranked_link, plain_link)
            assert sorted(completions.values()) == [1] * NUM_LINES, completions
    finally:
        for worker in workers:
            worker.stop()
        serve.stop()
