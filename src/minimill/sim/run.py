"""Run a scenario under every policy it names and report what each achieved, as one JSON
object (the figures `minimill sim --json` prints) and, optionally, PNG plots."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from minimill.sim import world as world_mod
from minimill.sim.engine import Simulation
from minimill.sim.scenario import Scenario
from minimill.sim.tally import Tally
from minimill.sim.world import HOUR_S, World


def _percentile(values: list[float], weights: list[int], q: float) -> float | None:
    """Weighted percentile: `weights[i]` requests finished after `values[i]` seconds."""
    if not values:
        return None
    v, w = np.asarray(values), np.asarray(weights, dtype=float)
    order = np.argsort(v)
    cumulative = np.cumsum(w[order])
    index = int(np.searchsorted(cumulative, q / 100.0 * cumulative[-1]))
    return round(float(v[order][min(index, len(v) - 1)]), 3)


def _hours_cost(world: World, until: float, count_down: bool) -> float:
    """What every site costs for its hours up to `until`: only those it was up (billing: up)
    or all of them (billing: always), at its flat $/h."""
    total = 0.0
    for site, downs in zip(world.sites, world.downs, strict=True):
        down = 0.0 if count_down else sum(max(min(d.end, until) - d.start, 0.0)
                                          for d in downs if d.start < until)
        total += site.price_per_hour * max(until - down, 0.0) / HOUR_S
    return total


def summarize(scenario: Scenario, world: World, tally: Tally, wall_s: float) -> dict[str, Any]:
    requests = scenario.num_requests
    span = max(tally.last_completion, 1e-9)
    cost = (tally.cost_usd if scenario.billing == "busy"
            else _hours_cost(world, span, count_down=scenario.billing == "always"))
    latency = [x for tier in tally.latency.values() for x in tier]
    weight = [x for tier in tally.weight.values() for x in tier]
    unfinished = requests - tally.completed
    return {
        "completed_requests": tally.completed,
        "unfinished_requests": unfinished,
        "goodput_tokens": round(tally.goodput_tokens),
        "goodput_tok_s": round(tally.goodput_tokens / span, 1),
        "wasted_tokens": round(tally.wasted_tokens),
        "cost_usd": round(cost, 2),
        "usd_per_mtok": round(cost / tally.goodput_tokens * 1e6, 5)
        if tally.goodput_tokens else None,
        "p50_completion_s": _percentile(latency, weight, 50),
        "p99_completion_s": _percentile(latency, weight, 99),
        "p99_realtime_s": _percentile(tally.latency.get("realtime", []),
                                      tally.weight.get("realtime", []), 99),
        "p99_background_s": _percentile(tally.latency.get("background", []),
                                        tally.weight.get("background", []), 99),
        "deadline_misses": tally.deadline_misses,
        "duplicate_completions": tally.duplicate_completions,
        "stale_completions": tally.stale_completions,
        "leases": tally.leases,
        "lease_expiries": tally.lease_expiries,
        "handbacks": tally.handbacks,
        "placed_in_announced_outage": tally.placed_in_announced_outage,
        "makespan_h": round(span / HOUR_S, 3),
        "sites_used": len(tally.site_tokens),
        "wall_seconds": round(wall_s, 2),
    }


def run(scenario: Scenario, progress: Callable[[str], None] | None = None,
        plots: Path | None = None) -> dict[str, Any]:
    """Simulate every policy of the scenario on one drawn world; the JSON report."""
    started = time.perf_counter()
    world = world_mod.build(scenario)
    if progress:
        progress(f"{len(world.sites)} sites, {scenario.num_requests} requests, "
                 f"{sum(len(d) for d in world.downs)} site outages drawn")
    policies: dict[str, Any] = {}
    tallies: dict[str, Tally] = {}
    lost = 0
    for name in scenario.policies:
        t0 = time.perf_counter()
        sim = Simulation(scenario, world, name)
        tally = sim.run()
        tallies[name] = tally
        policies[name] = summarize(scenario, world, tally, time.perf_counter() - t0)
        policies[name]["lost_requests"] = (scenario.num_requests - tally.completed
                                           - sim.in_system())
        lost += policies[name]["lost_requests"]
        if progress:
            p = policies[name]
            progress(f"{name}: {p['goodput_tok_s']} tok/s, ${p['usd_per_mtok']}/Mtok, "
                     f"p99 {p['p99_completion_s']} s, {p['deadline_misses']} deadline "
                     f"misses ({p['wall_seconds']} s)")
    report = {
        "scenario": scenario.name,
        "sites": len(world.sites),
        "requests": scenario.num_requests,
        "wall_seconds": round(time.perf_counter() - started, 2),
        # Requests neither completed nor still queued or held when the run stopped: dropped
        # by the control plane. Must be 0 (unfinished_requests, per policy, are still held).
        "lost_requests": lost,
        "duplicate_completions": sum(t.duplicate_completions for t in tallies.values()),
        "policies": policies,
    }
    if plots is not None:
        from minimill.sim.plots import write_plots

        report["plots"] = [str(p) for p in write_plots(plots, scenario.name, policies,
                                                       tallies)]
    return report
