"""Placement policy: which queued requests a site that asks for work gets.

A pure function of (state snapshot, clock): no I/O, no `time.time()`. The live control plane
(leases.py builds the snapshot from the store) and a simulator driving a virtual clock call the
same code. Rules:
- realtime before background; FIFO (arrival order) within realtime;
- background by earliest deadline, then arrival order (batches with longer windows wait);
- a site never gets a request it would not finish before its next announced outage, and none
  at all during one (it drains ahead of time);
- the snapshot carries every site's state so that cost- and reliability-aware rules can compare
  the asking site with the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(frozen=True, slots=True)
class Outage:
    start_at: float
    end_at: float


@dataclass(frozen=True, slots=True)
class SiteState:
    site_id: str
    price_per_hour: float
    tokens_per_s: float | None  # measured output tokens/s of the whole site
    in_flight: int  # requests it holds leases on
    last_seen_at: float | None
    outages: tuple[Outage, ...] = ()
    free_capacity: int = 0  # what its worker last said it could still take

    def current_or_next_outage(self, now: float) -> Outage | None:
        upcoming = [o for o in self.outages if o.end_at > now]
        return min(upcoming, key=lambda o: o.start_at) if upcoming else None


@dataclass(frozen=True, slots=True)
class Snapshot:
    site: SiteState  # the site asking for work
    capacity: int  # how many more requests it can take now
    models: frozenset[str]  # models its engine serves
    candidates: tuple[Candidate, ...]
    sites: tuple[SiteState, ...] = field(default=())  # every registered site


@dataclass(frozen=True, slots=True)
class PlacementPolicy:
    # Conservative generation speed of one request, for "will it finish before the outage".
    stream_tokens_per_s: float = 2.0
    # Tokens assumed for a request without max_tokens.
    default_remaining_tokens: int = 512

    def estimated_seconds(self, candidate: Candidate) -> float:
        tokens = candidate.remaining_tokens
        if tokens is None:
            tokens = self.default_remaining_tokens
        return max(tokens, 1) / self.stream_tokens_per_s


DEFAULT_POLICY = PlacementPolicy()


def place(snapshot: Snapshot, now: float, policy: PlacementPolicy = DEFAULT_POLICY) -> list[str]:
    """Request ids to lease to `snapshot.site`, best first, at most `snapshot.capacity`."""
    if snapshot.capacity <= 0:
        return []
    outage = snapshot.site.current_or_next_outage(now)
    if outage is not None and outage.start_at <= now:
        return []
    servable = [c for c in snapshot.candidates if c.model in snapshot.models]
    realtime = sorted((c for c in servable if c.tier == Tier.REALTIME), key=lambda c: c.seq)
    background = sorted((c for c in servable if c.tier != Tier.REALTIME),
                        key=lambda c: (c.deadline, c.seq))
    picked: list[str] = []
    for candidate in (*realtime, *background):
        if len(picked) >= snapshot.capacity:
            break
        if outage is not None and now + policy.estimated_seconds(candidate) > outage.start_at:
            continue
        picked.append(candidate.request_id)
    return picked
