"""Webhooks over real HTTP (SQLite and PostgreSQL): endpoints through the official client, and
events of responses and batches delivered, signed, to a receiver that is down for the first
attempts; it still gets every event, at least once, and checks every signature."""

from __future__ import annotations

import contextlib
import io
import json
import socket
import time
from typing import Any

import openai
import pytest
from api_harness import MODEL, ApiEnv, EchoSite, wait_for
from openai import OpenAI
from sqlalchemy import func, select, update

from minimill.control.tables import batches, webhook_deliveries
from minimill.control.webhooks import create_endpoint
from webhook_receiver import WebhookReceiver, verify

# The receivers listen on loopback: allowed here as an operator may (url_guard.py).
SERVER_SETTINGS = {"webhook_retry_base_s": 0.2, "webhook_retry_cap_s": 1.0,
                   "webhook_interval_s": 0.1, "webhook_allow_private": True}
RESPONSE_EVENTS = ["response.completed", "response.failed", "response.cancelled",
                   "response.incomplete"]
BATCH_EVENTS = ["batch.completed", "batch.failed", "batch.expired", "batch.cancelled"]


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def batch_of(client: OpenAI, content: bytes, endpoint: str = "/v1/responses") -> str:
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch").id
    return client.batches.create(input_file_id=file_id, endpoint=endpoint,  # type: ignore
                                 completion_window="24h").id


def response_line(text: str) -> bytes:
    return json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/responses",
                       "body": {"model": MODEL, "input": text}}).encode()


def ended(client: OpenAI, batch_id: str, status: str) -> bool:
    return client.batches.retrieve(batch_id).status == status


