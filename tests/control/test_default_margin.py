"""Defaults that make sense together: out of the box, serve's local site costs less per
million tokens than tenants are billed for them, so a new user's first dashboard shows no
negative margin."""

from __future__ import annotations

from minimill.cli_options import LOCAL_SITE_USD_PER_HOUR
from minimill.control.metering import cost_usd_per_mtok
from minimill.control.prices import DEFAULT_PRICE

# The default model's output rate on one CPU, one request at a time: about the slowest a
# first hour measures (batches and concurrent agents only raise it).
SLOW_LOCAL_TOKENS_PER_S = 20.0
BACKGROUND_FACTOR = 0.5  # Settings().background_price_factor's default


def test_the_local_sites_default_cost_is_below_the_default_price() -> None:
    cost = cost_usd_per_mtok(LOCAL_SITE_USD_PER_HOUR, SLOW_LOCAL_TOKENS_PER_S)
    assert cost is not None
    cheapest_billed = DEFAULT_PRICE.output_usd_per_mtok * BACKGROUND_FACTOR
    assert cost < cheapest_billed, (cost, cheapest_billed)


def test_the_background_factor_default_is_the_one_compared() -> None:
    from minimill.api.settings import Settings

    assert Settings().background_price_factor == BACKGROUND_FACTOR
