"""The site registry's read side: SiteState snapshots for placement, SiteStatus for operators.

Both come from the same rows (sites, their announced outages, the leases they hold), and every
derived number (uptime, expected loss, effective $/Mtok, status) comes from site_health, so
what `minimill sites list` shows is what placement decides with. SiteStatus adds what only
operators see: the throughput the control plane measured, what the site's tokens cost the
factory at it (metering), what tenants were billed for them, and the margin.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Select, Text, bindparam, cast, func, select

from minimill.control import metering, price_schedule, site_health
from minimill.control.peer_ranks import FleetRanks, RankIndex
from minimill.control.placement import DEFAULT_POLICY, Outage, PlacementPolicy, SiteState
from minimill.control.records import RequestStatus
from minimill.control.store import Store
from minimill.control.tables import outages, requests, sites

_LEASED = RequestStatus.LEASED.value


# What placement reads of a site, in this order (`_state` unpacks them by position): a
# thousand sites' rows are read several times a second, and reading each value of a row by
# name, and parsing its JSON columns one row at a time, cost more than the database's work.
# The JSON columns come as their text: most sites share one model list, parsed once.
_STATE_COLUMNS = (
    sites.c.id, sites.c.price_per_hour, sites.c.tokens_per_s, sites.c.last_seen_at,
    sites.c.free_capacity, sites.c.capacity_at, cast(sites.c.models, Text).label("models"),
    sites.c.first_seen_at, sites.c.up_s, sites.c.leases_granted, sites.c.leases_expired,
    sites.c.chip, cast(sites.c.price_schedule, Text).label("price_schedule"),
    cast(sites.c.held_sessions, Text).label("held_sessions"))
_STATE_NAMES = frozenset(c.name for c in _STATE_COLUMNS)
# Distinct model lists and price schedules are few in a fleet: each text is parsed once.
_PARSED_TEXTS = 1024


def _list(text: str | None) -> frozenset[str] | None:
    """A JSON list column's values (None: null, or not a list)."""
    data = None if text is None else json.loads(text)
    return frozenset(str(m) for m in data) if isinstance(data, list) else None


_models = functools.lru_cache(maxsize=_PARSED_TEXTS)(_list)


def _sessions(text: str | None) -> frozenset[str]:
    """The session tags a site holds: parsed row by row (they differ from site to site and
    change as it works, so a cache of them would hold much and hit little), the usual empty
    ones without parsing."""
    return frozenset() if text is None or text in ("[]", "null") else _list(text) or frozenset()


@functools.lru_cache(maxsize=_PARSED_TEXTS)
def _schedule(text: str | None) -> price_schedule.PriceSchedule | None:
    if text is None:
        return None
    try:
        return price_schedule.parse(json.loads(text), 0.0)
    except ValueError:  # written by set_price_schedule, so only a hand-edited row gets here
        return None


def _state(values: Sequence[Any], held: int, windows: list[Outage]) -> SiteState:
    """A site from its `_STATE_COLUMNS` values."""
    (site_id, price_per_hour, tokens_per_s, last_seen_at, free_capacity, capacity_at, models,
     first_seen_at, up_s, leases_granted, leases_expired, chip, schedule,
     sessions) = values[:len(_STATE_COLUMNS)]
    return SiteState(
        site_id=site_id, price_per_hour=price_per_hour, tokens_per_s=tokens_per_s,
        in_flight=held, last_seen_at=last_seen_at,
        outages=tuple(sorted(windows, key=lambda o: o.start_at)) if windows else (),
        free_capacity=free_capacity, capacity_at=capacity_at, models=_models(models),
        first_seen_at=first_seen_at, up_s=up_s, leases_granted=leases_granted,
        leases_expired=leases_expired, chip=chip, price_schedule=_schedule(schedule),
        sessions=_sessions(sessions))


def _held_and_windows(conn: Connection) -> tuple[dict[str, int], dict[str, list[Outage]]]:
    """Every site's held leases and announced outages."""
    held: dict[str, int] = dict(conn.execute(_HELD).all())
    windows: dict[str, list[Outage]] = {}
    for o in conn.execute(_OUTAGES):
        windows.setdefault(o.site_id, []).append(Outage(o.start_at, o.end_at))
    return held, windows


