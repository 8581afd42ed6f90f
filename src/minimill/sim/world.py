"""The simulated world of a scenario: its sites, when each is down (independent failures and
regional weather outages), and which outages were forecast (announced ahead). Drawn once from
the scenario's seed, so every policy of one run faces the same failures."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minimill.control.price_schedule import PriceSchedule
from minimill.sim.scenario import Scenario

HOUR_S = 3600.0


@dataclass(frozen=True, slots=True)
class SimSite:
    index: int
    site_id: str
    group: int
    chip: str
    region: str
    tokens_per_s: float  # the whole site's busy rate
    price_per_hour: float  # the site's flat $/h (its profile's mean times its base price)
    schedule: PriceSchedule | None  # hourly $/h, when its region's price moves


@dataclass(frozen=True, slots=True)
class Down:
    start: float
    end: float
    partition: bool  # cut off but computing: its late completions arrive (and are fenced)


@dataclass(frozen=True, slots=True)
class Forecast:
    announced_at: float
    start: float
    end: float
    real: bool  # False: a false alarm


@dataclass(frozen=True, slots=True)
class World:
    sites: tuple[SimSite, ...]
    downs: tuple[tuple[Down, ...], ...]  # per site, sorted, not overlapping
    forecasts: dict[str, tuple[Forecast, ...]]  # per region, by announce time
    region_sites: dict[str, tuple[int, ...]]
    horizon_s: float


def _merge(spans: list[Down]) -> tuple[Down, ...]:
    merged: list[Down] = []
    for d in sorted(spans, key=lambda d: d.start):
        if merged and d.start <= merged[-1].end:
            last = merged[-1]
            merged[-1] = Down(last.start, max(last.end, d.end), last.partition and d.partition)
        else:
            merged.append(d)
    return tuple(merged)


def build(scenario: Scenario) -> World:
    rng = np.random.default_rng(scenario.seed)
    horizon = scenario.duration_h * HOUR_S
    # Failures and weather go on while the run drains its work after the arrivals stop.
    until = (scenario.duration_h + scenario.drain_h) * HOUR_S
    forecasts: dict[str, tuple[Forecast, ...]] = {}
    weather: dict[str, list[Down]] = {}
    for name, region in scenario.regions.items():
        w = region.weather
        count = rng.poisson(w.outages_per_day * until / HOUR_S / 24.0)
        starts = np.sort(rng.uniform(0, until, count))
        lengths = rng.exponential(w.mean_hours * HOUR_S, count)
        weather[name] = [Down(float(s), float(s + n), False) for s, n in zip(starts, lengths,
                                                                             strict=True)]
        lead = w.lead_h * HOUR_S
        told = [Forecast(max(d.start - lead, 0.0), d.start, d.end, True) for d in weather[name]
                if rng.random() < w.forecast_accuracy]
        # A forecast of accuracy a misses (1 - a) of the outages and raises as many false
        # alarms, of the same length distribution.
        false_count = rng.binomial(count, 1.0 - w.forecast_accuracy) if count else 0
        for s, n in zip(rng.uniform(0, until, false_count),
                        rng.exponential(w.mean_hours * HOUR_S, false_count), strict=True):
            told.append(Forecast(max(float(s) - lead, 0.0), float(s), float(s + n), False))
        # Planned outages come on top of the drawn weather (and draw nothing from the rng).
        for planned in region.outages:
            start, end = planned.start_h * HOUR_S, planned.end_h * HOUR_S
            weather[name].append(Down(start, end, False))
            told.append(Forecast(planned.announced_h * HOUR_S, start, end, True))
        forecasts[name] = tuple(sorted(told, key=lambda f: f.announced_at))
    sites: list[SimSite] = []
    downs: list[tuple[Down, ...]] = []
    region_sites: dict[str, list[int]] = {name: [] for name in scenario.regions}
    for g, group in enumerate(scenario.groups):
        chip = scenario.chips[group.chip]
        region = scenario.regions[group.region]
        base = chip.usd_per_hour * group.chips * group.price_factor
        profile = region.price_profile
        schedule = None if profile is None else PriceSchedule(
            0.0, tuple(base * m for m in profile))
        flat = base if profile is None else base * float(np.mean(profile))
        mean_down = group.mean_repair_h * HOUR_S
        mean_up = mean_down * group.uptime / max(1.0 - group.uptime, 1e-9)
        for _ in range(group.count):
            index = len(sites)
            sites.append(SimSite(index, f"site-{index:05d}", g, group.chip, group.region,
                                 chip.tokens_per_s * group.chips, flat, schedule))
            region_sites[group.region].append(index)
            spans = list(weather[group.region])
            if group.uptime < 1.0:
                # Alternating up and down spells, starting at a random phase of an up spell.
                t = -rng.exponential(mean_up) * rng.random()
                while t < until:
                    t += rng.exponential(mean_up)
                    length = rng.exponential(mean_down)
                    if t < until and t + length > 0:
                        spans.append(Down(max(t, 0.0), t + length,
                                          bool(rng.random() < group.partition_share)))
                    t += length
            downs.append(_merge(spans))
    return World(tuple(sites), tuple(downs), forecasts,
                 {k: tuple(v) for k, v in region_sites.items()}, horizon)
