"""Cost (metering) and price (prices): two figures, each from one formula."""

from __future__ import annotations

import pytest

from minimill.control import metering
from minimill.control.prices import DEFAULT_PRICE, Price, PriceList, billed_usd
from minimill.control.records import Tier


def test_placement_view_follows_price_and_reported_rate() -> None:
    assert metering.usd_per_mtok(0.36, 100.0) == pytest.approx(1.0)
    assert metering.usd_per_mtok(0.72, 100.0) == pytest.approx(2.0)
    assert metering.usd_per_mtok(0.36, 200.0) == pytest.approx(0.5)
    # Unknown or noise rates fall back to the default.
    for rate in (None, 0.0, 0.5):
        assert metering.usd_per_mtok(0.36, rate) == pytest.approx(
            0.36 / 3600 / metering.DEFAULT_TOKENS_PER_S * 1e6)


def test_measured_rate_and_cost_need_held_time_and_delivered_tokens() -> None:
    assert metering.measured_tokens_per_s(20.0, 10.0) == pytest.approx(2.0)
    assert metering.measured_tokens_per_s(20.0, 0.5) is None  # too little held time
    assert metering.measured_tokens_per_s(0.0, 30.0) is None  # nothing finished yet
    # A slow site's tokens are dear: no floor hides it.
    assert metering.cost_usd_per_mtok(0.36, 0.5) == pytest.approx(0.36 / 3600 / 0.5 * 1e6)
    assert metering.cost_usd_per_mtok(0.36, None) is None


def test_a_bill_counts_input_cached_input_and_output() -> None:
    price = Price(input_usd_per_mtok=1.0, cached_input_usd_per_mtok=0.25,
                  output_usd_per_mtok=4.0)
    assert billed_usd(price, 1000, 500) == pytest.approx((1000 * 1.0 + 500 * 4.0) / 1e6)
    assert billed_usd(price, 1000, 500, cached_tokens=800) == pytest.approx(
        (200 * 1.0 + 800 * 0.25 + 500 * 4.0) / 1e6)
    # Cached tokens are a part of the prompt, never more.
    assert billed_usd(price, 10, 0, cached_tokens=50) == pytest.approx(10 * 0.25 / 1e6)


def test_lookup_goes_from_the_model_to_the_default_entry_to_the_built_in_price() -> None:
    big = Price(2.0, 1.0, 8.0)
    big_batch = Price(0.5, 0.5, 1.0)
    default = Price(0.2, 0.2, 0.6)
    prices = PriceList({("big", Tier.REALTIME): big, ("big", Tier.BACKGROUND): big_batch,
                        ("mid", Tier.REALTIME): Price(1.0, 1.0, 3.0),
                        ("*", Tier.REALTIME): default})
    assert prices.quote("big", Tier.BACKGROUND, 0.5).price == big_batch  # set explicitly
    mid = prices.quote("mid", Tier.BACKGROUND, 0.5)
    assert (mid.price, mid.entry, mid.discounted) == (Price(0.5, 0.5, 1.5), "mid", True)
    assert prices.lookup("other", "realtime", 0.5) == default
    assert prices.lookup("other", "background", 0.25) == Price(0.05, 0.05, 0.15)
    empty = PriceList({})
    assert empty.quote("any", Tier.REALTIME, 0.5).source == "built-in"
    assert prices.quote("other", Tier.BACKGROUND, 0.5).source == "*"
    assert empty.lookup("any", Tier.BACKGROUND, 0.5) == DEFAULT_PRICE.scaled(0.5)
    table = [(q.model, q.tier.value, q.entry, q.discounted)
             for q in prices.table(0.5, models=["new"])]
    assert table[:2] == [("*", "realtime", "*", False), ("*", "background", "*", True)]
    assert ("new", "realtime", "*", False) in table
    assert ("big", "background", "big", False) in table
