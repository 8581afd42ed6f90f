"""Releases and handback on a real store (SQLite and PostgreSQL): a released lease is queued
at once with its checkpoint, fenced like every other transition; a heartbeat names what a
site should hand back ahead of its announced outage; outages can be listed and withdrawn."""

from __future__ import annotations

import time

import pytest
from control_factory import CONFIG, ask, batch, chat_line, site, success, tenant
from sqlalchemy import select

from minimill.control import checkpoints
from minimill.control.errors import NotFoundError
from minimill.control.leases import complete, heartbeat, lease, reap_expired
from minimill.control.release import release
from minimill.control.site_view import list_sites
from minimill.control.sites import add_outage, list_outages, remove_outage
from minimill.control.store import Store
from minimill.control.tables import requests
from minimill.transport.protocol import (
    Checkpoint,
    ChoiceProgress,
    HeartbeatItem,
    HeartbeatRequest,
    ReleaseItem,
    ReleaseRequest,
)


def progress(tokens: int) -> Checkpoint:
    return Checkpoint(num_prompt_tokens=5, choices=[ChoiceProgress(
        index=0, token_ids=list(range(tokens)), text="x" * tokens)])


def row(store: Store, request_id: str) -> dict[str, object]:
    with store.read() as conn:
        found = conn.execute(select(requests).where(requests.c.id == request_id)).one()
    return dict(found._mapping)


def stored_tokens(store: Store, request_id: str) -> list[int]:
    """The token ids of the request's stored checkpoint (its chunks, assembled)."""
    with store.read() as conn:
        return checkpoints.load(conn, [request_id])[request_id].choices[0].token_ids


def test_a_released_lease_is_queued_at_once_with_its_checkpoint(store: Store) -> None:
    owner, mine, other = tenant(store), site(store, "a"), site(store, "b")
    now = time.time()
    batch(store, owner, [chat_line("one")], now=now)
    # Asking for just one, the site says it has no room left: the other site may take it.
    held = lease(store, mine, ask(capacity=1), now, CONFIG).leases[0]
    answer = release(store, mine, ReleaseRequest(leases=[ReleaseItem(
        request_id=held.request_id, epoch=held.epoch, checkpoint=progress(3))]), now + 1,
        CONFIG)
    assert answer.released == [held.request_id] and answer.rejected == []
    after = row(store, held.request_id)
    assert after["status"] == "queued" and after["lease_id"] is None
    assert after["lease_expires_at"] is None and after["epoch"] == held.epoch
    assert stored_tokens(store, held.request_id) == [0, 1, 2]
    assert after["checkpoint_tokens"] == 3
    # Another site gets it at once (no expiry to wait for), with the checkpoint, at a new epoch.
    again = lease(store, other, ask(), now + 1.5, CONFIG).leases
    assert [g.request_id for g in again] == [held.request_id]
    assert again[0].epoch == held.epoch + 1
    assert again[0].checkpoint is not None and len(again[0].checkpoint.choices[0].token_ids) == 3
    # The first site's late release and late completion are both fenced off.
    late = release(store, mine, ReleaseRequest(leases=[ReleaseItem(
        request_id=held.request_id, epoch=held.epoch, checkpoint=progress(1))]), now + 2,
        CONFIG)
    assert late.released == [] and late.rejected == [held.request_id]
    assert complete(store, mine, success(held.request_id, held.epoch), now + 2,
                    CONFIG).rejected[0].reason == "stale_epoch"
    assert complete(store, other, success(held.request_id, again[0].epoch), now + 3,
                    CONFIG).accepted == [held.request_id]
    sites = {s.name: s for s in list_sites(store, now + 3)}
    assert sites["a"].leases_expired == 0  # released, not lost



