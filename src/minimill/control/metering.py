"""Cost: what tokens cost the factory, per site. (What tenants pay is prices.py; never mixed.)

A site's cost per output token is its price per hour over its throughput:
`price_per_hour / (3600 * tokens_per_s)`; prompt tokens are paid for through that rate (its
throughput counts the prefills it did) rather than costed twice. Two throughputs exist:

- the *measured* one, which the control plane takes from what it saw itself: output tokens of
  accepted completions over the seconds the site held at least one lease, over a window of its
  recent held time (sites.touch_site keeps the sums). Cost and margin are computed from it, so
  a worker that reports a false rate cannot change them;
- the rate the worker *reports*: placement's prior for ranking sites (site_health), which works
  before a site has held any work. It never reaches a bill or a cost.
"""

from __future__ import annotations

# Assumed until a site's worker reports a rate (a small CPU site's order of magnitude).
DEFAULT_TOKENS_PER_S = 50.0
# Below this, a reported rate is noise (an idle site), not a rate to rank by.
MIN_TOKENS_PER_S = 1.0
# The measured throughput covers about this many seconds of the site's recent held time:
# older seconds and their tokens weigh less and less (sites.touch_site decays both sums).
METER_WINDOW_S = 3600.0
# Less held time than this is too little to measure a throughput from.
MIN_MEASURED_BUSY_S = 1.0


def effective_tokens_per_s(tokens_per_s: float | None) -> float:
    """A reported rate placement can rank by: the default when unknown or noise."""
    if tokens_per_s is None or tokens_per_s < MIN_TOKENS_PER_S:
        return DEFAULT_TOKENS_PER_S
    return tokens_per_s


def _usd_per_mtok(price_per_hour: float, tokens_per_s: float) -> float:
    return price_per_hour / 3600.0 / tokens_per_s * 1e6


def usd_per_mtok(price_per_hour: float, tokens_per_s: float | None) -> float:
    """$/Mtok at a reported rate (placement's view of a site)."""
    return _usd_per_mtok(price_per_hour, effective_tokens_per_s(tokens_per_s))


def effective_usd_per_mtok(price_per_hour: float, tokens_per_s: float | None,
                           loss_fraction: float) -> float:
    """$/Mtok counting expected lost work: a site that loses a fraction of what it runs pays
    for that fraction and the work is done again elsewhere, so each kept token costs more."""
    kept = min(max(1.0 - loss_fraction, 1e-6), 1.0)
    return usd_per_mtok(price_per_hour, tokens_per_s) / kept


def measured_tokens_per_s(window_tokens: float, window_busy_s: float) -> float | None:
    """Accepted output tokens per held second (None: the site has held too little work, or
    none of it is finished yet: tokens count when their completion is accepted)."""
    if window_busy_s < MIN_MEASURED_BUSY_S or window_tokens <= 0:
        return None
    return window_tokens / window_busy_s


def cost_usd_per_mtok(price_per_hour: float, measured: float | None) -> float | None:
    """What a million output tokens cost the factory at this site, at its measured rate
    (None: not measured yet)."""
    return None if measured is None else _usd_per_mtok(price_per_hour, measured)
