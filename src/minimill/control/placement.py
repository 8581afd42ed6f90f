"""Placement policy: which queued requests a site that asks for work gets.

A pure function of (state snapshot, clock): no I/O, no `time.time()`. The live control plane
(leases.py builds the snapshot from the store) and a simulator driving a virtual clock call the
same code. `place` answers for the asking site only, but it plans as if every live site took
its share: a peer that should get a request before the asking site, and that reported free
capacity a moment ago, will take it on its next lease call (a fraction of a second away), so
the asking site leaves it. Rules:

- Outages: a site in an announced outage gets nothing, and no site gets a request it would not
  finish before its next announced outage (it drains ahead of time).
- Between tenants, work is offered in weighted fair order (fair_share.py): the next request
  is the head of the tenant with the least tokens leased per unit of weight, so a tenant that
  queues ten times another's work does not starve it; within a tenant, in the orders below.
- Realtime work (arrival order) goes to the fastest reliable site first: a slower site (or a
  less reliable one) takes realtime only beyond the free capacity of faster reliable peers.
- Background work (earliest deadline, then arrival order) goes to the cheapest effective $/Mtok
  first (site_health.effective_usd_per_mtok: price over busy throughput, divided by the
  fraction of work not expected to be lost): a dearer site takes it only beyond the free
  capacity of cheaper live peers...
- ...unless a deadline is at risk: when the sites cheaper than the asking one cannot finish the
  background work due by some deadline in time (its tokens over their expected throughput,
  with a safety factor), the asking site takes that work first, whatever its price.
- A peer counts as faster or cheaper only by more than `tolerance`: measurements are noisy, and
  equal sites should share the queue rather than wait for each other. Sites of the same chip
  and price are not told apart by their measured rates, which follow the load each was given
  (ranking.py says how two sites compare).
- Equal sites (neither cheaper than the other, or of the same kind: ranking.py) with free room
  share background work: the asking site takes its fair share, in proportion to its room (its
  leases plus its free capacity) times the fraction of work it is expected to keep, of that
  work plus what the equal sites already hold, and leaves the rest to its equals' free slots;
  the first to ask does not take the whole queue, and a kill of one site does not lose it all.
  Work no equal can take (another model, an outage ahead) it takes anyway.
- Announced outages also hand work back (handback.py): no site gets work that it would not
  finish `handback_lead_s` before its outage starts, when it gives back all it still holds.
- Prices that move: a site whose price follows a schedule (price_schedule.py) is ranked at its
  price now, and leaves background work for a later hour that is cheaper by more than
  `tolerance` when starting then still meets the work's deadline (`defer_background`: all
  the work due by that deadline, queued or held, at the live fleet's rate, plus the span of
  the last part, which one site runs alone: here a request's own time; with the deadline
  safety factor). Realtime work is never deferred, nor background work whose deadline is at
  risk. A site with a schedule reads the backlog for it (`needs_backlog`).
- Placement follows the KV: a request of a session whose KV a live peer with free room holds
  (its worker reports recent sessions) is left to that peer, unless the peer is much dearer
  (`affinity_max_premium`). Only a preference: a peer without room takes nothing, and the
  request runs anywhere, exactly, without its cached prefix.

The simulator (minimill.sim) places aggregated work with the same functions: `realtime_key`
and `background_key` order sites, `finishes_before_outage` keeps work off sites that would not
finish it before their announced outages, and `defer_background` picks the cheap windows; a
dearer site takes what the cheaper free sites leave, as here (tests/sim/test_sim_vs_live.py).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from minimill.control import site_health
from minimill.control.fair_share import fair_order
from minimill.control.peer_ranks import FleetRanks, Standing
from minimill.control.price_schedule import PriceSchedule
from minimill.control.records import Tier


@dataclass(frozen=True, slots=True)
class Candidate:
    """A queued request, as placement sees it."""

    request_id: str
    tier: Tier
    model: str
    seq: int  # arrival order
    deadline: float
    remaining_tokens: int | None  # tokens still to generate (None: unknown, up to the context)
    session: str | None = None  # protocol.session_tag of its session key (None: no session)
    tenant: str | None = None  # whose it is, for fair share between tenants (fair_share.py)


@dataclass(frozen=True, slots=True)
class Outage:
    start_at: float
    end_at: float


@dataclass(frozen=True, slots=True)
class SiteState:
    """A registered site: what its worker last said, and its health counters."""

    site_id: str
    price_per_hour: float
    tokens_per_s: float | None  # busy output tokens/s of the whole site (None: not measured)
    in_flight: int  # requests it holds leases on
    last_seen_at: float | None  # last lease, heartbeat or completion call
    outages: tuple[Outage, ...] = ()  # announced outages, past ones included
    free_capacity: int = 0  # what its worker said it could still take, less what it got
    capacity_at: float | None = None  # when it said so (its last lease call)
    models: frozenset[str] | None = None  # models its worker serves (None: never asked)
    first_seen_at: float | None = None
    up_s: float = 0.0  # seconds observed up (see site_health.uptime)
    leases_granted: int = 0
    leases_expired: int = 0
    chip: str | None = None  # what it runs on, as registered or declared by its worker
    price_schedule: PriceSchedule | None = None  # hourly $/h (price_per_hour outside it)
    sessions: frozenset[str] = frozenset()  # session tags whose KV its worker says it holds

    def price_at(self, now: float) -> float:
        """$/h at `now`: the schedule's, else the declared price."""
        if self.price_schedule is not None:
            scheduled = self.price_schedule.price_at(now)
            if scheduled is not None:
                return scheduled
        return self.price_per_hour

    def current_or_next_outage(self, now: float) -> Outage | None:
        upcoming = [o for o in self.outages if o.end_at > now]
        return min(upcoming, key=lambda o: o.start_at) if upcoming else None

    def serves(self, model: str) -> bool:
        return self.models is None or model in self.models


