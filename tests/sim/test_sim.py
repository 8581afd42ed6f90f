"""The simulator end to end: fencing of cut-off sites, handback ahead of forecast outages,
cheap hours for background work, the CLI (JSON, plots, errors) and the 10,000-site scale run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from minimill.sim.run import run
from minimill.sim.scenario import ScenarioError, parse

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "examples" / "scenarios"
SOLAR = [1.6] * 9 + [0.4] * 7 + [1.6] * 8


def base(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "t", "seed": 3, "duration_h": 24, "drain_h": 100, "lease_work_s": 600,
        "checkpoint_interval_s": 60,
        "chips": {"x": {"tokens_per_s": 1000, "usd_per_hour": 1.0}},
        "regions": {"r": {}},
        "sites": [{"count": 20, "chip": "x", "region": "r", "uptime": 1.0}],
        "workloads": [{"kind": "batch", "requests": 20000, "tokens": 1000, "deadline_h": 20}]}
    data.update(overrides)
    return data


def test_cut_off_sites_are_fenced_and_nothing_is_lost() -> None:
    report = run(parse(base(sites=[{"count": 20, "chip": "x", "region": "r", "uptime": 0.7,
                                    "mean_repair_h": 0.3, "partition_share": 1.0}])))
    assert report["lost_requests"] == 0 and report["duplicate_completions"] == 0
    naive = report["policies"]["naive"]
    assert naive["lease_expiries"] > 0
    # Cut-off sites compute on; their late completions are rejected at a stale epoch once
    # another site holds the work, and that work is counted as wasted.
    assert naive["stale_completions"] > 0 and naive["wasted_tokens"] > 0
    assert naive["completed_requests"] == report["requests"]


def test_forecasts_hand_work_back_and_waste_less() -> None:
    weather = {"outages_per_day": 8, "mean_hours": 1, "forecast_accuracy": 1.0, "lead_h": 2}
    report = run(parse(base(regions={"r": {"weather": weather}, "s": {}},
                            workloads=[{"kind": "batch", "requests": 400000, "tokens": 1000,
                                        "deadline_h": 20}],
                            sites=[{"count": 20, "chip": "x", "region": "r", "uptime": 1.0},
                                   {"count": 5, "chip": "x", "region": "s", "uptime": 1.0,
                                    "price_factor": 1.5}])))
    naive, forecast = report["policies"]["naive"], report["policies"]["forecast"]
    assert naive["lease_expiries"] > 0 and naive["wasted_tokens"] > 0
    assert forecast["lease_expiries"] == 0 and forecast["wasted_tokens"] == 0
    assert forecast["placed_in_announced_outage"] == 0


def test_background_goes_to_cheap_hours_and_realtime_is_never_deferred() -> None:
    report = run(parse(base(
        regions={"r": {"price_profile": SOLAR}},
        workloads=[{"kind": "batch", "requests": 20000, "tokens": 1000, "deadline_h": 20},
                   {"kind": "realtime", "requests_per_s": 1, "tokens": 100, "end_h": 20}])))
    cost, forecast = report["policies"]["cost"], report["policies"]["forecast"]
    assert forecast["usd_per_mtok"] < cost["usd_per_mtok"] * 0.6  # 0.4 vs 1.6 $/h hours
    assert forecast["deadline_misses"] == 0
    assert forecast["p99_background_s"] > 9 * 3600  # waited for 09:00
    assert forecast["p99_realtime_s"] <= cost["p99_realtime_s"] + 1e-6


def test_cost_policy_fills_cheap_sites_first_and_dear_ones_take_what_they_leave() -> None:
    """As the control plane's placement: a dearer site takes background work beyond what the
    cheaper sites with free room take (test_sim_vs_live.py runs both on one scenario)."""
    chips = {"x": {"tokens_per_s": 1000, "usd_per_hour": 1.0},
             "y": {"tokens_per_s": 1000, "usd_per_hour": 3.0}}
    # The dear sites come first: round-robin (naive) asks them first.
    sites = [{"count": 10, "chip": "y", "region": "r", "uptime": 1.0},
             {"count": 10, "chip": "x", "region": "r", "uptime": 1.0}]

    def batch(requests: int) -> dict[str, Any]:
        return run(parse(base(chips=chips, sites=sites, workloads=[
            {"kind": "batch", "requests": requests, "tokens": 1000, "deadline_h": 20}])))

    # 6,000 x 1,000 tokens: one lease's work (600 s at 1,000 tok/s) for each cheap site.
    fits = batch(6000)["policies"]
    assert fits["cost"]["sites_used"] == 10 and fits["naive"]["sites_used"] == 10
    assert fits["cost"]["usd_per_mtok"] < fits["naive"]["usd_per_mtok"] * 0.5  # 1 vs 3 $/h
    # More than the cheap half takes at once: the dear half takes the rest.
    more = batch(20000)["policies"]
    assert more["cost"]["sites_used"] == 20
    assert more["cost"]["deadline_misses"] == 0
    assert more["cost"]["usd_per_mtok"] < more["naive"]["usd_per_mtok"]


def sim_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "minimill.cli", "sim", *args],
                          capture_output=True, text=True, timeout=600, check=False)


def test_cli_json_and_plots(tmp_path: Path) -> None:
    done = sim_cli(str(SCENARIOS / "small.yaml"), "--json", "--plots", str(tmp_path))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report["policies"]) == {"naive", "cost", "forecast"}
    assert report["lost_requests"] == 0
    for path in report["plots"]:
        assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "naive" in done.stderr  # progress, one line per policy


def test_cli_names_the_bad_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps(base(sites=[{"count": 3, "chip": "nope", "region": "r"}])))
    done = sim_cli(str(bad))
    assert done.returncode == 2 and "sites[0].chip" in done.stderr
    assert "Traceback" not in done.stderr


def test_scale_10k_sites_1m_requests() -> None:
    done = sim_cli(str(SCENARIOS / "scale-10k.yaml"), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["sites"] == 10_000 and report["requests"] >= 1_000_000
    assert report["wall_seconds"] < 300
    assert report["lost_requests"] == 0 and report["duplicate_completions"] == 0
    for policy in report["policies"].values():
        assert policy["completed_requests"] == report["requests"]
        assert {"goodput_tok_s", "usd_per_mtok", "p99_completion_s",
                "deadline_misses"} <= set(policy)


def test_chip_rates_come_from_bench_engine_output(tmp_path: Path) -> None:
    (tmp_path / "bench").mkdir()
    # Two `bench engine --json` runs (say, a --shape run on two days): their mean counts.
    (tmp_path / "bench" / "gpu.json").write_text(
        json.dumps({"output_tok_s": 900.0, "device": "cuda"}) + "\n"
        + json.dumps({"output_tok_s": 1100.0, "device": "cuda"}) + "\n")
    data = base(chips={"x": {"bench": "bench/gpu.json", "bench_scale": 2,
                             "usd_per_hour": 1.0}})
    scenario = parse(data, tmp_path)
    assert scenario.chips["x"].tokens_per_s == 2000.0
    (tmp_path / "bench" / "bad.json").write_text("no json here\n")
    with pytest.raises(ScenarioError, match="bench engine"):
        parse(base(chips={"x": {"bench": "bench/bad.json", "usd_per_hour": 1.0}}), tmp_path)
