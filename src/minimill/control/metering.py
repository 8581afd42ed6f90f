"""Money: $/token per site from its price per hour and measured throughput; cost per request.

A site's measured rate is output tokens per second of wall time for the whole site, with every
prefill it did in that time included. So one site-hour buys `3600 * tokens_per_s` output tokens,
and an output token costs `price_per_hour / (3600 * tokens_per_s)`; prompt tokens are paid for
through that rate rather than priced twice. The rate is the site's busy throughput (what it
makes with work to do; sites.touch_site keeps it), so an idle hour does not raise the price.
Background work (batches, service_tier "flex") is charged `background_price_factor` of that,
since it fills capacity that would otherwise idle. Placement ranks sites by
`effective_usd_per_mtok`, which also counts the work a site is expected to lose.
"""

from __future__ import annotations

from minimill.control.records import Tier

# Assumed until a site's worker reports a measurement (a small CPU site's order of magnitude).
DEFAULT_TOKENS_PER_S = 50.0
# Below this, a measurement is noise (an idle site), not a rate to price by.
MIN_TOKENS_PER_S = 1.0


def effective_tokens_per_s(tokens_per_s: float | None) -> float:
    if tokens_per_s is None or tokens_per_s < MIN_TOKENS_PER_S:
        return DEFAULT_TOKENS_PER_S
    return tokens_per_s


def usd_per_token(price_per_hour: float, tokens_per_s: float | None) -> float:
    """What one output token costs at this site."""
    return price_per_hour / 3600.0 / effective_tokens_per_s(tokens_per_s)


def usd_per_mtok(price_per_hour: float, tokens_per_s: float | None) -> float:
    return usd_per_token(price_per_hour, tokens_per_s) * 1e6


def effective_usd_per_mtok(price_per_hour: float, tokens_per_s: float | None,
                           loss_fraction: float) -> float:
    """$/Mtok counting expected lost work: a site that loses a fraction of what it runs pays
    for that fraction and the work is done again elsewhere, so each kept token costs more."""
    kept = min(max(1.0 - loss_fraction, 1e-6), 1.0)
    return usd_per_mtok(price_per_hour, tokens_per_s) / kept


def tier_factor(tier: Tier | str, background_price_factor: float) -> float:
    return background_price_factor if tier == Tier.BACKGROUND else 1.0


def request_cost(completion_tokens: int, price_per_hour: float, tokens_per_s: float | None,
                 tier: Tier | str, background_price_factor: float) -> float:
    """Dollars charged for one request served at this site."""
    return (completion_tokens * usd_per_token(price_per_hour, tokens_per_s)
            * tier_factor(tier, background_price_factor))
