"""Attack (on privacy, by time): a tenant's prompts and results outlive what they belong to.

Request rows used to keep every prompt and result forever, after the batch's files expired or
were deleted and after a response was deleted. Here a tenant's secret goes through a batch, a
background response and a realtime call; once the batch's output file is deleted (or its
files expire), the response deleted, and the realtime call past its retention, the secret is
nowhere in the store's request rows or checkpoints, while the batch still reports its counts
and usage."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest
from api_harness import MODEL, ApiEnv, EchoSite, wait_for
from openai import OpenAI
from sqlalchemy import select

from minimill.control import files, retention
from minimill.control.config import ControlConfig
from minimill.control.tables import checkpoint_chunks, requests

SECRET = "SECRET-PLAN-42"


def secret_rows(env: ApiEnv) -> list[str]:
    """Request rows and checkpoint chunks that still hold the secret anywhere."""
    with env.store.read() as conn:
        rows = [r.id for r in conn.execute(select(requests)) if SECRET in str(tuple(r))]
        rows += [r.request_id for r in conn.execute(select(checkpoint_chunks))
                 if SECRET in str(tuple(r))]
    return rows


def run_batch(client: OpenAI, expires_s: int | None = None) -> str:
    lines = "\n".join(json.dumps({
        "custom_id": f"{SECRET}-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "max_tokens": 8,
                 "messages": [{"role": "user", "content": f"{SECRET} step {i}"}]}})
        for i in range(3))
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(lines.encode())),
                                  purpose="batch").id
    extra = {} if expires_s is None else {
        "output_expires_after": {"anchor": "created_at", "seconds": expires_s}}
    batch_id = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                     completion_window="24h", **extra).id  # type: ignore[arg-type]
    return batch_id


def test_a_batchs_rows_lose_their_text_with_its_files(env: ApiEnv) -> None:
    with OpenAI(base_url=env.v1, api_key=env.key, max_retries=0) as client, \
            EchoSite(env.base_url, env.site_token):
        deleted, expiring = run_batch(client), run_batch(client, expires_s=3600)
        for batch_id in (deleted, expiring):
            wait_for(lambda b=batch_id: client.batches.retrieve(b).status == "completed")
        assert len(secret_rows(env)) == 6
        done = client.batches.retrieve(deleted)
        client.files.delete(done.output_file_id)  # the tenant deletes the results
        assert len(secret_rows(env)) == 3
        # The other batch's output expires (the janitor's sweep, an hour on).
        later = time.time() + 3601
        while files.sweep(env.store, later, ControlConfig().file_writing_ttl_s):
            pass
        assert secret_rows(env) == []
        # What the batch reports is summed from the rows: it is all still there.
        again = client.batches.retrieve(deleted)
        assert again.request_counts is not None and again.request_counts.completed == 3
        assert again.usage is not None and again.usage == done.usage


def test_deleted_and_old_responses_leave_nothing(env: ApiEnv) -> None:
    with OpenAI(base_url=env.v1, api_key=env.new_key("private"), max_retries=0) as client:
        with EchoSite(env.base_url, env.site_token, serve_delay_s=5.0, token_delay_s=0.2):
            running = client.responses.create(model=MODEL, input=f"{SECRET} in progress",
                                              background=True, stream=False)
            streamed = client.responses.create(model=MODEL, input=f"{SECRET} streaming words",
                                               stream=True)
            next(iter(streamed))
            wait_for(lambda: client.responses.retrieve(running.id).status == "in_progress")
            client.responses.delete(running.id)
            streamed.close()
        with EchoSite(env.base_url, env.site_token):
            old = client.responses.create(model=MODEL, input=f"{SECRET} long ago")
            assert old.status == "completed"
        wait_for(lambda: all(client.responses.retrieve(r).status not in
                             ("queued", "in_progress") for r in (old.id,)))
        month_on = time.time() + 31 * 24 * 3600
        while retention.delete_old_requests(env.store, month_on,
                                            ControlConfig().request_retention_s):
            pass
        assert secret_rows(env) == []
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(old.id)
