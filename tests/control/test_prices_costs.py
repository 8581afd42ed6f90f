"""Price and cost on a real store (SQLite and PostgreSQL): tenants are billed from the operator's
price list whatever a site declares, and a site's throughput and cost are what the control
plane measured. Also the `prices` and `keys --operator` commands as real processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from control_factory import (
    CONFIG,
    MODEL,
    batch,
    chat_line,
    chat_prompt_tokens,
    site,
    success,
    tenant,
)

from minimill.control.bodies import ChatBody, prepare_body
from minimill.control.errors import InvalidRequestError, NotFoundError
from minimill.control.keys import authenticate, authenticate_operator
from minimill.control.leases import complete, heartbeat, lease
from minimill.control.price_schedule import PriceSchedule
from minimill.control.prices import delete_price, read_price_list, set_price
from minimill.control.records import Kind, RequestStatus, Site, Tier
from minimill.control.requests import get_request, submit
from minimill.control.site_view import list_sites
from minimill.control.sites import set_price_schedule, touch_site
from minimill.control.store import Store
from minimill.transport.protocol import HeartbeatItem, HeartbeatRequest, LeaseRequest

T0 = 1_000_000.0
# The price list of these tests, $ per million tokens.
INPUT, OUTPUT = 1.0, 4.0
# Every request here asks "hi": the prompt the control plane bills (whatever the site reports:
# control_factory.success says 3), and `tokens` output tokens.
PROMPT_TOKENS = chat_prompt_tokens("hi")


def realtime(store: Store, owner_id: str, content: str, now: float) -> str:
    parsed = ChatBody.model_validate({"model": MODEL, "max_tokens": 16,
                                      "messages": [{"role": "user", "content": content}]})
    return submit(store, owner_id, prepare_body(Kind.CHAT, parsed, [MODEL]), now, CONFIG)


def serve(store: Store, who: Site, ask: LeaseRequest, start: float, tokens: int) -> list[str]:
    """Lease what `who` gets at `start`, heartbeat at +5 s, complete everything at +10 s."""
    held = lease(store, who, ask, start, CONFIG).leases
    beat = heartbeat(store, who, HeartbeatRequest(leases=[
        HeartbeatItem(request_id=h.request_id, epoch=h.epoch) for h in held]), start + 5,
        CONFIG)
    assert not beat.revoked
    for h in held:
        assert complete(store, who, success(h.request_id, h.epoch, tokens=tokens), start + 10,
                        CONFIG).accepted == [h.request_id]
    return [h.request_id for h in held]


def test_a_lying_site_changes_no_bill_and_its_throughput_is_measured(store: Store) -> None:
    owner = tenant(store)
    set_price(store, MODEL, Tier.REALTIME, INPUT, OUTPUT)
    liar, honest = site(store, "liar", 0.36), site(store, "honest", 0.36)
    # 4 requests each, held 10 s, 5 output tokens each: 20 tokens in 10 s is 2 tokens/s.
    for _ in range(4):
        realtime(store, owner.id, "hi", T0)
    lied = LeaseRequest(capacity=4, models=[MODEL], tokens_per_s=1e9, price_per_hour=1e6)
    by_liar = serve(store, liar, lied, T0, tokens=5)
    for _ in range(4):
        realtime(store, owner.id, "hi", T0 + 10)
    by_honest = serve(store, honest, LeaseRequest(capacity=4, models=[MODEL],
                                                  tokens_per_s=2.0), T0 + 10, tokens=5)
    assert len(by_liar) == len(by_honest) == 4
    expected_bill = (PROMPT_TOKENS * INPUT + 5 * OUTPUT) / 1e6
    for rid in by_liar + by_honest:
        done = get_request(store, owner.id, rid)
        assert done.status == RequestStatus.SUCCEEDED
        assert done.billed_usd == pytest.approx(expected_bill)
    stats = {s.name: s for s in list_sites(store, T0 + 20)}
    lying, fair = stats["liar"], stats["honest"]
    # What it said is recorded (placement's prior) but measured is what it did.
    assert (lying.tokens_per_s, lying.price_per_hour) == (1e9, 1e6)
    assert lying.measured_tokens_per_s == pytest.approx(2.0, rel=1e-2)
    assert fair.measured_tokens_per_s == pytest.approx(2.0, rel=1e-2)
    assert lying.busy_s == pytest.approx(10.0) and fair.busy_s == pytest.approx(10.0)
    # Its declared price is its cost (what the factory pays it), never the tenant's.
    assert lying.cost_usd == pytest.approx(1e6 * 10 / 3600)
    assert fair.cost_usd == pytest.approx(0.36 * 10 / 3600)
    assert fair.cost_usd_per_mtok == pytest.approx(0.36 / 3600 / 2.0 * 1e6, rel=1e-2)
    for status in (lying, fair):
        assert status.billed_usd == pytest.approx(4 * expected_bill)
        assert status.margin_usd == pytest.approx(status.billed_usd - status.cost_usd)


def test_held_time_counts_once_however_many_leases(store: Store) -> None:
    owner, mill = tenant(store), site(store, "wide")
    for i in range(8):
        realtime(store, owner.id, f"r{i}", T0)
    done = serve(store, mill, LeaseRequest(capacity=8, models=[MODEL]), T0, tokens=10)
    assert len(done) == 8
    (status,) = list_sites(store, T0 + 10)
    # 80 tokens in the 10 s it held work: 8 tokens/s, not 1 per stream.
    assert status.busy_s == pytest.approx(10.0)
    assert status.measured_tokens_per_s == pytest.approx(8.0, rel=1e-2)


def test_measured_throughput_follows_recent_held_time(store: Store) -> None:
    mill = site(store, "changing")
    with store.write() as conn:
        touch_site(conn, mill.id, T0, 30.0, busy=False)
        t = T0
        for rate in (10, 100):  # an hour held at 10 tokens/s, then an hour at 100
            for _ in range(360):
                t += 10
                touch_site(conn, mill.id, t, 30.0, busy=True, accepted_tokens=10 * rate)
        # A gap longer than the lease TTL is no held time, and idle contact adds none.
        touch_site(conn, mill.id, t + 300, 30.0, busy=True)
        touch_site(conn, mill.id, t + 305, 30.0, busy=False)
    (status,) = list_sites(store, t + 305)
    assert status.busy_s == pytest.approx(7200.0)
    assert status.cost_usd == pytest.approx(0.36 * 2)
    assert status.tokens_per_s is None  # the worker reported nothing
    # The lifetime average is 55 tokens/s; the last hour weighs most.
    assert 70 < (status.measured_tokens_per_s or 0) < 100


def test_bills_follow_the_price_list_realtime_and_background(store: Store) -> None:
    owner, mill = tenant(store), site(store)
    set_price(store, MODEL, Tier.REALTIME, INPUT, OUTPUT)

    def bill_of_batch_line(at: float) -> float:
        batch(store, owner, [chat_line(f"c{at}")], now=at)
        (held,) = lease(store, mill, LeaseRequest(capacity=1, models=[MODEL]), at,
                        CONFIG).leases
        assert complete(store, mill, success(held.request_id, held.epoch, tokens=6), at + 1,
                        CONFIG).accepted
        return get_request(store, owner.id, held.request_id).billed_usd

    # Background with no background entry: realtime times the configured discount.
    full = (PROMPT_TOKENS * INPUT + 6 * OUTPUT) / 1e6
    assert bill_of_batch_line(T0) == pytest.approx(full * CONFIG.background_price_factor)
    set_price(store, MODEL, "background", 0.5, 1.0)
    assert bill_of_batch_line(T0 + 10) == pytest.approx((PROMPT_TOKENS * 0.5 + 6 * 1.0) / 1e6)
    delete_price(store, MODEL, "background")
    assert bill_of_batch_line(T0 + 20) == pytest.approx(full * CONFIG.background_price_factor)
    # A model without an entry is billed by the default entry.
    set_price(store, "*", "realtime", 10.0, 20.0)
    quoted = read_price_list(store).quote("unlisted", Tier.REALTIME, 0.5)
    assert (quoted.entry, quoted.price.output_usd_per_mtok) == ("*", 20.0)


def test_price_entries_are_checked(store: Store) -> None:
    for bad in ({"model": " "}, {"tier": "spot"}, {"input_usd_per_mtok": -1.0},
                {"output_usd_per_mtok": float("nan")}, {"input_usd_per_mtok": float("inf")},
                {"cached_input_usd_per_mtok": 2e6}):
        args = {"model": MODEL, "tier": "realtime", "input_usd_per_mtok": 1.0,
                "output_usd_per_mtok": 1.0, "cached_input_usd_per_mtok": None, **bad}
        with pytest.raises(InvalidRequestError):
            set_price(store, **args)
    with pytest.raises(NotFoundError):
        delete_price(store, MODEL, "realtime")
    set_price(store, MODEL, "realtime", 1.0, 2.0)
    set_price(store, MODEL, "realtime", 3.0, 4.0, cached_input_usd_per_mtok=0.5)
    entry = read_price_list(store).entries[(MODEL, Tier.REALTIME)]
    assert (entry.input_usd_per_mtok, entry.cached_input_usd_per_mtok,
            entry.output_usd_per_mtok) == (3.0, 0.5, 4.0)


def minimill(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "minimill.cli", *args], capture_output=True,
                          text=True, timeout=60)


def test_cli_prices_and_operator_keys(store_url: str, store: Store) -> None:
    made = minimill("prices", "set", MODEL, "--input", "0.2", "--output", "0.8", "--db",
                    store_url)
    assert made.returncode == 0, made.stderr
    assert "0.2" in made.stdout and "0.8" in made.stdout
    listed = json.loads(minimill("prices", "list", "--json", "--db", store_url).stdout)
    rows = {(r["model"], r["tier"]): r for r in listed}
    assert rows[(MODEL, "realtime")]["output_usd_per_mtok"] == 0.8
    assert rows[(MODEL, "background")]["output_usd_per_mtok"] == pytest.approx(0.4)
    assert rows[(MODEL, "background")]["discounted"] is True
    assert rows[("*", "realtime")]["entry"] is None  # the built-in price
    explicit = minimill("prices", "set", MODEL, "--tier", "background", "--input", "0.05",
                        "--output", "0.1", "--cached-input", "0.01", "--db", store_url)
    assert explicit.returncode == 0, explicit.stderr
    table = minimill("prices", "list", "--db", store_url)
    assert table.returncode == 0 and MODEL in table.stdout and "0.01" in table.stdout
    for bad, says in ((("set", MODEL, "--input", "-1", "--output", "1"), "input"),
                      (("set", MODEL, "--tier", "spot", "--input", "1", "--output", "1"),
                       "tier"),
                      (("delete", "never-set"), "no realtime price")):
        answer = minimill("prices", *bad, "--db", store_url)
        assert answer.returncode != 0 and says in answer.stderr, answer.stderr
        assert "Traceback" not in answer.stderr
    assert minimill("prices", "delete", MODEL, "--tier", "background", "--db",
                    store_url).returncode == 0
    assert (MODEL, Tier.BACKGROUND) not in read_price_list(store).entries

    operator = minimill("keys", "create", "--operator", "--db", store_url)
    assert operator.returncode == 0, operator.stderr
    key = operator.stdout.strip()
    assert authenticate_operator(store, key) is not None and authenticate(store, key) is None
    both = minimill("keys", "create", "--operator", "--tenant", "x", "--db", store_url)
    neither = minimill("keys", "create", "--db", store_url)
    for answer in (both, neither):
        assert answer.returncode != 0 and "--tenant NAME or --operator" in answer.stderr


def test_held_time_costs_the_scheduled_price_of_its_hour(store: Store) -> None:
    owner = tenant(store)
    scheduled = site(store, "scheduled", 0.36)
    # $9/h in the hour that holds T0..T0+10, $0.36 elsewhere.
    hourly = [0.36] * 24
    hourly[int(T0 // 3600) % 24] = 9.0
    set_price_schedule(store, "scheduled", PriceSchedule(0.0, tuple(hourly)))
    assert int((T0 + 20) // 3600) == int(T0 // 3600)
    for i in range(2):
        realtime(store, owner.id, f"scheduled {i}", T0)
    serve(store, scheduled, LeaseRequest(capacity=2, models=[MODEL], tokens_per_s=2.0), T0,
          tokens=5)
    status = {s.name: s for s in list_sites(store, T0 + 20)}["scheduled"]
    assert status.cost_usd == pytest.approx(9.0 * 10 / 3600)
    assert status.price_now == 9.0 and status.price_per_hour == 0.36


def test_a_site_waits_for_its_cheap_hour_only_when_the_batch_still_fits_after_it(
        store: Store) -> None:
    """The lease call reads the backlog for a site whose price follows a schedule: two
    requests wait for the cheap hour 22.2 h ahead (1.8 h before their deadline); 600 of
    1,000 tokens each, at the site's rate, would not fit in those 1.8 h, so they start now."""
    owner = tenant(store)
    scheduled = site(store, "scheduled", 1.0)
    hourly = [1.0] * 24
    hourly[int((T0 + 23 * 3600) // 3600) % 24] = 0.2
    set_price_schedule(store, "scheduled", PriceSchedule(0.0, tuple(hourly)))
    ask = LeaseRequest(capacity=8, models=[MODEL], tokens_per_s=100.0)

    def lines(n: int, prefix: str) -> list[str]:
        return [chat_line(f"{prefix}{i}", max_tokens=1000) for i in range(n)]

    small = batch(store, owner, lines(2, "s"), now=T0)
    assert small.counts.total == 2
    assert lease(store, scheduled, ask, T0, CONFIG).leases == []
    batch(store, owner, lines(600, "b"), now=T0)
    assert len(lease(store, scheduled, ask, T0 + 1, CONFIG).leases) == 8