@dataclass(frozen=True, slots=True)
class Backlog:
    """Unfinished background work sharing one deadline: queued (site_id None) or leased."""

    deadline: float
    site_id: str | None
    num_requests: int
    max_tokens: int  # sum of max_tokens over the requests that have one
    num_unbounded: int  # requests without max_tokens


@dataclass(frozen=True, slots=True)
class Snapshot:
    site: SiteState  # the site asking for work
    capacity: int  # how many more requests it can take now
    models: frozenset[str]  # models its engine serves
    candidates: tuple[Candidate, ...]
    sites: tuple[SiteState, ...] = field(default=())  # every registered site
    # Background backlog, for deadline risk; leases.py fills it only when `needs_backlog`.
    backlog: tuple[Backlog, ...] = field(default=())
    # Fair share between the candidates' tenants (filled when they are several): tokens each
    # holds leased now, and its weight (default 1).
    tenant_load: Mapping[str, float] = field(default_factory=dict)
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    # Queued background requests past the candidates read (counted up to the equals' free
    # room, not read): they count in the asking site's fair share.
    background_beyond: int = 0
    # `sites` ranked once (peer_ranks.py), as the process's view of the fleet keeps them;
    # None: placement ranks `sites` itself.
    ranks: FleetRanks | None = None


@dataclass(frozen=True, slots=True)
class PlacementPolicy:
    # Conservative generation speed of one request, for "will it finish before the outage".
    stream_tokens_per_s: float = 2.0
    # Tokens assumed for a request without max_tokens.
    default_remaining_tokens: int = 512
    # A site heard from this recently is alive (about one lease TTL).
    alive_within_s: float = 30.0
    # Free capacity reported this recently is still there: idle workers ask several times a
    # second, so a quiet one is gone (dead, frozen, cut off) and its work goes elsewhere.
    capacity_fresh_s: float = 5.0
    # A peer must be cheaper (or faster) by more than this fraction to go first.
    tolerance: float = 0.15
    # Realtime prefers sites expected to lose at most this fraction of their work.
    reliable_max_loss: float = 0.1
    # Expected loss is capped here, so that effective cost stays finite.
    max_loss: float = 0.9
    # Leases assumed granted (and not lost) before any were: a new site is not judged on 2.
    prior_leases: int = 20
    # A deadline is at risk when the work due by it needs more than 1/this of the time left.
    deadline_safety: float = 1.25
    # A site with an announced outage hands back every lease it still holds this long before
    # the outage starts (its worker hears of it at its next heartbeat, then checkpoints and
    # releases them), and is given no work it would not finish by then.
    handback_lead_s: float = 5.0
    # Held leases are weighed for an early handback only this close to an outage.
    handback_horizon_s: float = 3600.0
    # A session's next turn is left to the live peer holding its KV (with free room) unless
    # that peer's effective $/Mtok is more than this fraction above the asking site's.
    affinity_max_premium: float = 0.5

    def estimated_seconds(self, candidate: Candidate) -> float:
        return max(self.tokens(candidate), 1) / self.stream_tokens_per_s

    def tokens(self, candidate: Candidate) -> int:
        if candidate.remaining_tokens is None:
            return self.default_remaining_tokens
        return candidate.remaining_tokens

    @property
    def drain_horizon_s(self) -> float:
        """How long before an outage placement starts holding work back from a site."""
        return self.default_remaining_tokens / self.stream_tokens_per_s


