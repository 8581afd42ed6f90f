"""Placement's index of the fleet: each live site's numbers as ranking.py compares them,
computed once per view of the fleet and grouped, so that a lease call weighs the asking site
against groups of sites instead of against every site.

ranking.py compares two sites on their chip and declared price (same kind), reliability,
busy throughput and effective $/Mtok. Sites alike in these compare alike against any asking
site:

- a *class* holds the live sites of one chip, declared price and reliability. Against an
  asking site of the same kind (same chip, price within the tolerance) all of a class compare
  alike whatever their rates: never cheaper nor dearer, faster only by reliability;
- a *kind* splits a class by busy throughput and effective $/Mtok: all of a kind compare
  alike against any asking site.

A lease call costs the number of classes plus the kinds of the classes not of its own kind:
a fleet of a few chips and prices costs a few comparisons, whatever its size; a site that
measures a rate of its own is a kind of its own for the asking sites of other kinds.

Each group keeps its sites with free room in the orders placement hands work out in (by id;
a class also in realtime order) and the sums placement needs (free room, the leases of the
sites with room and their room weighed by the work each is expected to keep, live sites and
their expected throughput). Groups are immutable and updated by copy: a lease call reads a
`FleetRanks` while another call's update builds the next one.

Time: a live site's numbers do not move with the clock, except its free room (stale after
`capacity_fresh_s`), its liveness (silent after `alive_within_s`), its announced outages and a
scheduled price. `RankIndex.at(now)` drops the room and liveness that lapsed by `now` (a heap
of when each lapses) and rebuilds every site's numbers when an outage starts or ends or a
scheduled price turns the hour.
"""

from __future__ import annotations

import bisect
import heapq
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from minimill.control import metering, ranking, site_health
from minimill.control.price_schedule import HOUR_S

if TYPE_CHECKING:
    from minimill.control.placement import PlacementPolicy, SiteState

ClassKey = tuple[str | None, float, bool]  # chip, declared $/h, reliable
KindKey = tuple[float, float]  # busy tokens/s, effective $/Mtok


@dataclass(frozen=True, slots=True)
class Entry:
    """One site's numbers as ranking.py compares them, at the index's clock."""

    site: SiteState
    position: int  # its place in the fleet as given (the order of session holders)
    alive: bool
    room: int  # site_health.free_slots
    reliable: bool  # expected loss within policy.reliable_max_loss
    tokens_per_s: float  # site_health.busy_tokens_per_s
    usd_per_mtok: float  # site_health.effective_usd_per_mtok at its price now
    kept: float  # 1 - expected loss

    @property
    def site_id(self) -> str:
        return self.site.site_id

    @property
    def class_key(self) -> ClassKey:
        return (self.site.chip, self.site.price_per_hour, self.reliable)

    @property
    def kind_key(self) -> KindKey:
        return (self.tokens_per_s, self.usd_per_mtok)

    @property
    def weighed_room(self) -> float:
        """What the site's room counts for in a fair share (placement.fair_share)."""
        return (self.site.in_flight + self.room) * self.kept


def entry_of(site: SiteState, position: int, now: float, policy: PlacementPolicy) -> Entry:
    loss = site_health.loss_fraction(site, now, policy)
    return Entry(site=site, position=position, alive=site_health.alive(site, now, policy),
                 room=site_health.free_slots(site, now, policy),
                 reliable=loss <= policy.reliable_max_loss,
                 tokens_per_s=site_health.busy_tokens_per_s(site),
                 usd_per_mtok=metering.effective_usd_per_mtok(site.price_at(now),
                                                              site.tokens_per_s, loss),
                 kept=1.0 - loss)


def _by_id(e: Entry) -> str:
    return e.site_id


def realtime_order(e: Entry) -> tuple[bool, float, str]:
    """placement.realtime_key on the entry's numbers."""
    return (not e.reliable, -e.tokens_per_s, e.site_id)