def test_a_starting_worker_whose_kv_survived_takes_its_sites_leases_back(store: Store) -> None:
    """`adopt_held` on a lease call returns the leases the site still holds at a new epoch,
    with their checkpoints, before new work and within the capacity asked for; the previous
    run's late messages are fenced off, and other sites' leases are untouched."""
    owner, mine, other = tenant(store), site(store, "a"), site(store, "b")
    now = time.time()
    batch(store, owner, [chat_line(f"q{i}") for i in range(6)], now=now)
    held = lease(store, mine, ask(capacity=3), now, CONFIG).leases
    theirs = lease(store, other, ask(capacity=1), now, CONFIG).leases
    heartbeat(store, mine, HeartbeatRequest(leases=[HeartbeatItem(
        request_id=held[0].request_id, epoch=held[0].epoch, checkpoint=progress(4))]),
        now + 0.5, CONFIG)
    again = lease(store, mine, ask(capacity=4).model_copy(update={"adopt_held": True}),
                  now + 1, CONFIG).leases
    assert [g.request_id for g in again[:3]] == [h.request_id for h in held]
    assert [g.epoch for g in again[:3]] == [h.epoch + 1 for h in held]
    assert len(again) == 4 and again[3].request_id not in {t.request_id for t in theirs}
    assert again[0].checkpoint is not None
    assert again[0].checkpoint.choices[0].token_ids == [0, 1, 2, 3]
    # The killed run's heartbeat is stale now; the other site still holds its lease.
    beat = heartbeat(store, mine, HeartbeatRequest(leases=[HeartbeatItem(
        request_id=held[1].request_id, epoch=held[1].epoch)]), now + 1.5, CONFIG)
    assert beat.revoked == [held[1].request_id]
    assert row(store, theirs[0].request_id)["site_id"] == other.id
    # A smaller capacity takes back only that many; the rest stay held by the site.
    small = lease(store, mine, ask(capacity=2).model_copy(update={"adopt_held": True}),
                  now + 2, CONFIG).leases
    assert len(small) == 2
    assert all(g.epoch == h.epoch + 2 for g, h in zip(small, held[:2], strict=True))
    assert complete(store, mine, success(held[0].request_id, small[0].epoch), now + 3,
                    CONFIG).accepted == [held[0].request_id]


def test_a_starting_worker_gives_back_everything_its_site_held(store: Store) -> None:
    """A restarted worker's site still holds its killed run's leases: `all_held` queues them
    at once with their checkpoints, and leaves other sites' leases alone."""
    owner, mine, other = tenant(store), site(store, "a"), site(store, "b")
    now = time.time()
    batch(store, owner, [chat_line(f"q{i}") for i in range(5)], now=now)
    held = lease(store, mine, ask(capacity=3), now, CONFIG).leases
    theirs = lease(store, other, ask(capacity=1), now, CONFIG).leases
    assert len(held) == 3 and len(theirs) == 1
    heartbeat(store, mine, HeartbeatRequest(leases=[HeartbeatItem(
        request_id=held[0].request_id, epoch=held[0].epoch, checkpoint=progress(2))]),
        now + 0.5, CONFIG)
    answer = release(store, mine, ReleaseRequest(all_held=True), now + 1, CONFIG)
    assert sorted(answer.released) == sorted(h.request_id for h in held)
    assert answer.rejected == []
    for h in held:
        assert row(store, h.request_id)["status"] == "queued"
    assert stored_tokens(store, held[0].request_id) == [0, 1]  # the checkpoint is kept
    assert row(store, theirs[0].request_id)["status"] == "leased"
    # Nothing left to give back; the other site's leases are not this site's to give.
    assert release(store, mine, ReleaseRequest(all_held=True), now + 2, CONFIG).released == []
    regained = lease(store, other, ask(), now + 2, CONFIG).leases
    assert {g.request_id for g in regained} >= {h.request_id for h in held}


def test_release_fencing(store: Store) -> None:
    owner, mine, stranger = tenant(store), site(store, "a"), site(store, "b")
    now = time.time()
    batch(store, owner, [chat_line("one"), chat_line("two")], now=now)
    first, second = lease(store, mine, ask(), now, CONFIG).leases
    items = [ReleaseItem(request_id=first.request_id, epoch=first.epoch + 1),  # wrong epoch
             ReleaseItem(request_id="req_nope", epoch=1),
             ReleaseItem(request_id=first.request_id, epoch=2**40)]  # not a granted epoch
    assert release(store, mine, ReleaseRequest(leases=items), now, CONFIG).released == []
    # Another site cannot release what this one holds.
    assert release(store, stranger, ReleaseRequest(leases=[ReleaseItem(
        request_id=second.request_id, epoch=second.epoch)]), now, CONFIG).released == []
    assert row(store, first.request_id)["status"] == "leased"
    assert row(store, second.request_id)["status"] == "leased"
    # A finished request is not released.
    assert complete(store, mine, success(first.request_id, first.epoch), now,
                    CONFIG).accepted == [first.request_id]
    assert release(store, mine, ReleaseRequest(leases=[ReleaseItem(
        request_id=first.request_id, epoch=first.epoch)]), now, CONFIG).rejected == \
        [first.request_id]
    assert row(store, first.request_id)["status"] == "succeeded"


