"""PNG plots of a simulation run (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from minimill.sim.tally import Tally


def write_plots(directory: Path, name: str, policies: dict[str, dict[str, Any]],
                tallies: dict[str, Tally]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    names = list(policies)
    written: list[Path] = []
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    panels = (("usd_per_mtok", "$ / Mtok"), ("goodput_tok_s", "goodput tok/s"),
              ("p99_completion_s", "p99 completion (s)"), ("deadline_misses", "deadline misses"))
    for ax, (key, label) in zip(axes, panels, strict=True):
        values = [policies[n][key] or 0 for n in names]
        ax.bar(names, values, color=["#999999", "#4477aa", "#228833"][:len(names)])
        ax.set_title(label)
        for x, v in enumerate(values):
            ax.annotate(f"{v:.3g}", (x, v), ha="center", va="bottom", fontsize=8)
    fig.suptitle(f"{name}: policies compared")
    fig.tight_layout()
    path = directory / f"{name}-policies.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for n in names:
        hours = sorted(tallies[n].tokens_by_hour)
        top.plot(hours, [tallies[n].tokens_by_hour[h] / 3600 for h in hours], label=n)
        cost_hours = sorted(tallies[n].cost_by_hour)
        bottom.plot(cost_hours, [tallies[n].cost_by_hour[h] for h in cost_hours], label=n)
    top.set_ylabel("goodput tok/s")
    bottom.set_ylabel("cost $ per hour (busy)")
    bottom.set_xlabel("hour of the run")
    top.legend()
    fig.suptitle(f"{name}: throughput and cost over time")
    fig.tight_layout()
    path = directory / f"{name}-timeline.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    return written