def background_order(e: Entry) -> tuple[float, str]:
    """placement.background_key on the entry's numbers."""
    return (e.usd_per_mtok, e.site_id)


def _inserted(entries: tuple[Entry, ...], e: Entry,
              key: Callable[[Entry], Any]) -> tuple[Entry, ...]:
    at = bisect.bisect_left(entries, key(e), key=key)
    return (*entries[:at], e, *entries[at:])


def _removed(entries: tuple[Entry, ...], e: Entry,
             key: Callable[[Entry], Any]) -> tuple[Entry, ...]:
    at = bisect.bisect_left(entries, key(e), key=key)
    if at < len(entries) and entries[at].site_id == e.site_id:
        return (*entries[:at], *entries[at + 1:])
    return entries


@dataclass(frozen=True, slots=True)
class Group:
    """Live sites that compare alike against an asking site (a class, or a kind of one)."""

    is_class: bool  # a class (its sites' rates differ), or a kind
    chip: str | None
    price_per_hour: float
    reliable: bool
    tokens_per_s: float  # a kind's (a class's sites differ in it)
    usd_per_mtok: float  # a kind's
    by_id: tuple[Entry, ...] = ()  # its sites with free room, by site id
    by_realtime: tuple[Entry, ...] = ()  # the same in realtime order (a class's; a kind's: by_id)
    room: int = 0
    held: int = 0  # leases its sites with room hold
    weighed: float = 0.0  # Entry.weighed_room over its sites with room
    live: int = 0  # its live sites, with room or not
    live_tokens_per_s: float = 0.0  # their busy throughput times the work each keeps

    def plus(self, e: Entry, sign: int) -> Group:
        """The group with `e` added (sign 1) or taken out (sign -1)."""
        changes: dict[str, Any] = {"live": self.live + sign,
                                   "live_tokens_per_s": self.live_tokens_per_s
                                   + sign * e.tokens_per_s * e.kept}
        if e.room > 0:
            edit = _inserted if sign > 0 else _removed
            by_id = edit(self.by_id, e, _by_id)
            changes.update(by_id=by_id, room=self.room + sign * e.room,
                           held=self.held + sign * e.site.in_flight,
                           weighed=self.weighed + sign * e.weighed_room,
                           # a kind is one rate: its id order is its realtime order
                           by_realtime=edit(self.by_realtime, e, realtime_order)
                           if self.is_class else by_id)
        return replace(self, **changes)


def _group_of(entries: list[Entry], is_class: bool) -> Group:
    first = entries[0]
    with_room = [e for e in entries if e.room > 0]
    by_id = tuple(sorted(with_room, key=_by_id))
    return Group(is_class=is_class, chip=first.site.chip, price_per_hour=first.site.price_per_hour,
                 reliable=first.reliable, tokens_per_s=first.tokens_per_s,
                 usd_per_mtok=first.usd_per_mtok, by_id=by_id,
                 by_realtime=tuple(sorted(with_room, key=realtime_order)) if is_class else by_id,
                 room=sum(e.room for e in with_room),
                 held=sum(e.site.in_flight for e in with_room),
                 weighed=sum(e.weighed_room for e in with_room), live=len(entries),
                 live_tokens_per_s=sum(e.tokens_per_s * e.kept for e in entries))


@dataclass(frozen=True, slots=True)
class Rated:
    """A group as one asking site sees it, without the asking site itself."""

    group: Group
    faster: bool  # ranking.faster: it goes first for realtime work
    cheaper: bool  # ranking.cheaper: it goes first for background work
    dearer: bool  # the asking site is cheaper than it
    room: int
    held: int
    weighed: float
    live: int
    live_tokens_per_s: float

    @property
    def equal(self) -> bool:
        """ranking.equal: it shares background work with the asking site."""
        return not self.cheaper and not self.dearer