def test_a_release_after_expiry_still_keeps_the_newer_checkpoint(store: Store) -> None:
    owner, mine = tenant(store), site(store, "a")
    now = time.time()
    batch(store, owner, [chat_line("one")], now=now)
    held = lease(store, mine, ask(), now, CONFIG).leases[0]
    heartbeat(store, mine, HeartbeatRequest(leases=[HeartbeatItem(
        request_id=held.request_id, epoch=held.epoch, checkpoint=progress(2))]), now, CONFIG)
    assert reap_expired(store, now + CONFIG.lease_ttl_s + 1) == 1
    answer = release(store, mine, ReleaseRequest(leases=[ReleaseItem(
        request_id=held.request_id, epoch=held.epoch, checkpoint=progress(5))]),
        now + CONFIG.lease_ttl_s + 2, CONFIG)
    assert answer.released == [held.request_id]
    after = row(store, held.request_id)
    assert after["status"] == "queued"
    assert stored_tokens(store, held.request_id) == [0, 1, 2, 3, 4]
    assert after["checkpoint_tokens"] == 5


def test_heartbeats_name_what_to_hand_back_ahead_of_an_outage(store: Store) -> None:
    owner, busy, helper = tenant(store), site(store, "busy"), site(store, "helper")
    now = time.time()
    lines = [chat_line(f"long-{i}", max_tokens=4000) for i in range(3)] + [
        chat_line("short", max_tokens=8)]
    batch(store, owner, lines, now=now)
    held = lease(store, busy, ask(capacity=8), now, CONFIG).leases
    assert len(held) == 4
    beat = HeartbeatRequest(leases=[HeartbeatItem(request_id=g.request_id, epoch=g.epoch)
                                    for g in held], tokens_per_s=100.0)
    assert heartbeat(store, busy, beat, now + 1, CONFIG).handback == []
    # An outage in 60 s: at 25 tokens/s per request, 4000 tokens would not finish; 8 would.
    add_outage(store, "busy", now + 60, now + 600)
    assert heartbeat(store, busy, beat, now + 2, CONFIG).handback == []  # nobody has room
    lease(store, helper, ask(capacity=2), now + 2, CONFIG)  # says it has room for two
    named = heartbeat(store, busy, beat, now + 3, CONFIG).handback
    longs = {g.request_id for g in held if g.body["max_tokens"] == 4000}
    assert len(named) == 2 and set(named) <= longs
    # At the handback time everything goes back, the short one too.
    lead = max(CONFIG.lease_ttl_s / 3 + 1, 5.0)
    assert sorted(heartbeat(store, busy, beat, now + 60 - lead, CONFIG).handback) == \
        sorted(g.request_id for g in held)


def test_outages_are_listed_and_withdrawn(store: Store) -> None:
    site(store, "solar")
    site(store, "wind")
    now = time.time()
    past = add_outage(store, "solar", now - 600, now - 60)
    soon = add_outage(store, "solar", now + 60, now + 600)
    later = add_outage(store, "wind", now + 3600, now + 7200)
    assert [o.id for o in list_outages(store, now)] == [soon, later]
    assert [o.id for o in list_outages(store, now, "solar", include_past=True)] == [past, soon]
    assert list_outages(store, now, "wind")[0].site == "wind"
    with pytest.raises(NotFoundError):
        list_outages(store, now, "nowhere")
    with pytest.raises(NotFoundError):
        remove_outage(store, later, "solar")  # not solar's
    assert remove_outage(store, soon).site == "solar"
    assert [o.id for o in list_outages(store, now)] == [later]
    status = {s.name: s for s in list_sites(store, now)}
    assert status["solar"].outages == [] and status["solar"].status != "draining"
    with pytest.raises(NotFoundError):
        remove_outage(store, soon)
