"""Durability: kill -9 the whole `serve` (control plane and worker) in the middle of a batch,
start it again on the same MINIMILL_HOME, and the batch completes with every line once, each
exactly as an uninterrupted run of it ends (those resumed from the checkpoints the first serve
stored included). The lines mix the kinds resuming can get wrong (resume_reference.trust_line).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from resume_reference import assert_results_match_reference, finished_requests, rendered, trust_line
from serve_process import Serve, read_jsonl

from minimill.control.records import Kind

pytestmark = pytest.mark.slow
NUM_LINES = 200


def test_kill9_mid_batch_then_restart_loses_nothing(e2e_home: Path, tmp_path: Path) -> None:
    lines = [trust_line(f"d-{i:03d}", i, f"Describe city number {i} in a sentence.", 16)
             for i in range(NUM_LINES)]
    path = tmp_path / "durable.jsonl"
    path.write_text("\n".join(lines) + "\n")

    first = Serve(e2e_home).start_and_wait()
    try:
        client = first.client()
        uploaded = client.files.create(file=path.open("rb"), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.time() + 300
        while time.time() < deadline:
            counts = client.batches.retrieve(batch.id).request_counts
            if counts is not None and counts.completed >= 5:
                break
            time.sleep(0.1)
        before = client.batches.retrieve(batch.id)
        assert before.status == "in_progress"
        assert before.request_counts is not None
        assert before.request_counts.completed < NUM_LINES
    finally:
        first.kill9()  # the control plane and its worker, mid-batch, without warning

    second = Serve(e2e_home, port=first.port).start_and_wait()
    try:
        client = second.client()
        deadline = time.time() + 600
        while time.time() < deadline:
            done = client.batches.retrieve(batch.id)
            if done.status in ("completed", "failed", "expired", "cancelled"):
                break
            time.sleep(0.5)
        assert done.status == "completed"
        out = read_jsonl(client.files.content(done.output_file_id).read()) \
            if done.output_file_id else []
        errors = read_jsonl(client.files.content(done.error_file_id).read()) \
            if done.error_file_id else []
        ids = [r["custom_id"] for r in out + errors]
        assert sorted(ids) == sorted(f"d-{i:03d}" for i in range(NUM_LINES))  # each once
        assert errors == []
        assert done.request_counts is not None
        assert done.request_counts.completed == NUM_LINES
    finally:
        second.stop()

    finished = finished_requests(second.db_url(), batch_id=batch.id)
    compared = assert_results_match_reference(finished)
    assert compared.resumed  # the comparison covered requests the kill interrupted
    guided = {f.request_id for f in finished
              if "response_format" in f.lease.body or "tools" in f.lease.body}
    assert guided & set(compared.resumed)  # grammars rebuilt from checkpointed tokens
    for record in out:
        request_id = record["response"]["request_id"]
        assert record["response"]["body"]["choices"] == rendered(
            Kind.CHAT, compared.reference[request_id], request_id)