@dataclass(frozen=True, slots=True)
class Standing:
    """The live peers of one asking site, grouped by how they rank against it."""

    site_id: str  # the asking site, left out of every group
    usd_per_mtok: float  # its effective $/Mtok
    groups: tuple[Rated, ...]

    def _peers(self, groups: Iterable[Rated], order: Callable[[Entry], Any],
               of: Callable[[Group], tuple[Entry, ...]]) -> Iterator[SiteState]:
        lists = [of(r.group) for r in groups if r.room > 0]
        merged: Iterable[Entry] = (() if not lists else lists[0] if len(lists) == 1
                                   else heapq.merge(*lists, key=order))
        return (e.site for e in merged if e.site_id != self.site_id)

    def faster_peers(self) -> Iterator[SiteState]:
        """Peers with room that go first for realtime work, in placement.realtime_key order."""
        return self._peers((r for r in self.groups if r.faster), realtime_order,
                           lambda g: g.by_realtime)

    def cheaper_peers(self) -> Iterator[SiteState]:
        """Peers with room that go first for background work, in background_key order (a kind
        is one price: its id order is that order)."""
        return self._peers((r for r in self.groups if r.cheaper), background_order,
                           lambda g: g.by_id)

    def equal_peers(self) -> Iterator[SiteState]:
        """Peers with room that share background work with the asking site, by id."""
        return self._peers((r for r in self.groups if r.equal), _by_id, lambda g: g.by_id)

    def room_ahead(self) -> int:
        """Free room of the peers that go first (faster or cheaper)."""
        return sum(r.room for r in self.groups if r.faster or r.cheaper)

    def room_shared(self) -> int:
        """Free room of the peers that neither go first nor come after (placement.peer_room)."""
        return sum(r.room for r in self.groups
                   if not (r.faster or r.cheaper) and not r.dearer)

    def equals(self) -> tuple[int, int, float]:
        """Equal peers with room: their free room (0: there are none), the leases they hold,
        and their weighed room (placement.fair_share)."""
        equal = [r for r in self.groups if r.equal and r.room > 0]
        return (sum(r.room for r in equal), sum(r.held for r in equal),
                sum(r.weighed for r in equal))

    def any_cheaper_live(self) -> bool:
        return any(r.cheaper and r.live > 0 for r in self.groups)

    def live_tokens_per_s(self) -> float:
        """Expected throughput of all the live peers."""
        return sum(r.live_tokens_per_s for r in self.groups)

    def cheaper_tokens_per_s(self) -> float:
        """Expected throughput of the live peers that are cheaper."""
        return sum(r.live_tokens_per_s for r in self.groups if r.cheaper)


