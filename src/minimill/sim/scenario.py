"""Scenarios: a fleet (chips, regions with weather and price profiles, groups of sites) and
its workloads, read from YAML. Plain frozen records; `load` checks every field and says which
one is wrong."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

POLICIES = ("naive", "cost", "forecast")
MAX_SITES = 10_000


class ScenarioError(ValueError):
    """A scenario file that cannot be run; the message names the field."""


@dataclass(frozen=True, slots=True)
class Chip:
    name: str
    tokens_per_s: float  # busy output tokens/s of one chip
    usd_per_hour: float  # what one chip-hour costs


@dataclass(frozen=True, slots=True)
class Weather:
    outages_per_day: float = 0.0  # regional outages (storm, no sun, no wind), Poisson
    mean_hours: float = 2.0  # their mean length (exponential)
    forecast_accuracy: float = 0.0  # share of outages announced ahead; as many false alarms
    lead_h: float = 6.0  # how far ahead a forecast is announced


@dataclass(frozen=True, slots=True)
class PlannedOutage:
    """An outage of a whole region known ahead (maintenance, a grid operator's notice): down
    from start_h to end_h, announced at announced_h (the forecast policy hears of it then)."""

    start_h: float
    end_h: float
    announced_h: float = 0.0


@dataclass(frozen=True, slots=True)
class Region:
    name: str
    weather: Weather = Weather()
    price_profile: tuple[float, ...] | None = None  # hourly multipliers of $/h (UTC hours)
    outages: tuple[PlannedOutage, ...] = ()


@dataclass(frozen=True, slots=True)
class SiteGroup:
    count: int
    chip: str
    region: str
    chips: int = 1  # chips per site
    uptime: float = 0.95  # independent availability (weather outages come on top)
    mean_repair_h: float = 2.0  # mean length of an independent failure
    price_factor: float = 1.0  # times the chip's $/h
    partition_share: float = 0.0  # failures in which the site keeps computing, cut off


@dataclass(frozen=True, slots=True)
class Workload:
    kind: str  # batch | realtime | agent
    tokens: int  # output tokens per request
    requests: int = 0  # batch: how many
    arrive_h: float = 0.0  # batch: when it arrives; realtime: start
    deadline_h: float = 24.0  # batch: completion window
    requests_per_s: float = 0.0  # realtime
    end_h: float = 0.0  # realtime: end of the stream
    sessions: int = 0  # agent
    turns: int = 0  # agent: requests per session, one after the other
    think_s: float = 30.0  # agent: pause between a turn's answer and the next turn
    turn_deadline_s: float = 600.0  # agent: each turn is due this long after it is asked
    cohort: int = 100  # agent: sessions simulated together (same timing)


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    chips: dict[str, Chip]
    regions: dict[str, Region]
    groups: tuple[SiteGroup, ...]
    workloads: tuple[Workload, ...]
    seed: int = 1
    duration_h: float = 24.0  # arrivals and failures happen within it
    drain_h: float = 72.0  # after it, the run continues until the work is done, at most this
    lease_ttl_s: float = 60.0
    lease_work_s: float = 300.0  # a site's lease call asks for this many seconds of its work
    checkpoint_interval_s: float = 60.0
    replan_s: float = 1800.0  # how often site health and rankings are refreshed
    arrival_bin_s: float = 10.0  # realtime arrivals are grouped per bin
    # busy: a site costs while it holds work (hours bought as needed); up: while it is up
    # (power and staff only when running); always: every hour (owned capacity).
    billing: str = "busy"
    policies: tuple[str, ...] = POLICIES
    profiles: dict[str, tuple[float, ...]] = field(default_factory=dict)

    @property
    def num_sites(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def num_requests(self) -> int:
        total = 0
        for w in self.workloads:
            if w.kind == "batch":
                total += w.requests
            elif w.kind == "realtime":
                total += round(w.requests_per_s * max(w.end_h - w.arrive_h, 0) * 3600)
            else:
                total += w.sessions * w.turns
        return total


def _num(data: dict[str, Any], key: str, where: str, default: float | None = None, *,
         low: float = 0.0, high: float = math.inf) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and low <= value <= high):
        raise ScenarioError(f"{where}.{key} must be a number in [{low}, {high}]")
    return float(value)


def _bench_tokens_per_s(path: Path) -> float:
    """The output tok/s of a `minimill bench engine --json` file (mean over its runs)."""
    rates = []
    try:
        for line in path.read_text().splitlines():
            if line.strip().startswith("{"):
                rates.append(float(json.loads(line)["output_tok_s"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ScenarioError(f"{path}: not `minimill bench engine --json` output ({e})") from e
    if not rates:
        raise ScenarioError(f"{path}: no `bench engine --json` output in it")
    return sum(rates) / len(rates)


def _chip(name: str, data: dict[str, Any], base: Path) -> Chip:
    where = f"chips.{name}"
    if "bench" in data:
        rate = _bench_tokens_per_s(base / str(data["bench"])) * _num(
            data, "bench_scale", where, 1.0, low=1e-6)
    else:
        rate = _num(data, "tokens_per_s", where, low=1e-6)
    return Chip(name, rate, _num(data, "usd_per_hour", where))


def _profile(value: Any, where: str, profiles: dict[str, tuple[float, ...]]) -> tuple[float, ...]:
    if isinstance(value, str):
        if value not in profiles:
            raise ScenarioError(f"{where}: no price profile named {value!r}")
        return profiles[value]
    if not isinstance(value, list) or not value or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ScenarioError(f"{where} must be a list of hourly multipliers >= 0")
    return tuple(float(v) for v in value)


def _region(name: str, data: dict[str, Any], profiles: dict[str, tuple[float, ...]]) -> Region:
    where = f"regions.{name}"
    w = data.get("weather") or {}
    weather = Weather(
        outages_per_day=_num(w, "outages_per_day", where + ".weather", 0.0, high=100),
        mean_hours=_num(w, "mean_hours", where + ".weather", 2.0, low=1e-3, high=1000),
        forecast_accuracy=_num(w, "forecast_accuracy", where + ".weather", 0.0, high=1.0),
        lead_h=_num(w, "lead_h", where + ".weather", 6.0, high=1000))
    profile = data.get("price_profile")
    return Region(name, weather, None if profile is None else
                  _profile(profile, where + ".price_profile", profiles),
                  tuple(_planned(o, f"{where}.outages[{i}]")
                        for i, o in enumerate(data.get("outages") or [])))


def _planned(data: Any, where: str) -> PlannedOutage:
    if not isinstance(data, dict):
        raise ScenarioError(f"{where} must be a mapping of start_h, end_h, announced_h")
    start = _num(data, "start_h", where, high=1e5)
    return PlannedOutage(start, _num(data, "end_h", where, low=start, high=1e5),
                         _num(data, "announced_h", where, 0.0, high=start))


def _group(i: int, data: dict[str, Any], chips: dict[str, Chip],
           regions: dict[str, Region]) -> SiteGroup:
    where = f"sites[{i}]"
    chip, region = data.get("chip"), data.get("region", "default")
    if chip not in chips:
        raise ScenarioError(f"{where}.chip: no chip named {chip!r}")
    if region not in regions:
        raise ScenarioError(f"{where}.region: no region named {region!r}")
    return SiteGroup(
        count=int(_num(data, "count", where, 1, low=1, high=MAX_SITES)), chip=str(chip),
        region=str(region), chips=int(_num(data, "chips", where, 1, low=1, high=1e6)),
        uptime=_num(data, "uptime", where, 0.95, low=0.01, high=1.0),
        mean_repair_h=_num(data, "mean_repair_h", where, 2.0, low=1e-3, high=1e4),
        price_factor=_num(data, "price_factor", where, 1.0, high=1e6),
        partition_share=_num(data, "partition_share", where, 0.0, high=1.0))


def _workload(i: int, data: dict[str, Any]) -> Workload:
    where = f"workloads[{i}]"
    kind = data.get("kind")
    if kind not in ("batch", "realtime", "agent"):
        raise ScenarioError(f"{where}.kind must be batch, realtime or agent")
    tokens = int(_num(data, "tokens", where, low=1, high=1e7))
    if kind == "batch":
        return Workload(kind, tokens, requests=int(_num(data, "requests", where, low=1,
                                                        high=1e13)),
                        arrive_h=_num(data, "arrive_h", where, 0.0, high=1e5),
                        deadline_h=_num(data, "deadline_h", where, 24.0, low=1e-3, high=1e5))
    if kind == "realtime":
        start = _num(data, "start_h", where, 0.0, high=1e5)
        return Workload(kind, tokens, arrive_h=start,
                        requests_per_s=_num(data, "requests_per_s", where, low=1e-6, high=1e6),
                        end_h=_num(data, "end_h", where, low=start, high=1e5))
    return Workload(kind, tokens, sessions=int(_num(data, "sessions", where, low=1, high=1e8)),
                    turns=int(_num(data, "turns", where, low=1, high=1e5)),
                    think_s=_num(data, "think_s", where, 30.0, high=1e6),
                    turn_deadline_s=_num(data, "turn_deadline_s", where, 600.0, low=1.0),
                    cohort=int(_num(data, "cohort", where, 100, low=1, high=1e6)),
                    arrive_h=_num(data, "arrive_h", where, 0.0, high=1e5))


def parse(data: Any, base: Path = Path()) -> Scenario:
    """A scenario from parsed YAML; `base`: where relative bench file paths start."""
    if not isinstance(data, dict):
        raise ScenarioError("a scenario is a mapping")
    profiles = {str(k): _profile(v, f"price_profiles.{k}", {})
                for k, v in (data.get("price_profiles") or {}).items()}
    chips = {str(k): _chip(str(k), v or {}, base) for k, v in (data.get("chips") or {}).items()}
    regions = {str(k): _region(str(k), v or {}, profiles)
               for k, v in (data.get("regions") or {"default": {}}).items()}
    regions.setdefault("default", Region("default"))
    groups = tuple(_group(i, g or {}, chips, regions) for i, g in enumerate(data.get("sites")
                                                                            or []))
    workloads = tuple(_workload(i, w or {}) for i, w in enumerate(data.get("workloads") or []))
    if not groups or not workloads:
        raise ScenarioError("a scenario needs sites and workloads")
    policies = tuple(data.get("policies") or POLICIES)
    if not set(policies) <= set(POLICIES):
        raise ScenarioError(f"policies must be among {', '.join(POLICIES)}")
    billing = str(data.get("billing", "busy"))
    if billing not in ("busy", "up", "always"):
        raise ScenarioError("billing must be busy, up or always")
    top = "scenario"
    scenario = Scenario(
        name=str(data.get("name", "scenario")), chips=chips, regions=regions, groups=groups,
        workloads=workloads, seed=int(_num(data, "seed", top, 1, high=2**31)),
        duration_h=_num(data, "duration_h", top, 24.0, low=1e-3, high=24 * 366),
        drain_h=_num(data, "drain_h", top, 72.0, high=24 * 366),
        lease_ttl_s=_num(data, "lease_ttl_s", top, 60.0, low=1.0),
        lease_work_s=_num(data, "lease_work_s", top, 300.0, low=1.0),
        checkpoint_interval_s=_num(data, "checkpoint_interval_s", top, 60.0, low=1.0),
        replan_s=_num(data, "replan_s", top, 1800.0, low=60.0),
        arrival_bin_s=_num(data, "arrival_bin_s", top, 10.0, low=0.001),
        billing=billing, policies=policies, profiles=profiles)
    if scenario.num_sites > MAX_SITES:
        raise ScenarioError(f"at most {MAX_SITES} sites")
    return scenario


def load(path: Path) -> Scenario:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ScenarioError(f"{path}: {e}") from e
    return parse(data, path.parent)