DEFAULT_POLICY = PlacementPolicy()


def finishes_before_outage(site: SiteState, now: float, seconds: float,
                           policy: PlacementPolicy) -> bool:
    """Would work of `seconds` started now end before the site hands back its work ahead of
    its next announced outage (and is it up now)?"""
    outage = site.current_or_next_outage(now)
    return outage is None or now + seconds <= outage.start_at - policy.handback_lead_s


def fits(site: SiteState, candidate: Candidate, now: float, policy: PlacementPolicy) -> bool:
    """Would `site` finish `candidate` before it hands back its work ahead of its next outage
    (and is it up now)?"""
    return finishes_before_outage(site, now, policy.estimated_seconds(candidate), policy)


def realtime_key(site: SiteState, now: float,
                 policy: PlacementPolicy = DEFAULT_POLICY) -> tuple[bool, float, str]:
    """Order of sites for realtime work: reliable first, then fastest."""
    return (site_health.loss_fraction(site, now, policy) > policy.reliable_max_loss,
            -site_health.busy_tokens_per_s(site), site.site_id)


def background_key(site: SiteState, now: float,
                   policy: PlacementPolicy = DEFAULT_POLICY) -> tuple[float, str]:
    """Order of sites for background work: cheapest effective $/Mtok (at its price now)."""
    return (site_health.effective_usd_per_mtok(site, now, policy), site.site_id)


def deadline_risk(due: Mapping[float, float], tokens_per_s: float, now: float,
                  policy: PlacementPolicy = DEFAULT_POLICY) -> float | None:
    """The latest deadline whose work (`due`: tokens due by each deadline) cannot be finished
    in time at `tokens_per_s`, with the safety factor (None: every deadline is safe)."""
    at_risk, total = None, 0.0
    for deadline in sorted(due):
        total += due[deadline]
        needed_s = total / tokens_per_s if tokens_per_s > 0 else math.inf
        if now + needed_s * policy.deadline_safety > deadline:
            at_risk = deadline
    return at_risk


def defer_background(site: SiteState, deadline: float, work_s: float, now: float,
                     policy: PlacementPolicy = DEFAULT_POLICY, tail_s: float = 0.0) -> bool:
    """Should the site leave background work due by `deadline`, needing `work_s` seconds, for
    a cheaper hour of its price schedule? Yes when an hour that starts early enough to meet
    the deadline (with the safety factor) is cheaper than now by more than `tolerance`.

    `tail_s`: the longest one indivisible part of that work runs once started (a lease's
    span). When `work_s` is the fleet's time for all of it, the parts are not cut finer than
    that: the last one starts as the queue empties and runs on alone, so its span adds to the
    time needed instead of sharing the fleet's rate (work due 216 s of the fleet's time, in
    leases of 71 s, ends 281 s after it starts, not 216)."""
    schedule = site.price_schedule
    if schedule is None:
        return False
    latest_start = deadline - (work_s + tail_s) * policy.deadline_safety
    if latest_start <= now:
        return False
    now_price = site.price_at(now)
    return any(site.price_at(t) * (1 + policy.tolerance) < now_price
               for t in schedule.hour_starts(now, latest_start))


