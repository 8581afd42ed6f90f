"""Site health on a real store: uptime, lost work, busy throughput, what workers said, and
placement between sites through real lease calls (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from control_factory import CONFIG, MODEL, ask, batch, chat_line, site, success, tenant
from sqlalchemy import select

from minimill.control.leases import complete, heartbeat, lease, reap_expired
from minimill.control.site_view import list_sites, site_states
from minimill.control.sites import add_outage, touch_site
from minimill.control.store import Store
from minimill.control.tables import sites
from minimill.transport.protocol import HeartbeatItem, HeartbeatRequest, LeaseRequest

T0 = 1_000_000.0
TTL = CONFIG.lease_ttl_s  # 10 s: contact gaps up to this count as up


def stored_rate(store: Store, name: str) -> float | None:
    with store.read() as conn:
        value: float | None = conn.execute(
            select(sites.c.tokens_per_s).where(sites.c.name == name)).scalar()
    return value


def test_uptime_counts_gaps_up_to_a_ttl_and_leaves_out_announced_outages(store: Store) -> None:
    s = site(store, "solar")
    with store.write() as conn:
        for t in (T0, T0 + 5, T0 + 10):  # 10 s up
            touch_site(conn, s.id, t, TTL)
    add_outage(store, "solar", T0 + 20, T0 + 120)
    with store.write() as conn:  # dark for the announced 100 s (and 20 s around it), then up
        for t in (T0 + 130, T0 + 140, T0 + 150):
            touch_site(conn, s.id, t, TTL)
    (status,) = list_sites(store, T0 + 150)
    # Span 150 s less the announced 100 s; up 10 + 20 s.
    assert status.uptime == pytest.approx(30 / 50)
    assert status.expected_loss == pytest.approx(1 - 30 / 50)
    # Silence is not judged while shorter than alive_within_s, then all of it counts as down.
    assert list_sites(store, T0 + 170)[0].uptime == pytest.approx(30 / 50)
    assert list_sites(store, T0 + 250)[0].uptime == pytest.approx(30 / 150)
    assert list_sites(store, T0 + 250)[0].status == "offline"


def test_lost_work_expired_leases_stale_completions_and_wasted_tokens(store: Store) -> None:
    owner, flaky, other = tenant(store), site(store, "flaky", 0.1), site(store, "other", 0.1)
    batch(store, owner, [chat_line(f"c{i}") for i in range(4)], now=T0)
    held = lease(store, flaky, ask(capacity=4), T0, CONFIG).leases
    assert len(held) == 4
    for t in (T0 + 5, T0 + 10):  # it keeps asking for work but its runs are lost
        lease(store, flaky, ask(capacity=0), t, CONFIG)
    assert reap_expired(store, T0 + TTL + 1) == 4
    again = lease(store, other, ask(capacity=4), T0 + TTL + 2, CONFIG).leases
    assert {g.request_id for g in again} == {h.request_id for h in held}
    late = complete(store, flaky, success(held[0].request_id, held[0].epoch, tokens=6),
                    T0 + TTL + 3, CONFIG)
    assert [r.reason for r in late.rejected] == ["stale_epoch"]
    stats = {s.name: s for s in list_sites(store, T0 + TTL + 3)}
    lost = stats["flaky"]
    assert (lost.leases_granted, lost.leases_expired, lost.stale_completions,
            lost.wasted_tokens) == (4, 4, 1, 6)
    # 4 expired of 4 granted, against a prior of 20 good leases.
    assert lost.expected_loss == pytest.approx(4 / 24)
    assert lost.effective_usd_per_mtok == pytest.approx(lost.usd_per_mtok / (1 - 4 / 24))
    assert stats["other"].expected_loss == 0.0 and stats["other"].in_flight == 4


def test_stored_throughput_is_busy_throughput(store: Store) -> None:
    owner, s = tenant(store), site(store, "mill")
    batch(store, owner, [chat_line(f"c{i}") for i in range(3)], now=T0)
    # The first measurement is taken as it is, even from an idle worker.
    lease(store, s, LeaseRequest(capacity=0, models=[MODEL], tokens_per_s=40.0), T0, CONFIG)
    assert stored_rate(store, "mill") == 40.0
    # Idle (holds nothing): a low measurement says nothing about its speed.
    lease(store, s, LeaseRequest(capacity=0, models=[MODEL], tokens_per_s=5.0), T0 + 1, CONFIG)
    assert stored_rate(store, "mill") == 40.0
    # Busy with room to spare: measurements only raise it.
    held = lease(store, s, ask(capacity=8, tokens_per_s=3.0), T0 + 2, CONFIG).leases
    assert len(held) == 3
    beat = HeartbeatRequest(leases=[HeartbeatItem(request_id=h.request_id, epoch=h.epoch)
                                    for h in held], tokens_per_s=30.0)
    heartbeat(store, s, beat, T0 + 3, CONFIG)
    assert stored_rate(store, "mill") == 40.0
    heartbeat(store, s, beat.model_copy(update={"tokens_per_s": 90.0}), T0 + 4, CONFIG)
    assert stored_rate(store, "mill") == 90.0
    # Full (its last lease call left no free capacity): the rate follows, down as well as up.
    lease(store, s, ask(capacity=0, tokens_per_s=90.0), T0 + 5, CONFIG)
    heartbeat(store, s, beat.model_copy(update={"tokens_per_s": 50.0}), T0 + 6, CONFIG)
    assert stored_rate(store, "mill") == pytest.approx(70.0)
    for bad in (float("nan"), float("inf"), 0.2):
        heartbeat(store, s, beat.model_copy(update={"tokens_per_s": bad}), T0 + 7, CONFIG)
    assert stored_rate(store, "mill") == pytest.approx(70.0)


def test_lease_calls_record_what_the_worker_said(store: Store) -> None:
    owner, s = tenant(store), site(store, "mill")
    batch(store, owner, [chat_line(f"c{i}") for i in range(3)], now=T0)
    assert len(lease(store, s, ask(capacity=8), T0 + 1, CONFIG).leases) == 3
    with store.read() as conn:
        state = site_states(conn)[s.id]
    assert (state.free_capacity, state.capacity_at, state.models, state.in_flight) == (
        5, T0 + 1, frozenset({MODEL}), 3)
    (status,) = list_sites(store, T0 + 1)
    assert (status.free_capacity, status.in_flight, status.status) == (5, 3, "online")


def test_dear_site_gets_background_only_beyond_the_cheap_sites_room(store: Store) -> None:
    owner = tenant(store)
    cheap, dear = site(store, "cheap", 0.05), site(store, "dear", 0.50)
    idle = LeaseRequest(capacity=6, models=[MODEL], tokens_per_s=100.0)
    lease(store, cheap, idle, T0, CONFIG)  # cheap reports 6 free slots (nothing queued yet)
    lease(store, dear, idle, T0, CONFIG)
    batch(store, owner, [chat_line(f"c{i}") for i in range(8)], now=T0)
    got = lease(store, dear, idle, T0 + 0.5, CONFIG).leases
    assert len(got) == 2  # the 2 lines beyond the cheap site's 6 free slots
    assert len(lease(store, cheap, idle, T0 + 0.6, CONFIG).leases) == 6
    # The cheap site's report goes stale (its worker stopped asking): the dear one takes all.
    lease(store, cheap, LeaseRequest(capacity=3, models=[MODEL]), T0 + 1, CONFIG)  # 3 free
    batch(store, owner, [chat_line(f"d{i}") for i in range(3)], now=T0)
    assert lease(store, dear, idle, T0 + 1.5, CONFIG).leases == []
    assert len(lease(store, dear, idle, T0 + 10, CONFIG).leases) == 3


def test_outage_announced_for_the_cheap_site_moves_work_before_it_starts(store: Store) -> None:
    owner = tenant(store)
    cheap, dear = site(store, "cheap", 0.05), site(store, "dear", 0.50)
    idle = LeaseRequest(capacity=8, models=[MODEL], tokens_per_s=100.0)
    lease(store, cheap, idle, T0, CONFIG)
    add_outage(store, "cheap", T0 + 30, T0 + 600)
    # 8-token lines fit (4 s at the assumed 2 tokens/s); 100-token lines (50 s) do not.
    batch(store, owner, [chat_line(f"short{i}") for i in range(2)], now=T0)
    batch(store, owner, [chat_line(f"long{i}", max_tokens=100) for i in range(3)], now=T0 + 1)
    assert list_sites(store, T0 + 1)[0].status == "draining"
    to_dear = lease(store, dear, idle, T0 + 1, CONFIG).leases
    assert sorted(g.body["max_tokens"] for g in to_dear) == [100, 100, 100]
    to_cheap = lease(store, cheap, idle, T0 + 1, CONFIG).leases
    assert sorted(g.body["max_tokens"] for g in to_cheap) == [8, 8]
    states = {s.name: s.status for s in list_sites(store, T0 + 31)}
    assert states["cheap"] == "outage"


def test_sites_list_command_shows_draining_and_effective_cost(store_url: str,
                                                              store: Store) -> None:
    s = site(store, "windy", 0.05)
    now = time.time()
    with store.write() as conn:
        touch_site(conn, s.id, now, TTL, tokens_per_s=100.0)
    add_outage(store, "windy", now + 60, now + 3600)
    run = [sys.executable, "-m", "minimill.cli", "sites", "list", "--db", store_url]
    listed = subprocess.run([*run, "--json"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert (row["status"], row["expected_loss"]) == ("draining", 0.0)
    assert row["effective_usd_per_mtok"] == pytest.approx(0.05 / 3600 / 100 * 1e6)
    table = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and "draining" in table.stdout and "windy" in table.stdout


def test_the_view_reads_each_sites_own_models_sessions_and_schedule(store: Store) -> None:
    """The view of the fleet parses each distinct model list and price schedule once and shares
    the result: every site still gets its own values, null ones included, and list_sites
    agrees with it."""
    from minimill.control.price_schedule import PriceSchedule
    from minimill.control.sites import set_price_schedule

    now = time.time()
    a, b, c = site(store, "a"), site(store, "b"), site(store, "c")
    with store.write() as conn:
        touch_site(conn, a.id, now, 30.0, models=["m", "x"], held_sessions=["s1"])
        touch_site(conn, b.id, now, 30.0, models=["m"], held_sessions=[])
        touch_site(conn, c.id, now, 30.0, models=["x", "m"])
    schedule = PriceSchedule(start_at=0.0, hourly_usd=(1.0, 2.0))
    set_price_schedule(store, "b", schedule)
    with store.read() as conn:
        states = site_states(conn)
    assert states[a.id].models == frozenset({"m", "x"}) == states[c.id].models
    assert states[b.id].models == frozenset({"m"})
    assert states[a.id].sessions == frozenset({"s1"})
    assert states[b.id].sessions == frozenset() == states[c.id].sessions
    assert states[b.id].price_schedule == schedule
    assert states[a.id].price_schedule is None and states[c.id].price_schedule is None
    listed = {s.name: s for s in list_sites(store, now)}
    assert listed["b"].price_now == schedule.price_at(now)
    assert listed["a"].price_now == listed["a"].price_per_hour == a.price_per_hour
