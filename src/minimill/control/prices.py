"""Price: what a tenant is billed. The operator's price list, and the one formula of a bill.

The list holds $ per million tokens (input, cached input, output) per model and tier; the
model `*` is the default entry for models not listed. Only operators set it (`minimill prices
set`, the operator API); nothing a site says reaches it. A request's price is looked up at its
completion, most specific first:

1. the entry for its model and tier;
2. for background work, the model's realtime entry times the configured background discount
   (`ControlConfig.background_price_factor`);
3. the same two steps for the default entry `*`;
4. the built-in DEFAULT_PRICE (with the discount for background work).

What the tokens cost the factory is metering.py, and it never changes a bill.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from minimill.control.errors import InvalidRequestError, NotFoundError
from minimill.control.records import Tier
from minimill.control.store import Store
from minimill.control.tables import prices

DEFAULT_ENTRY = "*"
# Above this a price is a typo (a dollar per token is already absurd for these models).
MAX_USD_PER_MTOK = 1e6
MAX_MODEL_CHARS = 200


@dataclass(frozen=True, slots=True)
class Price:
    """$ per million tokens of each kind."""

    input_usd_per_mtok: float
    cached_input_usd_per_mtok: float  # prompt tokens served from a reused prefix
    output_usd_per_mtok: float

    def scaled(self, factor: float) -> Price:
        return Price(self.input_usd_per_mtok * factor, self.cached_input_usd_per_mtok * factor,
                     self.output_usd_per_mtok * factor)


# Billed until the operator sets a price list: a small open model's order of magnitude.
DEFAULT_PRICE = Price(input_usd_per_mtok=0.10, cached_input_usd_per_mtok=0.10,
                      output_usd_per_mtok=0.40)


def billed_usd(price: Price, prompt_tokens: int, completion_tokens: int,
               cached_tokens: int = 0) -> float:
    """What a tenant is billed for one request: the only place a bill is computed."""
    cached = min(max(cached_tokens, 0), prompt_tokens)
    return ((prompt_tokens - cached) * price.input_usd_per_mtok
            + cached * price.cached_input_usd_per_mtok
            + completion_tokens * price.output_usd_per_mtok) / 1e6


@dataclass(frozen=True, slots=True)
class QuotedPrice:
    """The price a (model, tier) is billed at, and where it comes from."""

    model: str
    tier: Tier
    price: Price
    entry: str | None  # the entry it comes from: the model, DEFAULT_ENTRY, or None (built-in)
    discounted: bool  # a realtime price times the background discount

    @property
    def source(self) -> str:
        """The entry's model (or `built-in`); `discounted` tells whether the discount applies."""
        return self.entry or "built-in"


@dataclass(frozen=True, slots=True)
class PriceList:
    """The explicit entries, by (model, tier)."""

    entries: dict[tuple[str, Tier], Price]

    def quote(self, model: str, tier: Tier, background_factor: float) -> QuotedPrice:
        for name in (model, DEFAULT_ENTRY):
            found = self.entries.get((name, tier))
            if found is not None:
                return QuotedPrice(model, tier, found, name, discounted=False)
            realtime = self.entries.get((name, Tier.REALTIME))
            if realtime is not None:  # tier is background here
                return QuotedPrice(model, tier, realtime.scaled(background_factor), name,
                                   discounted=True)
        background = tier == Tier.BACKGROUND
        return QuotedPrice(model, tier,
                           DEFAULT_PRICE.scaled(background_factor if background else 1.0),
                           None, discounted=background)

    def lookup(self, model: str, tier: Tier | str, background_factor: float) -> Price:
        return self.quote(model, Tier(tier), background_factor).price

    def table(self, background_factor: float, models: Iterable[str] = ()) -> list[QuotedPrice]:
        """What the default entry, each listed model and each of `models` (e.g. those
        served) is billed at, in both tiers."""
        names = sorted({m for m, _ in self.entries} | {DEFAULT_ENTRY} | set(models),
                       key=lambda m: (m != DEFAULT_ENTRY, m))
        return [self.quote(m, tier, background_factor) for m in names for tier in Tier]


def load_price_list(conn: Connection) -> PriceList:
    return PriceList({(r.model, Tier(r.tier)): Price(r.input_usd_per_mtok,
                                                      r.cached_input_usd_per_mtok,
                                                      r.output_usd_per_mtok)
                      for r in conn.execute(select(prices))})


def read_price_list(store: Store) -> PriceList:
    with store.read() as conn:
        return load_price_list(conn)


def _model(name: str) -> str:
    name = name.strip()
    if not name or len(name) > MAX_MODEL_CHARS:
        raise InvalidRequestError(f"a model name must have 1 to {MAX_MODEL_CHARS} characters "
                                  f"({DEFAULT_ENTRY!r} is the default entry)", param="model")
    return name


def _tier(tier: Tier | str) -> Tier:
    try:
        return Tier(tier)
    except ValueError:
        raise InvalidRequestError(f"tier must be one of {', '.join(Tier)}, not {tier!r}",
                                  param="tier") from None


def _amount(value: float, param: str) -> float:
    if not (math.isfinite(value) and 0 <= value <= MAX_USD_PER_MTOK):
        raise InvalidRequestError(f"{param} must be a number of $ per million tokens in "
                                  f"[0, {MAX_USD_PER_MTOK:g}]", param=param)
    return float(value)


def set_price(store: Store, model: str, tier: Tier | str, input_usd_per_mtok: float,
              output_usd_per_mtok: float,
              cached_input_usd_per_mtok: float | None = None) -> QuotedPrice:
    """Create or replace one entry. Cached input costs as much as input unless given."""
    name, which = _model(model), _tier(tier)
    given = Price(
        _amount(input_usd_per_mtok, "input_usd_per_mtok"),
        _amount(input_usd_per_mtok if cached_input_usd_per_mtok is None
                else cached_input_usd_per_mtok, "cached_input_usd_per_mtok"),
        _amount(output_usd_per_mtok, "output_usd_per_mtok"))
    values: dict[str, Any] = {"input_usd_per_mtok": given.input_usd_per_mtok,
                              "cached_input_usd_per_mtok": given.cached_input_usd_per_mtok,
                              "output_usd_per_mtok": given.output_usd_per_mtok,
                              "updated_at": time.time()}
    key = (prices.c.model == name) & (prices.c.tier == which.value)
    for _ in range(2):
        try:
            with store.write() as conn:
                if conn.execute(update(prices).where(key).values(**values)).rowcount == 0:
                    conn.execute(insert(prices).values(model=name, tier=which.value, **values))
            break
        except IntegrityError:
            continue  # another operator inserted it first: the update wins next time
    return QuotedPrice(name, which, given, name, discounted=False)


def delete_price(store: Store, model: str, tier: Tier | str) -> None:
    """Remove one entry: the (model, tier) falls back to the next rule of the lookup."""
    name, which = _model(model), _tier(tier)
    with store.write() as conn:
        gone = conn.execute(delete(prices).where(prices.c.model == name,
                                                 prices.c.tier == which.value)).rowcount
    if not gone:
        raise NotFoundError(f"no {which.value} price set for {name!r}", param="model")