@dataclass(frozen=True, slots=True)
class FleetRanks:
    """Every site's numbers at one clock, grouped: what a lease call reads (immutable)."""

    policy: PlacementPolicy
    entries: dict[str, Entry]  # every site given, live or not
    classes: dict[ClassKey, Group]
    kinds: dict[ClassKey, dict[KindKey, Group]]
    holders: tuple[Entry, ...]  # sites with room that hold sessions' KV, in fleet order

    @staticmethod
    def of(sites: Iterable[SiteState], now: float, policy: PlacementPolicy) -> FleetRanks:
        return FleetRanks.build([entry_of(s, i, now, policy) for i, s in enumerate(sites)],
                                policy)

    @staticmethod
    def build(entries: list[Entry], policy: PlacementPolicy) -> FleetRanks:
        by_class: dict[ClassKey, list[Entry]] = {}
        by_kind: dict[ClassKey, dict[KindKey, list[Entry]]] = {}
        for e in entries:
            if e.alive:
                by_class.setdefault(e.class_key, []).append(e)
                by_kind.setdefault(e.class_key, {}).setdefault(e.kind_key, []).append(e)
        return FleetRanks(
            policy=policy, entries={e.site_id: e for e in entries},
            classes={k: _group_of(members, True) for k, members in by_class.items()},
            kinds={k: {kk: _group_of(members, False) for kk, members in kinds.items()}
                   for k, kinds in by_kind.items()},
            holders=tuple(e for e in entries if e.room > 0 and e.site.sessions))

    def with_entry(self, e: Entry) -> FleetRanks:
        """The index with `e` in place of the site's previous entry (copy on write: the
        groups it leaves and joins are rebuilt, the others shared)."""
        old = self.entries.get(e.site_id)
        classes, kinds = dict(self.classes), dict(self.kinds)
        for item, sign in ((old, -1), (e, 1)):
            if item is None or not item.alive:
                continue
            key, kind_key = item.class_key, item.kind_key
            group = classes.get(key)
            classes[key] = group.plus(item, sign) if group else _group_of([item], True)
            in_class = dict(kinds.get(key, {}))
            group = in_class.get(kind_key)
            in_class[kind_key] = group.plus(item, sign) if group else _group_of([item], False)
            if in_class[kind_key].live <= 0:
                del in_class[kind_key]
            if classes[key].live <= 0:
                del classes[key]
            if in_class:
                kinds[key] = in_class
            else:
                kinds.pop(key, None)
        entries = dict(self.entries)
        entries[e.site_id] = e
        holders = self.holders
        if (old is not None and old.room > 0 and old.site.sessions) or (
                e.room > 0 and e.site.sessions):
            holders = tuple(sorted(
                [h for h in holders if h.site_id != e.site_id]
                + ([e] if e.room > 0 and e.site.sessions else []), key=lambda h: h.position))
        return FleetRanks(self.policy, entries, classes, kinds, holders)

    def standing(self, me: SiteState, now: float) -> Standing:
        """How the live peers of `me` rank against it: O(classes + kinds of other kinds)."""
        policy = self.policy
        loss = site_health.loss_fraction(me, now, policy)
        reliable, tokens_per_s = loss <= policy.reliable_max_loss, site_health.busy_tokens_per_s(me)
        usd = metering.effective_usd_per_mtok(me.price_at(now), me.tokens_per_s, loss)
        mine = self.entries.get(me.site_id)
        mine = mine if mine is not None and mine.alive else None
        rated: list[Rated] = []
        for key, cls in self.classes.items():
            own_class = mine is not None and mine.class_key == key
            if ranking.kind_matches(cls.chip, cls.price_per_hour, me.chip, me.price_per_hour,
                                    policy):
                fast = ranking.faster_by(cls.reliable, 0.0, reliable, 0.0, True, policy)
                rated.append(_rated(cls, fast, False, False, mine if own_class else None))
                continue
            for kind_key, kind in self.kinds[key].items():
                own = own_class and mine is not None and mine.kind_key == kind_key
                rated.append(_rated(
                    kind, ranking.faster_by(kind.reliable, kind.tokens_per_s, reliable,
                                            tokens_per_s, False, policy),
                    ranking.cheaper_by(kind.usd_per_mtok, usd, False, policy),
                    ranking.cheaper_by(usd, kind.usd_per_mtok, False, policy),
                    mine if own else None))
        return Standing(site_id=me.site_id, usd_per_mtok=usd, groups=tuple(rated))

    def cheaper_than(self, site_id: str, me: SiteState, usd_per_mtok: float) -> bool:
        """Is the site `site_id` a live peer cheaper than `me` (of effective `usd_per_mtok`)?"""
        e = self.entries.get(site_id)
        if e is None or not e.alive or site_id == me.site_id:
            return False
        same = ranking.kind_matches(e.site.chip, e.site.price_per_hour, me.chip,
                                    me.price_per_hour, self.policy)
        return ranking.cheaper_by(e.usd_per_mtok, usd_per_mtok, same, self.policy)


