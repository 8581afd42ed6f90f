"""Attack: starve a neighbour by volume. A heavy tenant queues twenty times a light tenant's
work (a batch, then realtime calls) ahead of it; with one FIFO the light tenant would wait for
all of it. Over the real store (SQLite, PostgreSQL) and the control plane's own lease calls:
the light tenant's work is offered beside the heavy tenant's from the first lease call on and
finishes within a few rounds, every round keeps the site full, a weight gives a tenant its
share in proportion, and a light tenant's realtime call goes before the heavy tenant's next
one when the heavy tenant already holds the site's leases."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "control"))

from control_factory import CONFIG, MODEL, ask, batch, chat_line, site, success, tenant

from minimill.control.bodies import ChatBody, prepare_body
from minimill.control.leases import complete, lease
from minimill.control.records import Kind
from minimill.control.requests import submit
from minimill.control.store import Store, open_store
from minimill.control.tenant_limits import set_overrides

CAPACITY = 8


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    url = (f"sqlite:///{tmp_path / 'minimill.db'}" if request.param == "sqlite"
           else request.getfixturevalue("pg_url"))
    s = open_store(url)
    request.addfinalizer(s.close)
    return s


def run_round(store: Store, the_site: object, owner_of: dict[str, str]) -> list[str]:
    """One lease call of a full site's worth, each lease completed: whose work it got."""
    granted = lease(store, the_site, ask(capacity=CAPACITY), time.time(), CONFIG)  # type: ignore[arg-type]
    for item in granted.leases:
        assert complete(store, the_site, success(item.request_id, item.epoch),  # type: ignore[arg-type]
                        time.time(), CONFIG).accepted == [item.request_id]
    return [owner_of[item.request_id] for item in granted.leases]


def owners(store: Store, names: dict[str, str]) -> dict[str, str]:
    from sqlalchemy import select

    from minimill.control.tables import requests
    with store.read() as conn:
        rows = conn.execute(select(requests.c.id, requests.c.tenant_id)).all()
    return {r.id: names[r.tenant_id] for r in rows}


def test_a_light_batch_queued_behind_a_heavy_one_finishes_within_a_few_rounds(
        store: Store) -> None:
    heavy, light = tenant(store, "heavy"), tenant(store, "light")
    batch(store, heavy, [chat_line(f"h{i}") for i in range(200)])
    batch(store, light, [chat_line(f"l{i}") for i in range(10)])
    owner_of = owners(store, {heavy.id: "heavy", light.id: "light"})
    the_site = site(store)
    rounds: list[list[str]] = []
    while sum(r.count("light") for r in rounds) < 10:
        rounds.append(run_round(store, the_site, owner_of))
        assert len(rounds) <= 3, f"the light tenant waited: {rounds}"
    # The site was full every round: the heavy tenant took whatever the light one left.
    assert all(len(r) == CAPACITY for r in rounds)
    assert rounds[0].count("light") == CAPACITY // 2  # an equal share from the first call


def test_a_weight_gives_a_tenant_its_share_in_proportion(store: Store) -> None:
    big, small = tenant(store, "big"), tenant(store, "small")
    set_overrides(store, "big", {"weight": 3.0}, [], CONFIG.tenant_limits)
    batch(store, big, [chat_line(f"b{i}") for i in range(40)])
    batch(store, small, [chat_line(f"s{i}") for i in range(40)])
    owner_of = owners(store, {big.id: "big", small.id: "small"})
    got = run_round(store, site(store), owner_of)
    assert got.count("big") == 6 and got.count("small") == 2


def test_a_light_realtime_call_goes_before_the_heavy_tenants_next_one(store: Store) -> None:
    heavy, light = tenant(store, "heavy-rt"), tenant(store, "light-rt")

    def call(owner_id: str) -> str:
        body = ChatBody.model_validate({"model": MODEL, "max_tokens": 16,
                                        "messages": [{"role": "user", "content": "hi"}]})
        return submit(store, owner_id, prepare_body(Kind.CHAT, body, [MODEL]), time.time(),
                      CONFIG)

    heavy_ids = [call(heavy.id) for _ in range(40)]
    busy = site(store, "busy")
    held = lease(store, busy, ask(capacity=CAPACITY), time.time(), CONFIG)
    assert [i.request_id for i in held.leases] == heavy_ids[:CAPACITY]  # FIFO, one tenant
    light_id = call(light.id)  # queued behind 32 more of the heavy tenant's
    other = site(store, "other")
    got = lease(store, other, ask(capacity=1), time.time(), CONFIG)
    assert [i.request_id for i in got.leases] == [light_id]
    # And the heavy tenant takes the rest of the room: nothing idles for fairness.
    more = lease(store, other, ask(capacity=4), time.time(), CONFIG)
    assert [i.request_id for i in more.leases] == heavy_ids[CAPACITY:CAPACITY + 4]
