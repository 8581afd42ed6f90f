"""Invariants of the simulator on random small scenarios (hypothesis): no request lost, none
completed twice, no work placed on a site inside its announced outage, and no deadline missed
that the fleet could meet."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from minimill.sim.run import run
from minimill.sim.scenario import parse

SOLAR = [1.6] * 8 + [0.4] * 8 + [1.2] * 8


@st.composite
def scenarios(draw: st.DrawFn, failures: bool = True) -> dict[str, Any]:
    regions: dict[str, Any] = {}
    for name in ("a", "b"):
        weather = {"outages_per_day": draw(st.floats(0, 6)) if failures else 0.0,
                   "mean_hours": draw(st.floats(0.2, 3)),
                   "forecast_accuracy": draw(st.floats(0, 1)), "lead_h": draw(st.floats(0, 4))}
        regions[name] = {"weather": weather,
                         "price_profile": SOLAR if draw(st.booleans()) else None}
    groups = [{"count": draw(st.integers(1, 6)), "chip": draw(st.sampled_from(["x", "y"])),
               "region": draw(st.sampled_from(["a", "b"])),
               "uptime": draw(st.floats(0.6, 1.0)) if failures else 1.0,
               "mean_repair_h": draw(st.floats(0.05, 2)),
               "partition_share": draw(st.floats(0, 1)),
               "price_factor": draw(st.floats(0.5, 2))}
              for _ in range(draw(st.integers(1, 3)))]
    workloads: list[dict[str, Any]] = [
        {"kind": "batch", "requests": draw(st.integers(1, 3000)),
         "tokens": draw(st.integers(1, 2000)), "arrive_h": draw(st.floats(0, 3)),
         "deadline_h": draw(st.floats(0.5, 12))}]
    if draw(st.booleans()):
        workloads.append({"kind": "realtime", "requests_per_s": draw(st.floats(0.01, 2)),
                          "tokens": draw(st.integers(1, 500)), "start_h": 0,
                          "end_h": draw(st.floats(0.1, 2))})
    if draw(st.booleans()):
        workloads.append({"kind": "agent", "sessions": draw(st.integers(1, 50)),
                          "turns": draw(st.integers(1, 8)), "tokens": draw(st.integers(1, 800)),
                          "think_s": draw(st.floats(0, 300)), "cohort": draw(st.integers(1, 20)),
                          "turn_deadline_s": draw(st.floats(60, 3600))})
    return {"name": "random", "seed": draw(st.integers(0, 2**16)), "duration_h": 6,
            "drain_h": 200, "lease_work_s": draw(st.floats(30, 900)),
            "lease_ttl_s": draw(st.floats(5, 120)),
            "checkpoint_interval_s": draw(st.floats(5, 300)),
            "chips": {"x": {"tokens_per_s": draw(st.floats(20, 2000)), "usd_per_hour": 0.5},
                      "y": {"tokens_per_s": draw(st.floats(20, 2000)), "usd_per_hour": 2.0}},
            "regions": regions, "sites": groups, "workloads": workloads}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_nothing_lost_nothing_twice_nothing_inside_an_announced_outage(
        data: dict[str, Any]) -> None:
    report = run(parse(data))
    assert report["lost_requests"] == 0
    assert report["duplicate_completions"] == 0
    for name, policy in report["policies"].items():
        assert policy["lost_requests"] == 0, name
        assert policy["duplicate_completions"] == 0, name
        # A long drain: every request is finished, whatever failed.
        assert policy["completed_requests"] == report["requests"], name
        assert policy["placed_in_announced_outage"] == 0, name


# Derandomized, so that CI runs the same examples every time; the scenario random draws once
# found is kept as its own test below.
@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(scenarios(failures=False), st.floats(0.5, 4))
def test_no_deadline_missed_that_the_fleet_could_meet(data: dict[str, Any],
                                                       slack: float) -> None:
    """Without failures, a batch that needs at most a quarter of the fleet's capacity until
    its deadline (less one lease of the slowest site), and nothing else, always makes it."""
    data["workloads"] = data["workloads"][:1]
    scenario = parse(data)
    batch = scenario.workloads[0]
    capacity = sum(g.count * scenario.chips[g.chip].tokens_per_s * g.chips
                   for g in scenario.groups)
    slowest = min(scenario.chips[g.chip].tokens_per_s * g.chips for g in scenario.groups)
    window_s = batch.deadline_h * 3600 - scenario.lease_work_s - batch.tokens / slowest * 2
    need = batch.requests * batch.tokens
    assume(window_s > 0 and need <= capacity * window_s / (4 * slack))
    report = run(scenario)
    for name, policy in report["policies"].items():
        assert policy["deadline_misses"] == 0, (name, policy)


# Hypothesis found it: 13 equal sites whose price follows SOLAR (1.6 until 08:00, then 0.4),
# 880 requests of 793 tokens arriving at 1.73 h, due at 8.08 h. The forecast policy left the
# work for the cheap hour at 08:00, having counted 216 s for it (its tokens at the fleet's
# rate, times the safety factor: 270 s of the 281 s left); but work goes out in leases of 71 s
# that one site runs alone, so the last lease ended at 281.4 s and 22 requests were late.
CHEAP_HOUR_AT_THE_DEADLINE: dict[str, Any] = {
    "name": "cheap-hour-at-the-deadline", "seed": 0, "duration_h": 6, "drain_h": 200,
    "lease_work_s": 71.0, "lease_ttl_s": 5.0, "checkpoint_interval_s": 5.0,
    "chips": {"x": {"tokens_per_s": 248.0, "usd_per_hour": 0.5},
              "y": {"tokens_per_s": 20.0, "usd_per_hour": 2.0}},
    "regions": {
        "a": {"weather": {"outages_per_day": 0.0, "mean_hours": 1.0, "forecast_accuracy": 0.0,
                          "lead_h": 0.0}, "price_profile": SOLAR},
        "b": {"weather": {"outages_per_day": 0.0, "mean_hours": 1.0, "forecast_accuracy": 0.0,
                          "lead_h": 0.0}, "price_profile": None}},
    "sites": [{"count": count, "chip": "x", "region": "a", "uptime": 1.0, "mean_repair_h": 1.0,
               "partition_share": 0.0, "price_factor": 1.0} for count in (2, 5, 6)],
    "workloads": [{"kind": "batch", "requests": 880, "tokens": 793, "arrive_h": 1.7265625,
                   "deadline_h": 6.3515625}]}


def test_a_cheap_hour_is_not_taken_when_the_last_lease_would_end_past_the_deadline() -> None:
    report = run(parse(CHEAP_HOUR_AT_THE_DEADLINE))
    assert report["requests"] == 880
    for name, policy in report["policies"].items():
        assert policy["completed_requests"] == 880, name
        assert policy["deadline_misses"] == 0, (name, policy)