def due_by(backlog: Iterable[Backlog],
           policy: PlacementPolicy = DEFAULT_POLICY) -> Callable[[float], float]:
    """Tokens of the background work (queued or held, anywhere) due by a deadline, read off
    prefix sums: a lease call asks it of every candidate it may defer."""
    due: dict[float, float] = {}
    for b in backlog:
        tokens = b.max_tokens + b.num_unbounded * policy.default_remaining_tokens
        due[b.deadline] = due.get(b.deadline, 0.0) + tokens
    deadlines = sorted(due)
    totals = [0.0]
    for d in deadlines:
        totals.append(totals[-1] + due[d])
    return lambda deadline: totals[bisect.bisect_right(deadlines, deadline)]


def defers(site: SiteState, candidate: Candidate, due: Callable[[float], float] | None,
           fleet_tokens_per_s: float, now: float,
           policy: PlacementPolicy = DEFAULT_POLICY) -> bool:
    """defer_background for one candidate of a lease call: the time needed is all the work
    due by its deadline (`due`: the backlog) at the live fleet's rate, then the candidate's own
    time (the last request started runs on alone); without a backlog, its own time only. A
    cheap hour that one request fits before the deadline may not fit a batch of thousands."""
    own_s = policy.estimated_seconds(candidate)
    if due is None:
        return defer_background(site, candidate.deadline, own_s, now, policy)
    work_s = (due(candidate.deadline) / fleet_tokens_per_s if fleet_tokens_per_s > 0
              else math.inf)
    return defer_background(site, candidate.deadline, work_s, now, policy, tail_s=own_s)


def ranks_of(snapshot: Snapshot, now: float,
             policy: PlacementPolicy = DEFAULT_POLICY) -> FleetRanks:
    """The snapshot's sites ranked once (peer_ranks.py): the index the snapshot carries, else
    one built from its sites."""
    ranks = snapshot.ranks
    if ranks is not None and ranks.policy == policy:
        return ranks
    return FleetRanks.of(snapshot.sites, now, policy)


def standing(snapshot: Snapshot, now: float,
             policy: PlacementPolicy = DEFAULT_POLICY) -> Standing:
    """How the asking site's peers rank against it."""
    return ranks_of(snapshot, now, policy).standing(snapshot.site, now)


def needs_backlog(snapshot: Snapshot, now: float, policy: PlacementPolicy = DEFAULT_POLICY) -> bool:
    """Whether the backlog can change the answer: some live peer is cheaper (deadline risk),
    or a cheaper hour of the asking site's schedule starts before the last deadline of the
    background candidates (whether the work due still finishes after it). The backlog is read
    with a query over all unfinished background work, so a site asks for it only then."""
    return (standing(snapshot, now, policy).any_cheaper_live()
            or cheaper_hour_ahead(snapshot, now, policy))


def cheaper_hour_ahead(snapshot: Snapshot, now: float,
                       policy: PlacementPolicy = DEFAULT_POLICY) -> bool:
    """Whether some background candidate could wait for a cheaper hour of the asking site's
    schedule (were its work no time at all)."""
    if snapshot.site.price_schedule is None:
        return False
    latest = max((c.deadline for c in snapshot.candidates if c.tier != Tier.REALTIME),
                 default=None)
    return latest is not None and defer_background(snapshot.site, latest, 0.0, now, policy)


