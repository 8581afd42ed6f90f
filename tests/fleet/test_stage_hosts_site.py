"""A site whose second pipeline stage runs on another host: `minimill worker --pipeline-stages
2 --stages-listen ADDRESS:PORT` and `minimill stage --connect ADDRESS:PORT` (here both on
loopback), serving a batch through the control plane; every request ends as an
uninterrupted single-process greedy run of it does. When the worker's host dies, the stage
waits for the site's next worker, which gets it back and serves again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fleet_checks import batch_records, wait_until
from resume_reference import assert_results_match_reference, finished_requests
from serve_process import MODEL, Serve, Worker, chat_line, free_port

pytestmark = pytest.mark.slow

NUM_LINES = 3


def test_a_site_with_a_stage_on_another_host_serves_a_batch(fleet_home: Path,
                                                            tmp_path: Path) -> None:
    serve = Serve(fleet_home, local_worker=False).start_and_wait()
    address = f"127.0.0.1:{free_port()}"
    stage_log = (tmp_path / "stage.log").open("w")
    stage = subprocess.Popen(
        [sys.executable, "-m", "minimill.cli", "stage", "--connect", address],
        env={**os.environ, "MINIMILL_HOME": str(fleet_home)}, stdout=stage_log,
        stderr=subprocess.STDOUT, start_new_session=True)
    worker: Worker | None = None
    try:
        token = serve.cli("sites", "create", "split").stdout.strip().splitlines()[-1]
        worker = Worker(fleet_home, f"http://127.0.0.1:{serve.port}", "split", token,
                        extra_args=("--pipeline-stages", "2", "--stages-listen", address))
        worker.start_and_wait()
        assert "pipeline: stage 1 joined from" in worker.log_text()
        path = tmp_path / "jobs.jsonl"
        path.write_text("\n".join(
            chat_line(f"h-{i}", f"Name three rivers of country {i}.", 24)
            for i in range(NUM_LINES)) + "\n")
        client = serve.client()
        uploaded = client.files.create(file=path.open("rb"), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                      endpoint="/v1/chat/completions")
        done = wait_until(lambda: (b := client.batches.retrieve(batch.id)).status in (
            "completed", "failed", "cancelled", "expired") and b, 300, "the batch")
        assert done.status == "completed"
        records = batch_records(client, done)
        assert all(r["response"]["status_code"] == 200 for r in records)
        # The worker's host dies (SIGKILL to its whole process group): the stage's session
        # ends and its host waits for the site's next first stage, which gets it back.
        worker.kill9()
        wait_until(lambda: "the pipeline ended" in (tmp_path / "stage.log").read_text(),
                   60, "the stage to wait for the next stage 0")
        assert stage.poll() is None
        worker = Worker(fleet_home, f"http://127.0.0.1:{serve.port}", "split", token,
                        extra_args=("--pipeline-stages", "2", "--stages-listen", address))
        worker.start_and_wait()
        assert "pipeline: stage 1 joined from" in worker.log_text()
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name a river."}],
            max_tokens=4, temperature=0)
        assert answer.usage is not None and answer.usage.completion_tokens == 4
        worker.stop()
        compared = assert_results_match_reference(finished_requests(serve.db_url(),
                                                                    batch_id=batch.id))
        assert len(compared.reference) == NUM_LINES
    finally:
        if worker is not None:
            worker.stop()
        if stage.poll() is None:
            stage.send_signal(signal.SIGTERM)
            stage.wait(60)
        stage_log.close()
        serve.stop()