def _load(conn: Connection, statement: Select[Any]) -> list[tuple[Any, SiteState]]:
    """Every site's row as `statement` (one that starts with `_STATE_COLUMNS`) reads it, and
    its state."""
    held, windows = _held_and_windows(conn)
    return [(r, _state(r, int(held.get(r[0], 0)), windows.get(r[0], [])))
            for r in conn.execute(statement)]


def site_states(conn: Connection) -> dict[str, SiteState]:
    """Every registered site as placement sees it, by site id."""
    return {state.site_id: state for _, state in _load(conn, _STATES)}


def site_state(conn: Connection, site_id: str) -> SiteState | None:
    """One site as placement sees it (None: not registered)."""
    params = {"b_site_id": site_id}
    row = conn.execute(_SITE, params).first()
    if row is None:
        return None
    held = conn.execute(_SITE_HELD, params).scalar()
    windows = [Outage(o.start_at, o.end_at) for o in conn.execute(_SITE_OUTAGES, params)]
    return _state(row, int(held or 0), windows)


# Built once: every lease call reads one site, and the view of the fleet reads them all.
_STATES = select(*_STATE_COLUMNS).order_by(sites.c.name)
_ROWS = select(*_STATE_COLUMNS, *(c for c in sites.c if c.name not in _STATE_NAMES)
               ).order_by(sites.c.name)
_HELD = (select(requests.c.site_id, func.count()).where(requests.c.status == _LEASED)
         .group_by(requests.c.site_id))
_OUTAGES = select(outages.c.site_id, outages.c.start_at, outages.c.end_at)
_SITE = select(*_STATE_COLUMNS).where(sites.c.id == bindparam("b_site_id"))
_SITE_HELD = (select(func.count()).select_from(requests)
              .where(requests.c.site_id == bindparam("b_site_id"),
                     requests.c.status == _LEASED))
_SITE_OUTAGES = (select(outages.c.start_at, outages.c.end_at)
                 .where(outages.c.site_id == bindparam("b_site_id")))


class PeerView:
    """Every site as one process's lease calls last read them, read again once older than
    `max_age_s` (0: at every call); the asking site itself is read at every call.

    Placement weighs the asking site against its peers: their free room, rates, prices and
    outages. With a view up to `max_age_s` old, a thousand sites' rows are read a few times a
    second per process instead of at every lease call; the price is that a peer which came
    online within that age is missed, and the first site to ask takes work the two would have
    shared (so the default age, api/settings.py, is 0). Grants stay conditional UPDATEs of the
    rows whatever the view says.

    The view keeps its sites ranked (peer_ranks.RankIndex): ranked once per read, kept current
    by what this process's lease calls write, so a lease call weighs the asking site against
    the kinds of its peers, not against each of them.
    """

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self._states: dict[str, SiteState] = {}
        self._index: RankIndex | None = None
        self._read_at = float("-inf")
        self._lock = threading.Lock()

    def view(self, conn: Connection, site_id: str, now: float, policy: PlacementPolicy
             ) -> tuple[dict[str, SiteState], FleetRanks]:
        """Every site by id (the asking one read now, in the caller's transaction), and the
        view's sites ranked at `now` under `policy`."""
        with self._lock:
            # A view read after the call's clock (another call's, while this one waited for
            # the write lock) is newer than the call needs: re-read only an older one.
            # Re-reading it made a thousand sites' calls read every site most of the time.
            age = now - self._read_at
            if self.max_age_s <= 0 or age > self.max_age_s or self._index is None:
                self._states, self._read_at = site_states(conn), now
                self._index = RankIndex(self._states.values(), now, policy)
            elif self._index.policy != policy:
                self._index = RankIndex(self._states.values(), now, policy)
            states, index = dict(self._states), self._index
        ranks = index.at(now)
        me = site_state(conn, site_id)
        if me is not None:
            states[site_id] = me
        return states, ranks

    def remember(self, state: SiteState, now: float) -> None:
        """What a lease call of this process just wrote of its site at `now` (its held leases,
        its free room): the process's next calls weigh that site as it is now."""
        with self._lock:
            if state.site_id not in self._states:
                return
            self._states[state.site_id] = state
            index = self._index
        if index is not None:
            index.put(state, now)


