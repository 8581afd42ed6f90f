"""Webhook events and delivery state in the store (SQLite and PostgreSQL): one event per ended
object whatever number of control planes record them, exclusive claims that come back when a
sender dies, backoff, giving up, and a store from before these tables gains its new column."""

from __future__ import annotations

import threading

from control_factory import CONFIG, MODEL, ask, site, success, tenant
from sqlalchemy import select, text

from minimill.control import leases
from minimill.control.records import Site
from minimill.control.response_bodies import ResponseBody
from minimill.control.responses import create_response, delete_response
from minimill.control.store import Store, open_store
from minimill.control.tables import requests, webhook_deliveries, webhook_events
from minimill.control.webhook_events import backoff_s, claim_due, record_attempt, record_ended
from minimill.control.webhooks import create_endpoint

NOW = 1_000.0


def ended_background_response(store: Store, owner_id: str, worker: Site) -> str:
    """A background response that `worker` has completed; returns its request id."""
    record = create_response(store, owner_id, ResponseBody(model=MODEL, input="hi",
                                                           background=True), CONFIG, NOW)
    granted = leases.lease(store, worker, ask(), NOW, CONFIG)
    (held,) = [g for g in granted.leases if g.request_id == record.id]
    assert held.kind == "chat" and held.session_key == "resp_" + record.id[4:]
    leases.complete(store, worker, success(record.id, held.epoch), NOW, CONFIG)
    return record.id


def test_each_ended_object_is_one_event_whatever_number_record_it(store: Store,
                                                                    store_url: str) -> None:
    owner, worker = tenant(store), site(store)
    endpoint, _ = create_endpoint(store, owner.id, "a", "http://127.0.0.1:9/a",
                                  ["response.completed"], allow_private=True)
    fleet, _ = create_endpoint(store, None, "f", "http://127.0.0.1:9/f", ["response.completed"],
                               allow_private=True)
    ids = [ended_background_response(store, owner.id, worker) for _ in range(5)]
    others = [open_store(store_url) for _ in range(4)]
    counts: list[int] = []
    threads = [threading.Thread(target=lambda s=s: counts.append(record_ended(s, NOW)))
               for s in others]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in others:
        s.close()
    assert sum(counts) == 5 and record_ended(store, NOW) == 0
    with store.read() as conn:
        events = conn.execute(select(webhook_events)).all()
        deliveries = conn.execute(select(webhook_deliveries)).all()
    assert sorted(e.subject_id for e in events) == sorted(ids)
    assert {e.type for e in events} == {"response.completed"}
    assert sorted((d.event_id, d.endpoint_id) for d in deliveries) == sorted(
        (e.id, p) for e in events for p in (endpoint.id, fleet.id))


def test_claims_are_exclusive_and_come_back_when_a_sender_dies(store: Store) -> None:
    owner, worker = tenant(store), site(store)
    create_endpoint(store, owner.id, "a", "http://127.0.0.1:9/a", ["response.completed"],
                    allow_private=True)
    ended_background_response(store, owner.id, worker)
    assert record_ended(store, NOW) == 1
    (first,) = claim_due(store, NOW, claim_s=30.0)
    assert first.attempts == 1 and first.event_id.startswith("evt_")
    assert claim_due(store, NOW + 29.0, claim_s=30.0) == []  # claimed: nobody else takes it
    (again,) = claim_due(store, NOW + 31.0, claim_s=30.0)  # its sender died: due again
    assert (again.id, again.attempts) == (first.id, 2)
    # The dead sender's late outcome does not overwrite the live claim's schedule.
    record_attempt(store, first, NOW + 32.0, "HTTP 500", CONFIG)
    record_attempt(store, again, NOW + 32.0, "HTTP 503", CONFIG)
    with store.read() as conn:
        row = conn.execute(select(webhook_deliveries)).one()
    assert (row.status, row.last_error) == ("pending", "HTTP 503")
    assert row.next_attempt_at == NOW + 32.0 + backoff_s(2, CONFIG.webhook_retry_base_s,
                                                         CONFIG.webhook_retry_cap_s)
    (third,) = claim_due(store, row.next_attempt_at, claim_s=30.0)
    record_attempt(store, third, row.next_attempt_at, None, CONFIG)
    with store.read() as conn:
        assert conn.execute(select(webhook_deliveries.c.status)).scalar_one() == "delivered"


def test_backoff_doubles_to_its_cap_and_old_events_give_up(store: Store) -> None:
    assert [backoff_s(n, 5.0, 300.0) for n in (1, 2, 3, 7, 8, 100)] == [
        5.0, 10.0, 20.0, 300.0, 300.0, 300.0]
    owner, worker = tenant(store), site(store)
    create_endpoint(store, owner.id, "a", "http://127.0.0.1:9/a", ["response.completed"],
                    allow_private=True)
    ended_background_response(store, owner.id, worker)
    record_ended(store, NOW)
    (claimed,) = claim_due(store, NOW, claim_s=30.0)
    record_attempt(store, claimed, NOW + CONFIG.webhook_max_age_s, "refused", CONFIG)
    with store.read() as conn:
        assert conn.execute(select(webhook_deliveries.c.status)).scalar_one() == "failed"
    assert claim_due(store, NOW + 10 * CONFIG.webhook_max_age_s, claim_s=30.0) == []


def test_no_event_without_a_subscriber_nor_for_a_deleted_response(store: Store) -> None:
    owner, worker = tenant(store), site(store)
    ended_background_response(store, owner.id, worker)
    assert record_ended(store, NOW) == 0  # nobody subscribes: nothing kept
    create_endpoint(store, owner.id, "a", "http://127.0.0.1:9/a", ["response.completed"],
                    allow_private=True)
    gone = ended_background_response(store, owner.id, worker)
    delete_response(store, owner.id, "resp_" + gone[4:])
    assert record_ended(store, NOW) == 0


def test_an_older_store_gains_the_new_columns(store_url: str) -> None:
    first = open_store(store_url)
    with first.write() as conn:
        conn.execute(text("ALTER TABLE requests DROP COLUMN session_key"))
    first.close()
    upgraded = open_store(store_url)
    try:
        with upgraded.read() as conn:
            assert conn.execute(select(requests.c.session_key)).all() == []
    finally:
        upgraded.close()
