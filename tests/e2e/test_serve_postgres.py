"""`minimill serve --db postgresql://...`: the same spine on a real PostgreSQL server, including
a kill -9 of the whole serve mid-batch and a restart."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from serve_process import MODEL, Serve, chat_line, read_jsonl
from sqlalchemy.engine import make_url

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
NUM_LINES = 60


def test_chat_and_a_durable_batch_on_postgres(e2e_home: Path, pg_url: str,
                                              tmp_path: Path) -> None:
    # A URL with a password (the test server trusts local connections and ignores it): the
    # log names the store without it.
    url = make_url(pg_url)
    if url.password is None:
        url = url.set(password="never-logged")
    first = Serve(e2e_home, db=url.render_as_string(hide_password=False)).start_and_wait()
    try:
        log = first.log_text()
        assert "store postgresql" in log and "***" in log
        assert str(url.password) not in log
        client = first.client()
        resp = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4,
            temperature=0)
        assert resp.choices[0].message.content
        path = tmp_path / "pg.jsonl"
        # A few short lines finish first; the kill comes while the long ones run.
        path.write_text("\n".join(chat_line(f"pg-{i:02d}", f"Describe the number {i}.",
                                            max_tokens=2 if i < 5 else 48)
                                  for i in range(NUM_LINES)) + "\n")
        uploaded = client.files.create(file=path.open("rb"), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                      endpoint="/v1/chat/completions")
        deadline = time.time() + 300
        while time.time() < deadline:
            counts = client.batches.retrieve(batch.id).request_counts
            if counts is not None and counts.completed >= 1:
                break
            time.sleep(0.1)
        before = client.batches.retrieve(batch.id)
        assert before.status == "in_progress"
        assert before.request_counts is not None
        assert before.request_counts.completed < NUM_LINES
    finally:
        first.kill9()

    second = Serve(e2e_home, db=pg_url, port=first.port).start_and_wait()
    try:
        client = second.client()
        deadline = time.time() + 300
        while time.time() < deadline:
            done = client.batches.retrieve(batch.id)
            if done.status in ("completed", "failed", "expired", "cancelled"):
                break
            time.sleep(0.5)
        assert done.status == "completed"
        assert done.output_file_id is not None
        out = read_jsonl(client.files.content(done.output_file_id).read())
        assert sorted(r["custom_id"] for r in out) == \
            sorted(f"pg-{i:02d}" for i in range(NUM_LINES))
    finally:
        second.stop()