@dataclass(frozen=True, slots=True)
class SiteStatus:
    """A site as operators see it (`minimill sites list`, and the API's JSON)."""

    name: str
    status: str  # new | online | draining | outage | offline
    chip: str
    serves: str  # the parts of the worker protocol its token reaches: tokens,boxes,agents
    price_per_hour: float  # what the site costs (registered, or declared by its worker)
    price_now: float  # $/h now: its price schedule's, else price_per_hour
    tokens_per_s: float | None  # busy throughput its worker reports: placement's prior
    measured_tokens_per_s: float | None  # accepted output tokens per held second (metering)
    uptime: float | None  # observed fraction of time up since first contact (site_health)
    usd_per_mtok: float  # at the reported throughput: placement's view
    expected_loss: float  # fraction of placed work expected to be lost (site_health)
    effective_usd_per_mtok: float  # usd_per_mtok / (1 - expected_loss): placement's ranking
    cost_usd_per_mtok: float | None  # what its output tokens cost, at the measured throughput
    busy_s: float  # seconds it held at least one lease
    cost_usd: float  # what that held time cost: busy_s at its price per hour
    billed_usd: float  # what tenants were billed for the completions it delivered
    margin_usd: float  # billed_usd - cost_usd
    in_flight: int
    free_capacity: int  # what its worker last said it could still take
    leases_granted: int
    leases_expired: int  # lost work: leases that ran out (their requests resumed elsewhere)
    completions: int
    stale_completions: int  # completions rejected for a stale fencing epoch
    usage_rejections: int  # completions rejected: their usage report disagreed (usage_check)
    wasted_tokens: int  # tokens of rejected results beyond what a later lease resumed from
    tokens_generated: int
    last_seen_at: float | None
    outages: list[dict[str, float]]  # announced outages not yet over


def site_status(state: SiteState, now: float, policy: PlacementPolicy = DEFAULT_POLICY) -> str:
    """new (never seen), outage (in an announced one), offline (silent longer than
    `alive_within_s`), draining (an outage starts within the drain horizon), else online."""
    if site_health.in_outage(state, now):
        return "outage"
    if state.last_seen_at is None:
        return "new"
    if not site_health.alive(state, now, policy):
        return "offline"
    return "draining" if site_health.draining(state, now, policy) else "online"


def list_sites(store: Store, now: float,
               policy: PlacementPolicy = DEFAULT_POLICY) -> list[SiteStatus]:
    with store.read() as conn:
        loaded = _load(conn, _ROWS)  # the whole row: operators see more than placement
    return [_status(row, state, now, policy) for row, state in loaded]


def _status(row: Any, state: SiteState, now: float, policy: PlacementPolicy) -> SiteStatus:
    measured = metering.measured_tokens_per_s(row.window_tokens, row.window_busy_s)
    return SiteStatus(
        name=row.name, status=site_status(state, now, policy), chip=row.chip,
        serves=row.serves or "tokens,boxes,agents",
        price_per_hour=row.price_per_hour, price_now=state.price_at(now),
        tokens_per_s=row.tokens_per_s, measured_tokens_per_s=measured,
        uptime=site_health.uptime(state, now, policy),
        usd_per_mtok=metering.usd_per_mtok(row.price_per_hour, row.tokens_per_s),
        expected_loss=site_health.loss_fraction(state, now, policy),
        effective_usd_per_mtok=site_health.effective_usd_per_mtok(state, now, policy),
        cost_usd_per_mtok=metering.cost_usd_per_mtok(row.price_per_hour, measured),
        busy_s=row.busy_s, cost_usd=row.cost_usd, billed_usd=row.billed_usd,
        margin_usd=row.billed_usd - row.cost_usd,
        in_flight=state.in_flight, free_capacity=max(row.free_capacity, 0),
        leases_granted=row.leases_granted, leases_expired=row.leases_expired,
        completions=row.completions, stale_completions=row.stale_completions,
        usage_rejections=row.usage_rejections or 0,
        wasted_tokens=row.wasted_tokens, tokens_generated=row.tokens_generated,
        last_seen_at=row.last_seen_at,
        outages=[{"start_at": o.start_at, "end_at": o.end_at} for o in state.outages
                 if o.end_at > now])