def peer_room(snapshot: Snapshot, now: float,
              policy: PlacementPolicy = DEFAULT_POLICY) -> tuple[int, int]:
    """Free capacity of the peers that take work before the asking site (faster for realtime,
    cheaper for background): how far past its own capacity the queue must be read to find what
    it gets; and of its equals (neither): how far past that the queue must be counted to know
    its fair share of the background work. Sums over kinds of peers (peer_ranks.py)."""
    rated = standing(snapshot, now, policy)
    return rated.room_ahead(), rated.room_shared()


def deadline_at_risk(snapshot: Snapshot, now: float, policy: PlacementPolicy = DEFAULT_POLICY,
                     rated: Standing | None = None) -> float | None:
    """The latest deadline whose background work the live sites cheaper than the asking one
    cannot finish in time (None: none at risk, or no live site is cheaper: the asking one goes
    first anyway). Work counted: queued, and leased to them."""
    if not snapshot.backlog:
        return None
    ranks = ranks_of(snapshot, now, policy)
    rated = rated if rated is not None else ranks.standing(snapshot.site, now)
    if not rated.any_cheaper_live():
        return None
    rate = rated.cheaper_tokens_per_s()
    due: dict[float, int] = {}
    for b in snapshot.backlog:
        if b.site_id is None or ranks.cheaper_than(b.site_id, snapshot.site, rated.usd_per_mtok):
            tokens = b.max_tokens + b.num_unbounded * policy.default_remaining_tokens
            due[b.deadline] = due.get(b.deadline, 0) + tokens
    return deadline_risk(due, rate, now, policy)


class Plan:
    """Free slots of the peers that go before the asking site, consumed in placement order
    (a peer's room is looked up when placement first offers it work)."""

    def __init__(self, now: float, policy: PlacementPolicy) -> None:
        self.now, self.policy = now, policy
        self.slots: dict[str, int] = {}

    def left(self, peer: SiteState) -> int:
        slots = self.slots.get(peer.site_id)
        if slots is None:
            slots = self.slots[peer.site_id] = site_health.free_slots(peer, self.now,
                                                                       self.policy)
        return slots

    def give(self, peers: Sequence[SiteState], candidate: Candidate, start: int = 0) -> bool:
        """Hand `candidate` to the first of `peers[start:]` that has room and can run it."""
        for i in range(start, len(peers)):
            if self._takes(peers[i], candidate):
                return True
        return False

    def _takes(self, peer: SiteState, candidate: Candidate) -> bool:
        if (self.left(peer) > 0 and peer.serves(candidate.model)
                and fits(peer, candidate, self.now, self.policy)):
            self.slots[peer.site_id] -= 1
            return True
        return False

    def ranked(self, peers: Iterable[SiteState]) -> Ranked:
        return Ranked(self, peers)


class Ranked:
    """Peers in the order they take work (read from `peers` as far as placement goes),
    offered candidates one at a time. A peer whose room is used up stays so for the rest of
    the plan, so it is passed over once, not at every candidate: with a thousand equal peers
    and a few thousand queued requests, a lease call's placement costs their sum, not their
    product; and only the peers reached are read."""

    def __init__(self, plan: Plan, peers: Iterable[SiteState]) -> None:
        self.plan, self.first = plan, 0
        self.peers: list[SiteState] = []
        self._more = iter(peers)

    def _reach(self, i: int) -> bool:
        """Whether there is an i-th peer (read up to it)."""
        while len(self.peers) <= i:
            peer = next(self._more, None)
            if peer is None:
                return False
            self.peers.append(peer)
        return True

    def give(self, candidate: Candidate) -> bool:
        plan = self.plan
        while self._reach(self.first) and plan.left(self.peers[self.first]) <= 0:
            self.first += 1
        i = self.first
        while self._reach(i):
            if plan._takes(self.peers[i], candidate):
                return True
            i += 1
        return False


