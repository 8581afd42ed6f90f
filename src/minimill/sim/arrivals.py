"""When work arrives: batches at once, realtime streams in bins (a multinomial draw of the
stream's requests), and agent sessions turn after turn (a cohort's next turn is asked a
think time after its last answer)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from minimill.control.records import Tier
from minimill.sim.scenario import Scenario
from minimill.sim.work import Piece
from minimill.sim.world import HOUR_S


class Arrivals:
    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.rng = np.random.default_rng(scenario.seed + 1)
        self.turns_left: dict[tuple[int, int], int] = {}  # per (workload, cohort), this one too
        self.turn_open: dict[tuple[int, int], int] = {}  # requests of the turn not answered

    def initial(self) -> list[tuple[float, Piece]]:
        """Every arrival known in advance, and each agent cohort's first turn."""
        s = self.scenario
        found: list[tuple[float, Piece]] = []
        for w_i, w in enumerate(s.workloads):
            start = w.arrive_h * HOUR_S
            if w.kind == "batch":
                found.append((start, Piece(w_i, w.requests, w.tokens, w.tokens,
                                           Tier.BACKGROUND, start,
                                           start + w.deadline_h * HOUR_S)))
            elif w.kind == "realtime":
                total = round(w.requests_per_s * (w.end_h - w.arrive_h) * HOUR_S)
                bins = max(1, math.ceil((w.end_h - w.arrive_h) * HOUR_S / s.arrival_bin_s))
                counts: Any = self.rng.multinomial(total, [1.0 / bins] * bins) if total else []
                for b, count in enumerate(counts):
                    if count:
                        t = start + b * s.arrival_bin_s
                        found.append((t, Piece(w_i, int(count), w.tokens, w.tokens,
                                               Tier.REALTIME, t, t + s.lease_ttl_s)))
            else:
                for c in range(math.ceil(w.sessions / w.cohort)):
                    self.turns_left[(w_i, c)] = w.turns
                    t = start + float(self.rng.uniform(0, max(w.think_s, 1.0)))
                    found.append((t, self._turn(w_i, c, t)))
        return found

    def _size(self, key: tuple[int, int]) -> int:
        w = self.scenario.workloads[key[0]]
        return min(w.cohort, w.sessions - key[1] * w.cohort)

    def _turn(self, w_i: int, cohort: int, t: float) -> Piece:
        w = self.scenario.workloads[w_i]
        size = self._size((w_i, cohort))
        self.turn_open[(w_i, cohort)] = size
        return Piece(w_i, size, w.tokens, w.tokens, Tier.BACKGROUND, t, t + w.turn_deadline_s,
                     cohort)

    def answered(self, piece: Piece, now: float) -> tuple[float, Piece] | None:
        """`piece` was completed at `now`: its cohort's next turn, once the whole turn is."""
        if piece.cohort < 0:
            return None
        key = (piece.workload, piece.cohort)
        self.turn_open[key] -= piece.n
        if self.turn_open[key] > 0:
            return None
        self.turns_left[key] -= 1
        if self.turns_left[key] <= 0:
            return None
        t = now + self.scenario.workloads[piece.workload].think_s
        return t, self._turn(piece.workload, piece.cohort, t)

    def pending_agent_requests(self) -> int:
        """Agent requests not answered yet: the open turn's rest and the turns to come."""
        return sum((left - 1) * self._size(key) + self.turn_open[key]
                   for key, left in self.turns_left.items() if left > 0)
