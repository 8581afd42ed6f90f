"""A batch's last completion wakes its finalization: with the janitor polling only once a
minute, a small batch still ends within seconds of its last line (the create wakes its ingest,
the last completion its finalization)."""

from __future__ import annotations

import io
import json
import time

from api_harness import MODEL, EchoSite, wait_for
from openai import OpenAI

SERVER_SETTINGS = {"janitor_interval_s": 60.0}


def test_the_last_completion_finalizes_the_batch_at_once(client: OpenAI,
                                                          site: EchoSite) -> None:
    lines = [json.dumps({"custom_id": f"w-{i}", "method": "POST",
                         "url": "/v1/chat/completions",
                         "body": {"model": MODEL, "max_tokens": 5,
                                  "messages": [{"role": "user", "content": f"wake {i}"}]}})
             for i in range(12)]
    file_id = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())),
                                  purpose="batch").id
    started = time.monotonic()
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status
                    in ("completed", "failed") and b, timeout_s=30)
    assert done.status == "completed"
    assert done.request_counts is not None and done.request_counts.completed == 12
    # Far sooner than the janitor's next poll (60 s): the last completion woke it.
    assert time.monotonic() - started < 20
