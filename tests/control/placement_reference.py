"""Placement as it was before peer_ranks.py: every peer ranked against the asking site at
every call (ranking.py per pair). Kept as the reference the ranked index must agree with
(test_peer_ranks.py); not used by minimill itself."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from minimill.control import ranking, site_health
from minimill.control.fair_share import fair_order
from minimill.control.placement import (
    DEFAULT_POLICY,
    Candidate,
    PlacementPolicy,
    SiteState,
    Snapshot,
    background_key,
    cheaper_hour_ahead,
    deadline_risk,
    defers,
    due_by,
    fits,
    realtime_key,
)
from minimill.control.records import Tier


def _peers(snapshot: Snapshot) -> list[SiteState]:
    return [s for s in snapshot.sites if s.site_id != snapshot.site.site_id]


def needs_backlog(snapshot: Snapshot, now: float, policy: PlacementPolicy = DEFAULT_POLICY) -> bool:
    return cheaper_hour_ahead(snapshot, now, policy) or any(site_health.alive(p, now, policy)
               and ranking.cheaper(p, snapshot.site, now, policy)
               for p in _peers(snapshot))


def peer_room(snapshot: Snapshot, now: float,
              policy: PlacementPolicy = DEFAULT_POLICY) -> tuple[int, int]:
    me = snapshot.site
    ahead = shared = 0
    for p in _peers(snapshot):
        room = site_health.free_slots(p, now, policy)
        if not room:
            continue
        if ranking.faster(p, me, now, policy) or ranking.cheaper(p, me, now, policy):
            ahead += room
        elif not ranking.cheaper(me, p, now, policy):
            shared += room
    return ahead, shared


def deadline_at_risk(snapshot: Snapshot, now: float,
                     policy: PlacementPolicy = DEFAULT_POLICY) -> float | None:
    if not snapshot.backlog:
        return None
    me = snapshot.site
    cheaper = [p for p in _peers(snapshot)
               if site_health.alive(p, now, policy) and ranking.cheaper(p, me, now, policy)]
    if not cheaper:
        return None
    rate = sum(site_health.expected_tokens_per_s(p, now, policy) for p in cheaper)
    theirs = {p.site_id for p in cheaper}
    due: dict[float, int] = {}
    for b in snapshot.backlog:
        if b.site_id is None or b.site_id in theirs:
            tokens = b.max_tokens + b.num_unbounded * policy.default_remaining_tokens
            due[b.deadline] = due.get(b.deadline, 0) + tokens
    return deadline_risk(due, rate, now, policy)


class Plan:
    def __init__(self, peers: list[SiteState], now: float, policy: PlacementPolicy) -> None:
        self.now, self.policy = now, policy
        self.slots = {p.site_id: site_health.free_slots(p, now, policy) for p in peers}

    def give(self, peers: list[SiteState], candidate: Candidate, start: int = 0) -> bool:
        for i in range(start, len(peers)):
            peer = peers[i]
            if (self.slots[peer.site_id] > 0 and peer.serves(candidate.model)
                    and fits(peer, candidate, self.now, self.policy)):
                self.slots[peer.site_id] -= 1
                return True
        return False


def place(snapshot: Snapshot, now: float, policy: PlacementPolicy = DEFAULT_POLICY) -> list[str]:
    me = snapshot.site
    if snapshot.capacity <= 0 or site_health.in_outage(me, now):
        return []
    peers = [p for p in _peers(snapshot) if site_health.free_slots(p, now, policy) > 0]
    plan = Plan(peers, now, policy)
    faster = sorted((p for p in peers if ranking.faster(p, me, now, policy)),
                    key=lambda p: realtime_key(p, now, policy))
    cheaper = sorted((p for p in peers if ranking.cheaper(p, me, now, policy)),
                     key=lambda p: background_key(p, now, policy))
    equals = sorted((p for p in peers if ranking.equal(p, me, now, policy)),
                    key=lambda p: p.site_id)
    urgent_until = deadline_at_risk(snapshot, now, policy)
    my_cost = site_health.effective_usd_per_mtok(me, now, policy)
    holders = [p for p in peers if p.sessions and site_health.effective_usd_per_mtok(
        p, now, policy) <= my_cost * (1 + policy.affinity_max_premium)]

    def mine(candidate: Candidate) -> bool:
        return candidate.model in snapshot.models and fits(me, candidate, now, policy)

    def urgent(candidate: Candidate) -> bool:
        return urgent_until is not None and candidate.deadline <= urgent_until

    def held_elsewhere(candidate: Candidate) -> bool:
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
        if held_elsewhere(candidate) or plan.give(faster, candidate):
            continue
        if mine(candidate):
            picked.append(candidate.request_id)
        else:
            plan.give(cheaper, candidate)
    shared = [c for c in background
              if urgent(c) or not (held_elsewhere(c) or plan.give(cheaper, c))]
    if me.price_schedule is not None:
        due = due_by(snapshot.backlog, policy) if snapshot.backlog else None
        fleet = site_health.expected_tokens_per_s(me, now, policy) + sum(
            site_health.expected_tokens_per_s(p, now, policy) for p in _peers(snapshot)
            if site_health.alive(p, now, policy))
        shared = [c for c in shared
                  if urgent(c) or not defers(me, c, due, fleet, now, policy)]
    share = fair_share(snapshot, len(picked), equals,
                       len(shared) + snapshot.background_beyond, now, policy)
    taken = 0
    for candidate in shared:
        if len(picked) >= snapshot.capacity:
            break
        if taken >= share and plan.give(equals, candidate):
            continue
        if mine(candidate):
            picked.append(candidate.request_id)
            taken += 1
    return picked


def fair_share(snapshot: Snapshot, num_picked: int, equals: list[SiteState], num_shared: int,
               now: float, policy: PlacementPolicy = DEFAULT_POLICY) -> int:
    if not equals:
        return num_shared
    me = snapshot.site

    def kept(site: SiteState) -> float:
        return 1.0 - site_health.loss_fraction(site, now, policy)

    held = me.in_flight + num_picked
    mine = (me.in_flight + snapshot.capacity) * kept(me)
    all_held = held + sum(p.in_flight for p in equals)
    everyone = mine + sum((p.in_flight + site_health.free_slots(p, now, policy)) * kept(p)
                          for p in equals)
    target = (num_shared + all_held) * mine / everyone if everyone > 0 else num_shared
    return max(0, math.ceil(target - held - 1e-9))
