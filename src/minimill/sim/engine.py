"""The discrete-event loop: a virtual clock (a heap of events), the world's failures, the
workloads' arrivals, and lease calls answered by a policy (policies.py). Every lease moves
through control/lease_rules: grant, heartbeat (extend, up to the moment a site goes dark),
expire, release (handback ahead of an announced outage) and complete at the granted epoch, so
a cut-off site's late completion is fenced exactly as the store fences it."""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import replace
from typing import Any

from minimill.control import lease_rules, placement
from minimill.control.lease_rules import LeaseRecord
from minimill.control.placement import DEFAULT_POLICY, Outage
from minimill.control.records import RequestStatus, Tier
from minimill.sim.arrivals import Arrivals
from minimill.sim.policies import Policy
from minimill.sim.scenario import Scenario
from minimill.sim.tally import Tally
from minimill.sim.work import Chunk, Piece, WorkQueue, shared_finish_times
from minimill.sim.world import HOUR_S, World

# Event kinds, in the order they are handled at one instant.
DOWN, UP, EXPIRE, DONE, RELEASE, ANNOUNCE, ARRIVE, TICK = range(8)
# A lease call shorter than this (before an outage) is not worth making.
MIN_LEASE_S = 30.0


class Simulation:
    def __init__(self, scenario: Scenario, world: World, policy_name: str) -> None:
        self.scenario, self.world = scenario, world
        self.policy = replace(DEFAULT_POLICY, alive_within_s=scenario.lease_ttl_s,
                              handback_lead_s=max(DEFAULT_POLICY.handback_lead_s,
                                                  scenario.lease_ttl_s / 3 + 1.0))
        self.p = Policy(policy_name, world.sites, self.policy)
        self.now = 0.0
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = itertools.count()
        self.queue = WorkQueue()
        self.tally = Tally()
        n = len(world.sites)
        self.up = [True] * n
        self.holding: list[Chunk | None] = [None] * n
        self.down_total = [0.0] * n
        self.down_since = [0.0] * n
        self.granted = [0] * n
        self.expired = [0] * n
        self.known: dict[str, list[Outage]] = {r: [] for r in world.region_sites}
        self.outstanding = scenario.num_requests
        self.arrivals = Arrivals(scenario)
        self.slowest_tokens_per_s = min(s.tokens_per_s for s in world.sites)

    # -- events -----------------------------------------------------------------------------
    def at(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self.events, (t, kind, next(self.seq), payload))

    def schedule_world(self) -> None:
        for i, downs in enumerate(self.world.downs):
            for d in downs:
                self.at(d.start, DOWN, (i, d.partition))
                self.at(d.end, UP, i)
        if self.p.uses_forecasts:
            for region, forecasts in self.world.forecasts.items():
                for f in forecasts:
                    self.at(f.announced_at, ANNOUNCE, (region, Outage(f.start, f.end)))
        step = min(self.scenario.replan_s, HOUR_S)
        t = 0.0
        while t <= self.world.horizon_s + self.scenario.drain_h * HOUR_S:
            self.at(t, TICK, None)
            t += step
        for t, piece in self.arrivals.initial():
            self.at(t, ARRIVE, piece)

    def run(self) -> Tally:
        self.schedule_world()
        self._replan()
        for i in range(len(self.world.sites)):
            self.p.push(i)
        handlers = (self._down, self._up, self._expire, self._done, self._release,
                    self._announce, self._arrive, self._tick)
        limit = self.world.horizon_s + self.scenario.drain_h * HOUR_S
        while self.events and self.outstanding > 0:
            t, kind, _, payload = heapq.heappop(self.events)
            if t > limit:
                break
            self.now = t
            handlers[kind](payload)
            if kind in (UP, DONE, RELEASE, ARRIVE, TICK, EXPIRE):
                self._dispatch()
        return self.tally

    # -- world ------------------------------------------------------------------------------
    def _down(self, payload: tuple[int, bool]) -> None:
        i, partition = payload
        self.up[i] = False
        self.down_since[i] = self.now
        self.p.set_alive(i, False)
        chunk = self.holding[i]
        if chunk is not None and not chunk.closed and chunk.failed_at is None:
            chunk.failed_at, chunk.partition = self.now, partition
            if not partition:  # dead: it stops computing now
                self._pay(chunk, self.now)
            self.at(self.now + self.scenario.lease_ttl_s + 1e-3, EXPIRE, chunk)

    def _up(self, i: int) -> None:
        self.up[i] = True
        self.down_total[i] += self.now - self.down_since[i]
        self.p.set_alive(i, True)
        chunk = self.holding[i]
        if chunk is not None and chunk.failed_at is not None and chunk.partition \
                and chunk.end > self.now:
            return  # still computing the work it was cut off with
        self.holding[i] = None
        self.p.push(i)

    def _announce(self, payload: tuple[str, Outage]) -> None:
        """A forecast outage of a region: its sites hand back what they would not finish."""
        region, outage = payload
        self.known[region].append(outage)
        cutoff = outage.start_at - self.policy.handback_lead_s
        for i in self.world.region_sites[region]:
            chunk = self.holding[i]
            if chunk is not None and not chunk.closed and chunk.end > cutoff:
                self.at(max(self.now, cutoff), RELEASE, chunk)

    def _tick(self, _: None) -> None:
        if self.now % self.scenario.replan_s < 1e-6 or self.p.uses_forecasts:
            self._replan()
        for region, outages in self.known.items():
            self.known[region] = [o for o in outages if o.end_at > self.now]
        for i in range(len(self.world.sites)):  # sleeping sites ask again
            if self.up[i] and self.holding[i] is None:
                self.p.push(i)

    def _outages(self, i: int) -> tuple[Outage, ...]:
        return tuple(self.known[self.world.sites[i].region])

    def _replan(self) -> None:
        if not self.p.uses_costs:
            return
        states = []
        for site in self.world.sites:
            i = site.index
            down_now = 0.0 if self.up[i] else self.now - self.down_since[i]
            up_s = max(self.now - self.down_total[i] - down_now, 0.0)
            states.append(self.p.state(site, self.now, up_s,
                                       self.now if self.up[i] else self.down_since[i],
                                       self.granted[i], self.expired[i], self._outages(i)))
        self.p.rerank(states, self.now)

    # -- work -------------------------------------------------------------------------------
    def _arrive(self, piece: Piece) -> None:
        self.queue.push(piece)
        self.queue.count_due(piece, piece.work)

    def _dispatch(self) -> None:
        q = self.queue
        while q.head(Tier.REALTIME) is not None:
            i = self.p.peek(realtime=True)
            if i is None or not self._lease(i, Tier.REALTIME):
                break
        while q.head(Tier.BACKGROUND) is not None:
            i = self.p.peek(realtime=False)
            # As placement.place: a dearer site takes what the cheaper free sites before it
            # in this order left (a cheaper one that defers its work holds it up for all).
            if i is None or not self._lease(i, Tier.BACKGROUND):
                break

    def _deferred(self, i: int, piece: Piece) -> bool:
        """Would site `i` leave `piece` for a cheaper hour of its price schedule that still
        meets the deadline of all the work due by the piece's (at the fleet's rate, then the
        last lease's span: a lease is not shared between sites)?"""
        site = self.world.sites[i]
        if not self.p.uses_forecasts or site.schedule is None or piece.tier == Tier.REALTIME:
            return False
        state = self.p.state(site, self.now, self.now, self.now, 0, 0, ())
        fleet = self.p.fleet_rate()
        work_s = self.queue.due_by(piece.deadline) / fleet if fleet > 0 else math.inf
        # A lease call's work spans at most lease_work_s, or one request alone at the
        # slowest site's rate when a single one is longer (a lease gets at least one).
        tail_s = max(self.scenario.lease_work_s, piece.remaining / self.slowest_tokens_per_s)
        return placement.defer_background(state, piece.deadline, work_s, self.now, self.policy,
                                          tail_s)

    def _lease_seconds(self, i: int) -> float:
        seconds = self.scenario.lease_work_s
        if not self.p.uses_forecasts or not self.known[self.world.sites[i].region]:
            return seconds
        state = self.p.state(self.world.sites[i], self.now, self.now, self.now, 0, 0,
                             self._outages(i))
        while seconds >= MIN_LEASE_S and not placement.finishes_before_outage(
                state, self.now, seconds, self.policy):
            seconds /= 2
        return seconds if seconds >= MIN_LEASE_S else 0.0

    def _lease(self, i: int, tier: Tier) -> bool:
        """Site `i` asks for work of `tier`; False when it took none (it sleeps)."""
        self.p.take(i)
        site = self.world.sites[i]
        seconds = self._lease_seconds(i)
        if seconds <= 0:
            return True  # draining ahead of an outage: asleep until the next tick
        if self.p.uses_forecasts and any(o.start_at <= self.now < o.end_at
                                         for o in self._outages(i)):
            self.tally.placed_in_announced_outage += 1
        budget = site.tokens_per_s * seconds
        pieces: list[tuple[Piece, int, float]] = []
        work = 0.0
        while budget > 0:
            head = self.queue.head(tier)
            if head is None or self._deferred(i, head):
                break  # what is left waits for a cheaper hour (realtime never does)
            piece = self.queue.take(tier, budget, first=not pieces)
            if piece is None:
                break
            record = lease_rules.grant(piece.record, site.site_id, self.now,
                                       self.scenario.lease_ttl_s)
            assert record is not None, "a queued piece is always grantable"
            piece.record = record
            pieces.append((piece, record.epoch, piece.remaining))
            self.tally.placed[(site.site_id, tier.value)] += piece.n
            work += piece.work
            budget -= piece.work
        if not pieces:
            self.p.push(i)
            return False
        pieces.sort(key=lambda x: x[2])
        finish = shared_finish_times(self.now, site.tokens_per_s,
                                     [(p.n, remaining) for p, _, remaining in pieces])
        price = site.schedule.price_at(self.now) if site.schedule else site.price_per_hour
        chunk = Chunk(i, pieces, finish, self.now, finish[-1], price or site.price_per_hour)
        self.holding[i] = chunk
        self.granted[i] += len(pieces)
        self.tally.leases += len(pieces)
        for k, t in enumerate(finish):
            self.at(t, DONE, (chunk, k))
        return True

    def _pay(self, chunk: Chunk, until: float) -> None:
        seconds = max(until - chunk.start, 0.0)
        cost = chunk.price_per_hour * seconds / HOUR_S
        self.tally.cost_usd += cost
        self.tally.cost_by_hour[int(chunk.start // HOUR_S)] += cost

    def _progress(self, chunk: Chunk, until: float, checkpointed: bool) -> float:
        """Fraction of the chunk's work kept at `until` (by its last checkpoint, or all of it
        when it hands back with a fresh checkpoint)."""
        elapsed = max(until - chunk.start, 0.0)
        if checkpointed:
            interval = self.scenario.checkpoint_interval_s
            elapsed = math.floor(elapsed / interval) * interval
        return min(elapsed / chunk.seconds, 1.0) if chunk.seconds > 0 else 1.0

    def _requeue(self, chunk: Chunk, kept: float, record_of: Any) -> None:
        rate = self.world.sites[chunk.site].tokens_per_s
        computed = (min(chunk.failed_at or self.now, chunk.end) - chunk.start) * rate
        self.tally.wasted_tokens += max(computed - kept * chunk.seconds * rate, 0.0)
        for piece, epoch, remaining in chunk.pieces:
            record = None if piece.done else record_of(piece, epoch)
            if record is None:
                continue
            piece.record = record
            left = max(remaining * (1.0 - kept), 1.0)
            self.queue.count_due(piece, piece.n * (left - remaining))
            piece.remaining = left
            self.queue.push(piece)

    def _expire(self, chunk: Chunk) -> None:
        """The cut-off site's leases run out: back to the queue with their checkpoints."""
        if chunk.closed:
            return
        failed = chunk.failed_at if chunk.failed_at is not None else self.now
        site_id = self.world.sites[chunk.site].site_id
        ttl = self.scenario.lease_ttl_s
        # Its last heartbeat was when it went dark; the lease ran out one TTL later.
        def expire(piece: Piece, epoch: int) -> LeaseRecord | None:
            beat = lease_rules.extend(piece.record, site_id, epoch, failed, ttl)
            return lease_rules.expire(beat or piece.record, self.now)

        self.expired[chunk.site] += len(chunk.pieces)
        self.tally.lease_expiries += len(chunk.pieces)
        kept = self._progress(chunk, failed, checkpointed=True)
        if chunk.partition:
            # It computes on, unseen; its completion will be fenced. Waste counted then.
            for piece, epoch, remaining in chunk.pieces:
                record = None if piece.done else expire(piece, epoch)
                if record is not None:
                    piece.record = record
                    left = max(remaining * (1.0 - kept), 1.0)
                    self.queue.count_due(piece, piece.n * (left - remaining))
                    piece.remaining = left
                    self.queue.push(piece)
            return
        chunk.closed = True
        self._requeue(chunk, kept, expire)

    def _release(self, chunk: Chunk) -> None:
        """Handback ahead of an announced outage: checkpoint and release, nothing lost."""
        if chunk.closed or chunk.failed_at is not None:
            return
        chunk.closed = True
        site_id = self.world.sites[chunk.site].site_id
        self._pay(chunk, self.now)
        self.tally.handbacks += len(chunk.pieces)
        self._requeue(chunk, self._progress(chunk, self.now, checkpointed=False),
                      lambda piece, epoch: lease_rules.release(piece.record, site_id, epoch))
        self.holding[chunk.site] = None
        if self.up[chunk.site]:
            self.p.push(chunk.site)

    def _done(self, payload: tuple[Chunk, int]) -> None:
        """One piece of a chunk finishes; its completion carries the epoch it was granted."""
        chunk, k = payload
        if chunk.closed and not chunk.partition:
            return
        if chunk.failed_at is not None and not chunk.partition:
            return
        i = chunk.site
        site = self.world.sites[i]
        piece, epoch, remaining = chunk.pieces[k]
        result = lease_rules.complete(piece.record, site.site_id, epoch)
        if not isinstance(result, LeaseRecord):
            self.tally.stale_completions += 1
            self.tally.wasted_tokens += piece.n * remaining
        elif piece.done:
            self.tally.duplicate_completions += piece.n
        else:
            piece.record, piece.done = result, True
            self._completed(piece, i)
        if k < len(chunk.pieces) - 1:
            return
        self._pay(chunk, self.now)
        chunk.closed = True
        if self.holding[i] is chunk:
            self.holding[i] = None
            if self.up[i]:
                self.p.push(i)

    def _completed(self, piece: Piece, i: int) -> None:
        t = self.tally
        assert piece.record.status == RequestStatus.SUCCEEDED
        self.queue.count_due(piece, -piece.n * piece.remaining)
        t.completed += piece.n
        self.outstanding -= piece.n
        tokens = piece.n * piece.tokens
        t.goodput_tokens += tokens
        t.tokens_by_hour[int(self.now // HOUR_S)] += tokens
        t.site_tokens[i] += tokens
        t.last_completion = max(t.last_completion, self.now)
        tier = "realtime" if piece.tier == Tier.REALTIME else "background"
        t.latency[tier].append(self.now - piece.arrival)
        t.weight[tier].append(piece.n)
        if piece.tier != Tier.REALTIME and self.now > piece.deadline + 1e-6:
            t.deadline_misses += piece.n
        following = self.arrivals.answered(piece, self.now)
        if following is not None:
            self.at(following[0], ARRIVE, following[1])

    def in_system(self) -> int:
        """Requests not completed that the run still holds when it stops: queued, leased,
        waiting to arrive, or agent turns not asked yet. With the completed ones they must
        add up to every request of the scenario: anything else was lost."""
        pieces: dict[int, Piece] = {}
        for piece in self.queue.realtime:
            pieces[piece.pid] = piece
        for _, _, piece in self.queue.background:
            pieces[piece.pid] = piece
        chunks = [c for c in self.holding if c is not None]
        for _, kind, _, payload in self.events:
            if kind == DONE:
                chunks.append(payload[0])
            elif kind in (EXPIRE, RELEASE):
                chunks.append(payload)
            elif kind == ARRIVE and payload.cohort < 0:
                pieces[payload.pid] = payload
        for chunk in chunks:
            if not chunk.closed:
                for piece, _, _ in chunk.pieces:
                    pieces[piece.pid] = piece
        held = sum(p.n for p in pieces.values() if not p.done and p.cohort < 0)
        return held + self.arrivals.pending_agent_requests()