def test_endpoints_through_the_official_client(client: OpenAI, env: ApiEnv) -> None:
    created = client.webhooks.create(name="mine", url="https://hooks.example.com/mm",
                                     event_types=["response.completed", "batch.completed"])
    assert created.signing_secret.startswith("whsec_") and created.object == "webhook_endpoint"
    assert created.signing_secret_hint and created.signing_secret not in created.signing_secret_hint
    fetched = client.webhooks.retrieve(created.id)
    assert (fetched.url, fetched.event_types) == ("https://hooks.example.com/mm",
                                                  ["response.completed", "batch.completed"])
    assert "signing_secret" not in fetched.model_dump()
    assert created.id in [e.id for e in client.webhooks.list()]
    with OpenAI(base_url=env.v1, api_key=env.new_key("tenant-b"), max_retries=0) as other:
        assert created.id not in [e.id for e in other.webhooks.list()]
        with pytest.raises(openai.NotFoundError):
            other.webhooks.retrieve(created.id)
        with pytest.raises(openai.NotFoundError):
            other.webhooks.delete(created.id)
    deleted = client.webhooks.delete(created.id)
    assert deleted.deleted and deleted.id == created.id
    with pytest.raises(openai.NotFoundError):
        client.webhooks.retrieve(created.id)
    for bad, param in ((dict(url="ftp://x/y", event_types=["batch.completed"]), "url"),
                       (dict(url="http://x/y", event_types=["video.completed"]), "event_types"),
                       (dict(url="http://x/y", event_types=[]), "event_types")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.webhooks.create(name="bad", **bad)  # type: ignore[arg-type]
        assert refused.value.param == param


def test_every_event_reaches_a_receiver_that_was_down(client: OpenAI, env: ApiEnv) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    mine = client.webhooks.create(name="a", url=base + "/a",
                                  event_types=RESPONSE_EVENTS + BATCH_EVENTS)  # type: ignore
    other = OpenAI(base_url=env.v1, api_key=env.new_key("tenant-b"), max_retries=0)
    theirs = other.webhooks.create(name="b", url=base + "/b", event_types=["response.completed"])
    # The operator's fleet-wide endpoint: batch events of every tenant.
    fleet, fleet_secret = create_endpoint(env.store, None, "fleet", base + "/fleet",
                                          BATCH_EVENTS, allow_private=True)
    expected: dict[str, set[tuple[str, str]]] = {"/a": set(), "/b": set(), "/fleet": set()}

    def expect(kind: str, object_id: str, *paths: str) -> None:
        for path in paths:
            expected[path].add((kind, object_id))

    # With no worker yet: a cancelled response, a cancelled, an expired and a failed batch.
    queued = client.responses.create(model=MODEL, input="never", background=True)
    client.responses.cancel(queued.id)
    expect("response.cancelled", queued.id, "/a")
    cancelled_batch = batch_of(client, response_line("x"))
    client.batches.cancel(cancelled_batch)
    expect("batch.cancelled", cancelled_batch, "/a", "/fleet")
    expiring = batch_of(client, response_line("y"))
    with env.store.write() as conn:  # its 24 h window has passed
        conn.execute(update(batches).where(batches.c.id == expiring)
                     .values(expires_at=time.time() - 1))
    expect("batch.expired", expiring, "/a", "/fleet")
    failed_batch = batch_of(client, b"not json at all\n")
    expect("batch.failed", failed_batch, "/a", "/fleet")
    with EchoSite(env.base_url, env.site_token):
        done = client.responses.create(model=MODEL, input="hello", background=True)
        broken = client.responses.create(model=MODEL, input="FAIL_CONTEXT", background=True)
        cut = client.responses.create(model=MODEL, input="a b c", background=True,
                                      max_output_tokens=1)
        foreground = client.responses.create(model=MODEL, input="nobody is told")
        tenant_b = other.responses.create(model=MODEL, input="b's", background=True)
        completed_batch = batch_of(client, response_line("z"))
        wait_for(lambda: all(client.responses.retrieve(r.id).status not in
                             ("queued", "in_progress") for r in (done, broken, cut)))
        wait_for(lambda: ended(client, completed_batch, "completed"))
        wait_for(lambda: other.responses.retrieve(tenant_b.id).status == "completed")
    wait_for(lambda: ended(client, cancelled_batch, "cancelled")
             and ended(client, expiring, "expired"))
    assert client.batches.retrieve(failed_batch).status == "failed"
    stopped = client.batches.retrieve(cancelled_batch)
    assert stopped.cancelling_at is not None and stopped.cancelled_at is not None
    assert stopped.cancelled_at >= stopped.cancelling_at  # it ends after it was cancelled
    expect("response.completed", done.id, "/a")
    expect("response.failed", broken.id, "/a")
    expect("response.incomplete", cut.id, "/a")
    expect("batch.completed", completed_batch, "/a", "/fleet")
    expect("response.completed", tenant_b.id, "/b")
    total = sum(len(events) for events in expected.values())

    def tried() -> int:
        with env.store.read() as conn:
            return int(conn.execute(select(func.count()).select_from(webhook_deliveries).where(
                webhook_deliveries.c.endpoint_id.in_([mine.id, theirs.id, fleet.id]),
                webhook_deliveries.c.status == "pending", webhook_deliveries.c.attempts >= 2,
                webhook_deliveries.c.last_error.is_not(None))).scalar_one())

    # Every delivery has failed at least twice while nobody listened.
    wait_for(lambda: tried() == total, timeout_s=60)
    receiver = WebhookReceiver(port, {"/a": mine.signing_secret, "/b": theirs.signing_secret,
                                      "/fleet": fleet_secret}, refuse_first=True).start()
    try:
        wait_for(lambda: all(receiver.events(p) == expected[p] for p in expected)
                 and all(len(ds) >= 2 for p in expected for ds in receiver.by_id(p).values()),
                 timeout_s=60)
        time.sleep(0.5)  # nothing more arrives: no event of another tenant, none of a
        for path, events in expected.items():  # foreground response
            assert receiver.events(path) == events, path
        assert (("response.completed", foreground.id) not in receiver.events("/a"))
        assert receiver.bad_signatures == []
        # At least once: each event came again after the receiver's 503, with the same
        # webhook-id and body (so a receiver can drop the duplicate), freshly signed.
        for path in expected:
            for webhook_id, copies in receiver.by_id(path).items():
                assert webhook_id.startswith("evt_")
                assert len({c.body for c in copies}) == 1
                assert len({(c.event_type, c.data_id) for c in copies}) == 1
        sample = receiver.by_id("/a")[next(iter(receiver.by_id("/a")))][0]
        event = json.loads(sample.body)
        assert event["object"] == "event" and event["id"] == sample.webhook_id
        tampered = sample.body.replace(b'"data":{"id":"', b'"data":{"id":"x')
        assert tampered != sample.body
        with pytest.raises(openai.InvalidWebhookSignatureError):
            verify(tampered, sample.headers, mine.signing_secret)
        with pytest.raises(openai.InvalidWebhookSignatureError):
            verify(sample.body, sample.headers, theirs.signing_secret)
        assert verify(sample.body, sample.headers, mine.signing_secret).id == sample.webhook_id
        with env.store.read() as conn:
            statuses = set(conn.execute(select(webhook_deliveries.c.status).where(
                webhook_deliveries.c.endpoint_id.in_([mine.id, theirs.id, fleet.id])))
                .scalars())
        assert statuses == {"delivered"}
    finally:
        receiver.stop()
        other.close()


def _deliveries(env: ApiEnv, endpoint_id: str) -> list[Any]:
    with env.store.read() as conn:
        return list(conn.execute(select(webhook_deliveries)
                                 .where(webhook_deliveries.c.endpoint_id == endpoint_id)))


def test_a_deleted_endpoint_gets_nothing_more(client: OpenAI, env: ApiEnv) -> None:
    port = free_port()
    endpoint = client.webhooks.create(name="gone", url=f"http://127.0.0.1:{port}/gone",
                                      event_types=["response.cancelled"])
    queued = client.responses.create(model=MODEL, input="q", background=True)
    client.responses.cancel(queued.id)
    wait_for(lambda: any(d.attempts >= 1 for d in _deliveries(env, endpoint.id)))
    client.webhooks.delete(endpoint.id)
    assert _deliveries(env, endpoint.id) == []