def place(snapshot: Snapshot, now: float, policy: PlacementPolicy = DEFAULT_POLICY) -> list[str]:
    """Request ids to lease to `snapshot.site`, best first, at most `snapshot.capacity`."""
    me = snapshot.site
    if snapshot.capacity <= 0 or site_health.in_outage(me, now):
        return []
    ranks = ranks_of(snapshot, now, policy)
    rated = ranks.standing(me, now)
    plan = Plan(now, policy)
    faster = plan.ranked(rated.faster_peers())
    cheaper = plan.ranked(rated.cheaper_peers())
    equals = plan.ranked(rated.equal_peers())
    urgent_until = deadline_at_risk(snapshot, now, policy, rated)
    most = rated.usd_per_mtok * (1 + policy.affinity_max_premium)
    holders = [h.site for h in ranks.holders
               if h.site_id != me.site_id and h.usd_per_mtok <= most]

    def mine(candidate: Candidate) -> bool:
        return candidate.model in snapshot.models and fits(me, candidate, now, policy)

    def urgent(candidate: Candidate) -> bool:
        return urgent_until is not None and candidate.deadline <= urgent_until

    def held_elsewhere(candidate: Candidate) -> bool:
        """Leave it to a peer holding its session's KV (which takes it on its next call)."""
        tag = candidate.session
        if tag is None or tag in me.sessions:
            return False
        return plan.give([p for p in holders if tag in p.sessions], candidate)

    def in_fair_order(tier_candidates: Iterable[Candidate],
                      key: Callable[[Candidate], Any]) -> list[Candidate]:
        return fair_order(tier_candidates, lambda c: c.tenant, key, policy.tokens,
                          snapshot.tenant_load, snapshot.tenant_weights)

    realtime = in_fair_order((c for c in snapshot.candidates if c.tier == Tier.REALTIME),
                             lambda c: c.seq)
    background = in_fair_order((c for c in snapshot.candidates if c.tier != Tier.REALTIME),
                               lambda c: (c.deadline, c.seq))
    picked: list[str] = []
    for candidate in realtime:
        if len(picked) >= snapshot.capacity:
            return picked
        if held_elsewhere(candidate) or faster.give(candidate):
            continue
        if mine(candidate):
            picked.append(candidate.request_id)
        else:  # a cheaper peer will run it, realtime before its background
            cheaper.give(candidate)
    shared = [c for c in background  # what cheaper peers leave to this site and its equals
              if urgent(c) or not (held_elsewhere(c) or cheaper.give(c))]
    # A cheaper hour ahead that still meets the deadline: leave it queued until then.
    if me.price_schedule is not None:
        due = due_by(snapshot.backlog, policy) if snapshot.backlog else None
        fleet = rated.live_tokens_per_s() + site_health.expected_tokens_per_s(me, now, policy)
        shared = [c for c in shared
                  if urgent(c) or not defers(me, c, due, fleet, now, policy)]
    share = fair_share(snapshot, len(picked), rated,
                       len(shared) + snapshot.background_beyond, now, policy)
    taken = 0
    for candidate in shared:
        if len(picked) >= snapshot.capacity:
            break
        if taken >= share and equals.give(candidate):
            continue
        if mine(candidate):
            picked.append(candidate.request_id)
            taken += 1
    return picked


def fair_share(snapshot: Snapshot, num_picked: int, rated: Standing, num_shared: int,
               now: float, policy: PlacementPolicy = DEFAULT_POLICY) -> int:
    """How many of `num_shared` background requests the asking site takes, its equals with
    free room (`rated`: its peers by rank) taking the rest: each site's share of the work (that
    plus what they already hold) is in proportion to its room (what it holds plus its free
    capacity) times the fraction of its work it is expected to keep, so a site that loses work
    gets less of it but not none. Rounded up, so that someone always takes the last request.
    `num_picked`: realtime it just got."""
    equal_room, equal_held, equal_weighed = rated.equals()
    if not equal_room:
        return num_shared
    me = snapshot.site
    held = me.in_flight + num_picked
    mine = (me.in_flight + snapshot.capacity) * (1.0 - site_health.loss_fraction(me, now, policy))
    all_held = held + equal_held
    everyone = mine + equal_weighed
    target = (num_shared + all_held) * mine / everyone if everyone > 0 else num_shared
    return max(0, math.ceil(target - held - 1e-9))
