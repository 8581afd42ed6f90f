"""The UPDATE that records a site's contact (sites.touch_site), built once per shape.

Every lease, heartbeat, completion and release call writes its site's row with a dozen
expressions (up time, held time and its cost, the decaying throughput window, the reported
rate): built afresh, with its literals, at every call, the statement cost more CPU than the
database's own work. Here each shape (busy or not, a rate or not, which columns are set and
which counters added) is built once, with bound parameters for every value.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Float, Update, bindparam, case, func, update

from minimill.control import metering
from minimill.control.tables import sites

# A full site's stored throughput moves this fraction of the way to each new measurement.
RATE_SMOOTHING = 0.5


@functools.lru_cache(maxsize=256)
def contact_update(busy: bool, price_given: bool, rate_given: bool, tokens_given: bool,
                   set_columns: tuple[str, ...], added_columns: tuple[str, ...]) -> Update:
    """The UPDATE of one shape. Parameters: site_id, now, grace, window, price (when
    `price_given`; else the row's price_per_hour), accepted, rate, smoothing, s_<column> for
    each set column, a_<column> for each added counter."""
    now = bindparam("now", type_=Float())
    gap = now - sites.c.last_seen_at
    up_gap = case(((sites.c.last_seen_at.is_not(None)) & (gap > 0)
                   & (gap <= bindparam("grace", type_=Float())), gap), else_=0.0)
    values: dict[str, Any] = {"last_seen_at": now,
                              "first_seen_at": func.coalesce(sites.c.first_seen_at, now),
                              "up_s": sites.c.up_s + up_gap}
    accepted = bindparam("accepted", type_=Float())
    if busy:
        window = bindparam("window", type_=Float())
        keep = window / (window + up_gap)
        price = bindparam("price", type_=Float()) if price_given else sites.c.price_per_hour
        values.update(busy_s=sites.c.busy_s + up_gap,
                      cost_usd=sites.c.cost_usd + price * up_gap / 3600.0,
                      window_busy_s=sites.c.window_busy_s * keep + up_gap,
                      window_tokens=sites.c.window_tokens * keep + accepted)
    elif tokens_given:
        values["window_tokens"] = sites.c.window_tokens + accepted
    if rate_given:
        rate, old = bindparam("rate", type_=Float()), sites.c.tokens_per_s
        if busy:
            values["tokens_per_s"] = case(
                (old.is_(None), rate),
                (sites.c.free_capacity <= 0,
                 old + bindparam("smoothing", type_=Float()) * (rate - old)),
                (old < rate, rate),
                else_=old)
        else:
            values["tokens_per_s"] = func.coalesce(old, rate)
    for name in set_columns:
        values[name] = bindparam(f"s_{name}", type_=sites.c[name].type)
    for name in added_columns:
        values[name] = sites.c[name] + bindparam(f"a_{name}", type_=sites.c[name].type)
    return update(sites).where(sites.c.id == bindparam("site_id")).values(**values)


def contact_params(site_id: str, now: float, up_grace_s: float, price: float | None,
                   accepted_tokens: int, tokens_per_s: float | None,
                   set_values: Mapping[str, Any], added: Mapping[str, float]
                   ) -> dict[str, Any]:
    """The parameters of `contact_update` for one call."""
    params: dict[str, Any] = {"site_id": site_id, "now": now, "grace": up_grace_s,
                              "window": metering.METER_WINDOW_S, "accepted": accepted_tokens,
                              "rate": tokens_per_s, "smoothing": RATE_SMOOTHING}
    if price is not None:
        params["price"] = price
    params.update({f"s_{k}": v for k, v in set_values.items()})
    params.update({f"a_{k}": v for k, v in added.items()})
    return params
