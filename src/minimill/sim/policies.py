"""The three placement policies a run compares, over the control plane's own pure policy.

- naive: round-robin over the sites that ask, no forecasts, no prices.
- cost: placement's rankings (placement.background_key / realtime_key over site_health's
  effective $/Mtok and expected loss, at each site's flat price); a dearer site takes
  background work beyond what the cheaper sites with free room take, as placement.place
  hands it out (tests/sim/test_sim_vs_live.py checks that the two agree).
- forecast: as cost, plus announced outages (placement.finishes_before_outage: no work a site
  would not finish before handing back ahead of its outage; held work handed back in time)
  and price schedules (sites ranked at their price now; placement.defer_background leaves
  background work for cheaper hours that still meet its deadline). Realtime is never deferred.

Free sites wait in heaps ordered by those keys, re-ranked every replan; the expected
throughput of the live sites is kept as a running total (the fleet's rate, for
defer_background).
"""

from __future__ import annotations

import heapq
from collections import deque

from minimill.control import placement, ranking, site_health
from minimill.control.placement import Outage, PlacementPolicy, SiteState
from minimill.sim.world import SimSite

# The policy the live control plane runs: it always knows announced outages and price
# schedules (tests/sim/test_sim_vs_live.py compares the two).
LIVE_POLICY = "forecast"


class Policy:
    def __init__(self, name: str, sites: tuple[SimSite, ...], policy: PlacementPolicy) -> None:
        self.name, self.sites, self.policy = name, sites, policy
        self.uses_costs = name != "naive"
        self.uses_forecasts = name == "forecast"
        n = len(sites)
        self.token = [0] * n  # bumped at every push: older heap entries are stale
        self.free = [False] * n
        self.fifo: deque[tuple[int, int]] = deque()
        self.rt_heap: list[tuple[int, int, int]] = []
        self.bg_heap: list[tuple[int, int, int]] = []
        self.rt_rank = list(range(n))
        self.bg_rank = list(range(n))
        self.expected = [s.tokens_per_s for s in sites]
        self.live_rate = sum(s.tokens_per_s for s in sites)
        self.alive = [True] * n

    def state(self, site: SimSite, now: float, up_s: float, last_seen: float, granted: int,
              expired: int, outages: tuple[Outage, ...]) -> SiteState:
        """The site as the control plane would see it under this policy."""
        return SiteState(
            site_id=site.site_id, price_per_hour=site.price_per_hour,
            tokens_per_s=site.tokens_per_s, in_flight=0, last_seen_at=last_seen,
            outages=outages if self.uses_forecasts else (), first_seen_at=0.0, up_s=up_s,
            leases_granted=granted, leases_expired=expired, chip=site.chip,
            price_schedule=site.schedule if self.uses_forecasts else None)

    def _kinds(self, states: list[SiteState]) -> list[int]:
        """Sites of the same kind (ranking.same_kind: chip and price) are never cheaper than
        each other: each site's kind is the first site of its kind."""
        firsts: list[int] = []
        kind = []
        for i, s in enumerate(states):
            for f in firsts:
                if ranking.same_kind(states[f], s, self.policy):
                    kind.append(f)
                    break
            else:
                firsts.append(i)
                kind.append(i)
        return kind

    def rerank(self, states: list[SiteState], now: float) -> None:
        if not self.uses_costs:
            return
        own = [placement.background_key(s, now, self.policy) for s in states]
        kinds = self._kinds(states)
        best: dict[int, float] = {}
        for i, k in enumerate(kinds):
            best[k] = min(best.get(k, own[i][0]), own[i][0])
        # In background order by kind (the kind's cheapest site), then each site's own key.
        bg = [(best[kinds[i]], *own[i]) for i in range(len(states))]
        rt = [placement.realtime_key(s, now, self.policy) for s in states]
        bg_order = sorted(range(len(states)), key=bg.__getitem__)
        for rank, i in enumerate(bg_order):
            self.bg_rank[i] = rank
        for rank, i in enumerate(sorted(range(len(states)), key=rt.__getitem__)):
            self.rt_rank[i] = rank
        self.expected = [site_health.expected_tokens_per_s(s, now, self.policy) for s in states]
        self.live_rate = sum(e for e, up in zip(self.expected, self.alive, strict=True) if up)
        free = [i for i, f in enumerate(self.free) if f]
        self.rt_heap, self.bg_heap = [], []
        for i in free:
            self.free[i] = False
            self.push(i)

    def set_alive(self, i: int, up: bool) -> None:
        if self.alive[i] != up:
            self.alive[i] = up
            self.live_rate += self.expected[i] if up else -self.expected[i]
        if not up:
            self.free[i] = False

    def push(self, i: int) -> None:
        """Site `i` asks for work."""
        if self.free[i]:
            return
        self.free[i] = True
        self.token[i] += 1
        if self.uses_costs:
            heapq.heappush(self.rt_heap, (self.rt_rank[i], self.token[i], i))
            heapq.heappush(self.bg_heap, (self.bg_rank[i], self.token[i], i))
        else:
            self.fifo.append((self.token[i], i))

    def _valid(self, token: int, i: int) -> bool:
        return self.free[i] and self.token[i] == token

    def peek(self, realtime: bool) -> int | None:
        """The free site that goes first for this tier (not taken off the free set)."""
        if not self.uses_costs:
            while self.fifo and not self._valid(*self.fifo[0]):
                self.fifo.popleft()
            return self.fifo[0][1] if self.fifo else None
        heap = self.rt_heap if realtime else self.bg_heap
        while heap and not self._valid(heap[0][1], heap[0][2]):
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def take(self, i: int) -> None:
        self.free[i] = False

    def fleet_rate(self) -> float:
        return self.live_rate
