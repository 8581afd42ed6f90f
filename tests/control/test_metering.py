"""Money: $/token from a site's price per hour and measured throughput."""

from __future__ import annotations

import pytest

from minimill.control import metering
from minimill.control.records import Tier


def test_price_per_token_follows_price_and_throughput() -> None:
    assert metering.usd_per_token(0.36, 100.0) == pytest.approx(1e-6)
    assert metering.usd_per_mtok(0.36, 100.0) == pytest.approx(1.0)
    assert metering.usd_per_token(0.72, 100.0) == pytest.approx(2e-6)
    assert metering.usd_per_token(0.36, 200.0) == pytest.approx(5e-7)


def test_unmeasured_sites_use_the_default_rate() -> None:
    expected = 0.36 / 3600 / metering.DEFAULT_TOKENS_PER_S
    for rate in (None, 0.0, 0.5):
        assert metering.usd_per_token(0.36, rate) == pytest.approx(expected)


def test_background_is_cheaper() -> None:
    realtime = metering.request_cost(10, 0.36, 100.0, Tier.REALTIME, 0.5)
    background = metering.request_cost(10, 0.36, 100.0, Tier.BACKGROUND, 0.5)
    assert realtime == pytest.approx(1e-5) and background == pytest.approx(realtime / 2)
