"""The process's view of the sites (control/site_view.PeerView) when lease calls may use one up
to `max_age_s` old: it is read again before a call's write transaction, never inside it, and
what this process's calls write while it is read is not lost."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
from control_factory import CONFIG, ask, batch, chat_line, site, tenant
from sqlalchemy import Connection

from minimill.control import site_view
from minimill.control.leases import lease
from minimill.control.placement import DEFAULT_POLICY, SiteState
from minimill.control.site_view import PeerView
from minimill.control.store import Store


def _record_reads(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every read of all the sites, as whether it ran inside a write transaction."""
    reads: list[bool] = []
    read_all = site_view.site_states

    def recording(conn: Connection) -> dict[str, SiteState]:
        reads.append(bool(conn.get_execution_options().get("minimill_write")))
        return read_all(conn)

    monkeypatch.setattr(site_view, "site_states", recording)
    return reads


def _viewed(store: Store, peers: PeerView, site_id: str, now: float) -> dict[str, SiteState]:
    with store.read() as conn:
        return peers.view(conn, site_id, now, DEFAULT_POLICY)[0]


def test_a_stale_view_is_read_again_before_the_lease_call_s_write_transaction(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    owner = tenant(store)
    left, right = site(store, "left"), site(store, "right")
    now = time.time()
    batch(store, owner, [chat_line(f"l{i}") for i in range(40)], now=now)
    reads = _record_reads(monkeypatch)
    peers = PeerView(0.5)

    assert len(lease(store, left, ask(capacity=4), now, CONFIG, peers=peers).leases) == 4
    assert reads == [False]  # read once, outside the call's write transaction
    assert len(lease(store, right, ask(capacity=4), now + 0.1, CONFIG, peers=peers).leases) == 4
    assert reads == [False]  # fresh enough: not read again
    late = site(store, "late")
    assert late.id not in _viewed(store, peers, left.id, now + 0.2)
    assert len(lease(store, left, ask(capacity=4), now + 1.0, CONFIG, peers=peers).leases) == 4
    assert reads == [False, False]  # stale: read again, outside the transaction again
    assert late.id in _viewed(store, peers, left.id, now + 1.0)


def test_what_a_call_writes_while_the_view_is_read_is_kept(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    left, right = site(store, "left"), site(store, "right")
    now = time.time()
    peers = PeerView(0.5)
    peers.refresh(store, now, DEFAULT_POLICY)
    before = _viewed(store, peers, left.id, now)[right.id]
    written = dataclasses.replace(before, in_flight=before.in_flight + 7, free_capacity=1)
    read_all = site_view.site_states

    def read_then_a_call_writes(conn: Connection) -> dict[str, Any]:
        rows = read_all(conn)  # the rows as they were when the read began
        peers.remember(written, now + 1.0)  # another call's lease, committed meanwhile
        return rows

    monkeypatch.setattr(site_view, "site_states", read_then_a_call_writes)
    peers.refresh(store, now + 1.0, DEFAULT_POLICY)
    viewed = _viewed(store, peers, left.id, now + 1.0)[right.id]
    assert (viewed.in_flight, viewed.free_capacity) == (written.in_flight, 1)
