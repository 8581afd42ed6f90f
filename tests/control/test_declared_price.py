"""A worker's declared price and chip (LeaseRequest.price_per_hour, .chip) reach the site
registry, metering and placement (SQLite and PostgreSQL)."""

from __future__ import annotations

import math

import pytest
from control_factory import (
    CONFIG,
    MODEL,
    ask,
    batch,
    chat_line,
    chat_prompt_tokens,
    site,
    success,
    tenant,
)
from pydantic import ValidationError
from sqlalchemy import select

from minimill.control.leases import complete, lease
from minimill.control.site_view import list_sites
from minimill.control.store import Store
from minimill.control.tables import requests
from minimill.transport.protocol import LeaseRequest

T0 = 1_000_000.0


def declaring(price: float | None, chip: str | None = None, capacity: int = 8) -> LeaseRequest:
    return LeaseRequest(capacity=capacity, models=[MODEL], tokens_per_s=100.0,
                        price_per_hour=price, chip=chip)


def test_a_declared_price_and_chip_replace_the_registered_ones(store: Store) -> None:
    owner, mill = tenant(store), site(store, "mill", 0.36)
    batch(store, owner, [chat_line("c0")], now=T0)
    (got,) = lease(store, mill, declaring(0.72, "h200"), T0, CONFIG).leases
    (status,) = list_sites(store, T0)
    # 0.72 $/hour at 100 tokens/s: 2 $ per million output tokens (0.36 would be 1 $).
    assert (status.price_per_hour, status.chip) == (0.72, "h200")
    assert status.usd_per_mtok == pytest.approx(2.0)
    # The declared price is what the site costs, never what the tenant pays: the bill is the
    # price list's (here the built-in price, 0.10 $/Mtok in and 0.40 out, at the discount).
    accepted = complete(store, mill, success(got.request_id, got.epoch, tokens=4), T0 + 1,
                        CONFIG).accepted
    assert accepted == [got.request_id]
    with store.read() as conn:
        billed = conn.execute(select(requests.c.billed_usd)
                              .where(requests.c.id == got.request_id)).scalar()
    assert billed == pytest.approx((chat_prompt_tokens("hi") * 0.10 + 4 * 0.40) / 1e6
                                   * CONFIG.background_price_factor)
    # The second it held the request cost 0.72 $/hour.
    (status,) = list_sites(store, T0 + 1)
    assert status.cost_usd == pytest.approx(0.72 / 3600)
    # A lease call that declares nothing (an older worker) keeps what was declared last.
    lease(store, mill, ask(), T0 + 2, CONFIG)
    (status,) = list_sites(store, T0 + 2)
    assert (status.price_per_hour, status.chip) == (0.72, "h200")


def test_a_declared_price_counts_in_the_same_calls_placement(store: Store) -> None:
    owner = tenant(store)
    cheap, dear = site(store, "cheap", 0.05), site(store, "dear", 0.50)
    idle = LeaseRequest(capacity=6, models=[MODEL], tokens_per_s=100.0)
    lease(store, cheap, idle, T0, CONFIG)  # cheap reports 6 free slots
    lease(store, dear, idle, T0, CONFIG)
    batch(store, owner, [chat_line(f"c{i}") for i in range(8)], now=T0)
    # At its registered 0.50 $/hour the dear site would get only the 2 lines beyond the cheap
    # site's room; declaring 0.01 makes it the cheapest site in this very call.
    assert len(lease(store, dear, declaring(0.01, capacity=6), T0 + 0.5, CONFIG).leases) == 6
    assert len(lease(store, cheap, idle, T0 + 0.6, CONFIG).leases) == 2
    prices = {s.name: s.price_per_hour for s in list_sites(store, T0 + 1)}
    assert prices == {"cheap": 0.05, "dear": 0.01}


@pytest.mark.parametrize(("price", "chip"), [
    (-0.01, None), (math.inf, None), (math.nan, None), (None, ""), (None, "   "),
    (None, "x" * 101)])
def test_a_lease_request_refuses_a_bad_price_or_chip(price: float | None,
                                                     chip: str | None) -> None:
    with pytest.raises(ValidationError):
        declaring(price, chip)


def test_a_lease_request_without_price_or_chip_is_still_valid() -> None:
    ask_ = LeaseRequest.model_validate_json('{"capacity": 2, "models": ["m"]}')
    assert (ask_.price_per_hour, ask_.chip) == (None, None)
    assert declaring(0.0, "x" * 100).price_per_hour == 0.0
