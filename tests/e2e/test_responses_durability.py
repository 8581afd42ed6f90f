"""Background responses survive a kill -9 of the whole `serve` (control plane and its worker):
started again on the same MINIMILL_HOME, the response completes once, with the answer an
uninterrupted run gives; a client streaming it resumes from its last sequence number with no
gap or repeat; and the fleet-wide webhook registered with `minimill webhooks create` reports
its completion, signed."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from serve_process import MODEL, Serve, free_port
from sqlalchemy import select

from minimill.control.store import open_store
from minimill.control.tables import requests
from webhook_receiver import WebhookReceiver

pytestmark = pytest.mark.slow
PROMPT = "Write a long story about a lighthouse keeper and a storm, with many details."
PARAMS: dict[str, Any] = {"model": MODEL, "input": PROMPT, "max_output_tokens": 96,
                          "temperature": 0, "background": True}


def finished(client: OpenAI, response_id: str, timeout: float) -> Any:
    deadline = time.time() + timeout
    while time.time() < deadline:
        current = client.responses.retrieve(response_id)
        if current.status not in ("queued", "in_progress"):
            return current
        time.sleep(0.2)
    raise TimeoutError(f"{response_id} did not finish in {timeout}s")


# The receiver listens on loopback, which webhooks may reach only when the operator allows it.
LOCAL_WEBHOOKS = {"MINIMILL_WEBHOOK_ALLOW_PRIVATE": "1"}


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres",
                                                             marks=pytest.mark.postgres)])
def test_kill9_mid_response_then_restart_completes_it_once(
        e2e_home: Path, backend: str, request: pytest.FixtureRequest) -> None:
    db = request.getfixturevalue("pg_url") if backend == "postgres" else None
    port = free_port()
    first = Serve(e2e_home, db=db, extra_env=LOCAL_WEBHOOKS).start_and_wait()
    created = first.cli("webhooks", "create", f"http://127.0.0.1:{port}/hook", "--fleet",
                        "--event", "response.completed", "--event", "response.incomplete",
                        "--db", first.db_url())
    assert created.returncode == 0, created.stderr
    match = re.search(r"(whsec_\S+)", created.stdout)
    assert match is not None
    receiver = WebhookReceiver(port, {"/hook": match.group(1)}).start()
    try:
        client = first.client()
        reference = finished(client, client.responses.create(**PARAMS).id, 300)
        assert reference.status == "incomplete" and len(reference.output_text) > 40
        stream = client.responses.create(**PARAMS, stream=True)
        before = []
        for event in stream:
            before.append(event)
            if sum(e.type == "response.output_text.delta" for e in before) >= 3:
                break
        response_id = before[0].response.id
    finally:
        first.kill9()  # the control plane and its worker, mid-answer, without warning

    second = Serve(e2e_home, db=db, port=first.port, extra_env=LOCAL_WEBHOOKS).start_and_wait()
    try:
        client = second.client()
        after = list(client.responses.retrieve(response_id, stream=True,
                                               starting_after=before[-1].sequence_number))
        events = before + after
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].type == "response.incomplete"  # stopped by max_output_tokens
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        done = client.responses.retrieve(response_id)
        assert text == done.output_text == reference.output_text
        assert done.usage is not None and reference.usage is not None
        assert done.usage.output_tokens == reference.usage.output_tokens
        store = open_store(second.db_url())
        try:
            with store.read() as conn:
                row = conn.execute(select(requests.c.status, requests.c.attempts).where(
                    requests.c.id == "req_" + response_id.removeprefix("resp_"))).one()
        finally:
            store.close()
        assert (row.status, row.attempts >= 2) == ("succeeded", True)  # resumed after the kill
        # Both ends were announced, each as one event (one webhook-id), signed.
        announced = {("response.incomplete", response_id), ("response.incomplete", reference.id)}
        deadline = time.time() + 60
        while time.time() < deadline and not announced <= receiver.events("/hook"):
            time.sleep(0.2)
        assert receiver.events("/hook") == announced
        ids = {d.webhook_id for d in receiver.deliveries if d.data_id == response_id}
        assert len(ids) == 1 and receiver.bad_signatures == []
    finally:
        second.stop()
        receiver.stop()
