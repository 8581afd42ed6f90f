"""Work as the simulator moves it: pieces of identical requests (one workload, one arrival,
one deadline), leased to sites in chunks. A piece carries the lease state of its requests
(control/lease_rules.LeaseRecord), and moves through the same transitions as a store row."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from minimill.control.lease_rules import LeaseRecord
from minimill.control.records import RequestStatus, Tier

# Background tokens due are counted per deadline rounded down to this (earlier: safe side),
# so that deadline risk sorts a few hundred deadlines, not one per agent turn.
DUE_BUCKET_S = 300.0
_ids = itertools.count()


@dataclass(slots=True, eq=False)
class Piece:
    workload: int
    n: int  # requests in it
    tokens: int  # output tokens of each request
    remaining: float  # tokens each still needs (its checkpoint keeps the rest)
    tier: Tier
    arrival: float
    deadline: float
    cohort: int = -1  # agent sessions simulated together (-1: none)
    record: LeaseRecord = field(default_factory=lambda: LeaseRecord(RequestStatus.QUEUED))
    done: bool = False
    pid: int = field(default_factory=lambda: next(_ids))

    @property
    def work(self) -> float:
        return self.n * self.remaining

    @property
    def splittable(self) -> bool:
        """Never leased: it may be cut into parts (a leased one stays whole, so that a late
        completion from its old holder is fenced against exactly what it held)."""
        return self.record.epoch == 0


@dataclass(slots=True, eq=False)
class Chunk:
    """What one lease call gave a site: pieces, each at the epoch it was granted. The site runs
    them together, each request at an equal share of its rate (as a batching engine does), so
    shorter requests finish first: `finish` says when each piece does."""

    site: int
    pieces: list[tuple[Piece, int, float]]  # (piece, epoch, remaining tokens each at grant)
    finish: list[float]  # when each piece finishes, ascending
    start: float
    end: float
    price_per_hour: float
    failed_at: float | None = None  # the site went dark (dead or cut off)
    partition: bool = False  # cut off, still computing: its completion arrives late
    closed: bool = False  # completed, released or expired

    @property
    def seconds(self) -> float:
        return self.end - self.start


class WorkQueue:
    """Queued pieces: realtime in arrival order, background by deadline then arrival. Pieces
    completed while queued (a late completion accepted) are skipped lazily."""

    def __init__(self) -> None:
        self.realtime: deque[Piece] = deque()
        self.background: list[tuple[float, int, Piece]] = []
        self.due: dict[float, float] = {}  # background tokens queued or held, by deadline

    def count_due(self, piece: Piece, tokens: float) -> None:
        if piece.tier == Tier.REALTIME:
            return
        key = piece.deadline - piece.deadline % DUE_BUCKET_S
        left = self.due.get(key, 0.0) + tokens
        if left <= 1e-6:
            self.due.pop(key, None)
        else:
            self.due[key] = left

    def push(self, piece: Piece) -> None:
        if piece.tier == Tier.REALTIME:
            self.realtime.append(piece)
        else:
            heapq.heappush(self.background, (piece.deadline, piece.pid, piece))

    def head(self, tier: Tier) -> Piece | None:
        if tier == Tier.REALTIME:
            while self.realtime and self.realtime[0].done:
                self.realtime.popleft()
            return self.realtime[0] if self.realtime else None
        while self.background and self.background[0][2].done:
            heapq.heappop(self.background)
        return self.background[0][2] if self.background else None

    def take(self, tier: Tier, budget: float, first: bool) -> Piece | None:
        """The head piece of `tier`, or as much of it as `budget` tokens hold (at least one
        request when `first`: a lease call gets something); None when nothing fits."""
        piece = self.head(tier)
        if piece is None:
            return None
        if piece.work <= budget or (first and not piece.splittable):
            self._pop(tier)
            return piece
        if not piece.splittable:
            return None
        count = int(budget // piece.remaining)
        if count <= 0:
            if not first:
                return None
            count = 1
        if count >= piece.n:
            self._pop(tier)
            return piece
        part = Piece(piece.workload, count, piece.tokens, piece.remaining, piece.tier,
                     piece.arrival, piece.deadline, piece.cohort)
        piece.n -= count
        return part

    def _pop(self, tier: Tier) -> None:
        if tier == Tier.REALTIME:
            self.realtime.popleft()
        else:
            heapq.heappop(self.background)

    def due_by(self, deadline: float) -> float:
        return sum(v for k, v in self.due.items() if k <= deadline)


def shared_finish_times(start: float, tokens_per_s: float,
                        remaining: list[tuple[int, float]]) -> list[float]:
    """Finish times of groups of (requests, tokens each), ascending by tokens, run together
    at `tokens_per_s` shared equally among the requests still running."""
    times, t, running, done_each = [], start, sum(n for n, _ in remaining), 0.0
    for n, tokens in remaining:
        t += (tokens - done_each) * running / tokens_per_s
        times.append(t)
        running -= n
        done_each = tokens
    return times
