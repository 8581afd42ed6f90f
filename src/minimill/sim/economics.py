"""The fleet-economics report's numbers and plots, reproducible with one command:

    python -m minimill.sim.economics --out docs/fleet-economics

Runs examples/scenarios/fleet-1000x1mw.yaml and campus-9999.yaml (every policy), then the
fleet with its independent uptime swept from 80% to 99.9% (weather off, so the swept figure is
the whole uptime; forecast policy). Writes results.json and PNG plots to --out and prints a
Markdown summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from minimill.sim.run import run
from minimill.sim.scenario import parse

SCENARIOS = Path(__file__).resolve().parents[3] / "examples" / "scenarios"
UPTIMES = (0.80, 0.85, 0.90, 0.95, 0.99, 0.999)


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _swept(data: dict[str, Any], uptime: float) -> dict[str, Any]:
    swept = json.loads(json.dumps(data))
    swept["name"] = f"fleet-uptime-{uptime:g}"
    swept["policies"] = ["forecast"]
    for region in swept["regions"].values():
        region["weather"] = {}
    for group in swept["sites"]:
        group["uptime"] = uptime
    return swept


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/fleet-economics"))
    parser.add_argument("--scenarios", type=Path, default=SCENARIOS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    fleet_data = yaml.safe_load((args.scenarios / "fleet-1000x1mw.yaml").read_text())
    campus_data = yaml.safe_load((args.scenarios / "campus-9999.yaml").read_text())
    _log("fleet of 1,000 x 1 MW ...")
    fleet = run(parse(fleet_data, args.scenarios), progress=_log, plots=args.out)
    _log("campus ...")
    campus = run(parse(campus_data, args.scenarios), progress=_log, plots=args.out)
    sweep = []
    for uptime in UPTIMES:
        _log(f"fleet at {uptime:.1%} uptime ...")
        result = run(parse(_swept(fleet_data, uptime), args.scenarios))["policies"]["forecast"]
        sweep.append({"uptime": uptime, **result})
    campus_cost = campus["policies"]["forecast"]["usd_per_mtok"]
    results = {"fleet": fleet, "campus": campus, "sweep": sweep,
               "campus_usd_per_mtok": campus_cost}
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    _plot(args.out, sweep, campus_cost)
    fleet_cost = fleet["policies"]["forecast"]["usd_per_mtok"]
    print(f"fleet (forecast policy): ${fleet_cost}/Mtok; campus: ${campus_cost}/Mtok; "
          f"fleet/campus = {fleet_cost / campus_cost:.3f}")
    print("| uptime | $/Mtok | vs campus | goodput tok/s | wasted tokens |")
    print("|---|---|---|---|---|")
    for point in sweep:
        print(f"| {point['uptime']:.1%} | {point['usd_per_mtok']} | "
              f"{point['usd_per_mtok'] / campus_cost:.3f} | {point['goodput_tok_s']:.4g} | "
              f"{point['wasted_tokens']:.3g} |")


def _plot(out: Path, sweep: list[dict[str, Any]], campus_cost: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([p["uptime"] * 100 for p in sweep], [p["usd_per_mtok"] for p in sweep], "o-",
            label="1,000 sites x 1 MW ($1.20/chip-h)")
    ax.axhline(campus_cost, color="#aa3377", linestyle="--",
               label="one 99.99% campus ($2.00/chip-h)")
    ax.set_xlabel("site uptime (%)")
    ax.set_ylabel("$ per million output tokens")
    ax.set_title("Cost of a kept token vs site uptime (owned capacity)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "uptime-sweep.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