def _rated(group: Group, faster: bool, cheaper: bool, dearer: bool,
           mine: Entry | None) -> Rated:
    """The group rated against the asking site, whose own entry (`mine`) is taken out."""
    if mine is None:
        return Rated(group, faster, cheaper, dearer, group.room, group.held, group.weighed,
                     group.live, group.live_tokens_per_s)
    with_room = mine.room > 0
    return Rated(group, faster, cheaper, dearer,
                 room=group.room - (mine.room if with_room else 0),
                 held=group.held - (mine.site.in_flight if with_room else 0),
                 weighed=group.weighed - (mine.weighed_room if with_room else 0.0),
                 live=group.live - 1,
                 live_tokens_per_s=group.live_tokens_per_s - mine.tokens_per_s * mine.kept)


def _lapses_at(e: Entry, policy: PlacementPolicy) -> float | None:
    """When the entry's room or liveness lapses with the clock alone (None: never)."""
    site = e.site
    times = []
    if e.room > 0 and site.capacity_at is not None:
        times.append(site.capacity_at + policy.capacity_fresh_s)
    if e.alive and site.last_seen_at is not None:
        times.append(site.last_seen_at + policy.alive_within_s)
    return min(times) if times else None


def _turns_at(site: SiteState, after: float) -> float:
    """The first time past `after` at which one of the site's outages starts or ends or its
    scheduled price turns the hour (inf: none)."""
    times = [t for o in site.outages for t in (o.start_at, o.end_at) if t > after]
    if site.price_schedule is not None:
        times += site.price_schedule.hour_starts(after, after + HOUR_S)[:1]
    return min(times, default=math.inf)


class RankIndex:
    """A FleetRanks kept current: `put` a site's new state, `at(now)` for the ranks at `now`.
    Safe to share between threads; what it hands out is immutable."""

    def __init__(self, sites: Iterable[SiteState], now: float,
                 policy: PlacementPolicy) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        self._rebuild(list(sites), now)

    def _rebuild(self, sites: list[SiteState], now: float) -> None:
        entries = [entry_of(s, i, now, self.policy) for i, s in enumerate(sites)]
        self._ranks = FleetRanks.build(entries, self.policy)
        self._clock = now
        self._turns_at = min((_turns_at(s, now) for s in sites), default=math.inf)
        self._lapses: list[tuple[float, str]] = []
        for e in entries:
            self._lapse_later(e)

    def _lapse_later(self, e: Entry) -> None:
        at = _lapses_at(e, self.policy)
        if at is not None:
            heapq.heappush(self._lapses, (at, e.site_id))

    def put(self, site: SiteState, now: float) -> None:
        """The site as a lease call just left it (at that call's clock)."""
        with self._lock:
            old = self._ranks.entries.get(site.site_id)
            position = old.position if old is not None else len(self._ranks.entries)
            e = entry_of(site, position, max(now, self._clock), self.policy)
            self._ranks = self._ranks.with_entry(e)
            self._lapse_later(e)
            self._turns_at = min(self._turns_at, _turns_at(site, self._clock))

    def at(self, now: float) -> FleetRanks:
        """The ranks at `now`: lapsed room and liveness dropped (a clock behind one already
        seen gets the ranks of that one: lapses are not undone)."""
        with self._lock:
            if now >= self._turns_at:
                self._rebuild([e.site for e in sorted(self._ranks.entries.values(),
                                                      key=lambda e: e.position)], now)
                return self._ranks
            self._clock = max(self._clock, now)
            while self._lapses and self._lapses[0][0] <= self._clock:
                _, site_id = heapq.heappop(self._lapses)
                old = self._ranks.entries.get(site_id)
                if old is None:
                    continue
                e = entry_of(old.site, old.position, self._clock, self.policy)
                if e != old:
                    self._ranks = self._ranks.with_entry(e)
                    self._lapse_later(e)
                elif (later := _lapses_at(e, self.policy)) is not None and later <= self._clock:
                    # Not lapsed after all (float rounding at the edge): look again just after.
                    # (A later lapse of a newer state has its own place in the heap.)
                    heapq.heappush(self._lapses, (math.nextafter(self._clock, math.inf),
                                                  site_id))
            return self._ranks
