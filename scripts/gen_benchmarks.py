"""Write the benchmarks page from the recorded runs in benchmarks/results/*.json.

Each file is one run of a `minimill bench` command as it was recorded: bench, date (and
time_utc where known), machine, command, figures, and the peer figures it was compared with
in the same run (plus rounds, a note, and the source that recorded it). The page is tables
made from those files, one per bench, newest first; nothing in it is typed by hand.

    python scripts/gen_benchmarks.py docs/benchmarks.md
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from page_args import output_page

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

BENCHES = {
    "engine": ("The engine", "Output tokens per second of the builtin engine on the same "
               "256-request workload (32,768 output tokens) beside vLLM's CPU build and HF "
               "transformers `generate` in the same sitting, and its fraction of the speed of "
               "light: each step's bound from its FLOPs at the rate the engine's own GEMMs "
               "reach and its bytes at the machine's memory bandwidth."),
    "batch": ("The Batch API", "The same workload through `serve` as a batch, against the "
              "offline engine on the same machine in the same run (target ratio 0.9), and how "
              "fast the control plane ingests a batch file."),
    "kv": ("KV cache dtypes", "Bytes per token, perplexity over 16,384 tokens of a public-"
           "domain text read in 256-token chunks, and how many sequences run at once in a "
           "fixed 48 MB KV budget, for each KV dtype."),
    "sessions": ("Agent sessions: KV reuse and tiers", "Agent sessions through `serve` with "
                 "the official openai client, every turn appending tool output, over a KV pool "
                 "far below their contexts: prefix reuse and the host/flash tiers on, then "
                 "off."),
    "fairness": ("Fair share between tenants", "A light tenant's batch through `serve`, "
                 "alone and beside a tenant submitting ten times its load: its p50 finish "
                 "time beside the heavy tenant over its p50 alone (target 1.5), and the share "
                 "of the site's slots kept busy meanwhile."),
    "control-plane": ("The control plane at fleet scale", "Real `serve` processes on SQLite "
                      "or PostgreSQL, simulated sites speaking the fleet protocol over HTTP (the "
                      "real worker loop, the fake engine), a batch and streaming realtime calls: "
                      "completed requests/s, the control plane's CPU per request, call "
                      "latencies, rows written per request, exactly-once completion."),
    "fleet": ("A fleet with failures", "Three workers on one machine, one killed every 10 s: "
              "goodput against the same fleet with no kills; nothing lost or duplicated."),
}
LABELS = {
    "output_tok_s": "output tok/s", "sol_tok_s": "speed of light, tok/s",
    "sol_fraction": "fraction of the speed of light", "decode_attention_s": "decode attention, s",
    "batch_api_tok_s": "Batch API tok/s", "ratio": "Batch API / offline",
    "ingest_lines_s": "ingest lines/s", "steal_share_below": "CPU steal below",
    "output_tok_s_before": "tok/s before", "output_tok_s_after": "tok/s after",
    "bytes_per_token": "bytes per token", "perplexity": "perplexity",
    "most_sequences_at_48mb": "most sequences at once", "mean_sequences_per_step":
    "mean sequences per step", "output_tok_s_at_48mb": "output tok/s at 48 MB",
    "prompt_tokens_computed": "prompt tokens computed", "seconds_all_turns": "seconds, all turns",
    "cached_tokens_reported": "cached_tokens reported", "goodput_tok_s": "goodput tok/s",
    "goodput_ratio": "goodput / no kills", "restart_to_first_lease_s_median":
    "restart to first lease, s (median)", "lost": "lost requests", "duplicated": "duplicated",
    "restore_1k_tokens_flash_ms": "restore 1k tokens from flash, ms",
    "restore_1k_tokens_host_ms": "restore 1k tokens from host RAM, ms",
    "recompute_1k_tokens_ms": "recompute 1k tokens, ms",
    "turn5_prompt_tokens_on_flash_after_restart": "turn 5 after a restart: prompt tokens on flash",
    "turn5_prompt_tokens": "turn 5: prompt tokens", "prompt_tokens_fewer_x":
    "prompt tokens computed, times fewer", "faster_x": "times faster",
    "light_p50_alone_s": "light p50 alone, s",
    "light_p50_beside_heavy_s": "light p50 beside heavy, s", "p50_ratio": "beside / alone",
    "ratio_target": "target", "busy_share_beside": "site busy share",
    "light_share_of_slots_beside": "light tenant's share of slots",
    "completed_per_s": "requests/s", "control_plane_cpu_ms_per_request": "CPU ms per request",
    "lease_p99_ms": "lease p99, ms", "complete_p99_ms": "complete p99, ms",
    "rows_written_per_request": "rows written per request", "exactly_once": "exactly once",
}


def load_runs(folder: Path = RESULTS) -> list[dict[str, Any]]:
    runs = []
    for path in sorted(folder.glob("*.json")):
        run = json.loads(path.read_text())
        missing = {"bench", "date", "machine", "command", "figures"} - set(run)
        if missing:
            raise ValueError(f"{path.name}: missing {sorted(missing)}")
        run["file"] = path.name
        runs.append(run)
    return runs


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    return f"{value:,}"


def _label(key: str) -> str:
    return LABELS.get(key, key.replace("_", " "))


def _when(run: dict[str, Any]) -> str:
    if run["date"] is None:
        return "not recorded"
    return run["date"] + (f" {run['time_utc']} UTC" if run.get("time_utc") else "")


def _rounds(run: dict[str, Any]) -> str:
    rounds = run.get("rounds") or {}
    return "; ".join(f"{_label(k)}: " + ", ".join(_number(v) for v in values)
                     for k, values in rounds.items())


def _flat_table(runs: list[dict[str, Any]]) -> list[str]:
    keys = list(dict.fromkeys(k for r in runs for k in r["figures"]))
    peer_cols = list(dict.fromkeys((p, k) for r in runs for p, figs in r.get("peers", {}).items()
                                   for k in figs))
    head = ["date", "machine", *(_label(k) for k in keys),
            *(f"{p}: {_label(k)}" for p, k in peer_cols), "rounds", "command", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        cells = [_when(r), r["machine"],
                 *(f"**{_number(r['figures'][k])}**" if k in r["figures"] else "" for k in keys),
                 *(_number(r.get("peers", {}).get(p, {}).get(k, "")) for p, k in peer_cols),
                 _rounds(r), f"`{r['command']}`", r.get("note", "")]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return [*lines, ""]


def _variant_table(run: dict[str, Any]) -> list[str]:
    """A run whose figures are per variant (e.g. per KV dtype): one row per variant."""
    keys = list(dict.fromkeys(k for figs in run["figures"].values() for k in figs))
    lines = [f"{_when(run)}, {run['machine']}: `{run['command']}`", "",
             "| | " + " | ".join(_label(k) for k in keys) + " |", "|---|" + "---|" * len(keys)]
    for variant, figs in run["figures"].items():
        lines.append(f"| {variant} | " + " | ".join(_number(figs.get(k, "")) for k in keys) + " |")
    return [*lines, "", *([run["note"] + ".", ""] if run.get("note") else [])]


def _newest_first(run: dict[str, Any]) -> tuple[str, str, str]:
    return (run["date"] or "", run.get("time_utc") or "", run["file"])


def render(runs: list[dict[str, Any]]) -> str:
    lines = ["# Benchmarks", "",
             "Every figure below is one recorded run of a `minimill bench` command, kept as a "
             "JSON file in `benchmarks/results/` (machine, date, command, figures, and the "
             "figures it was compared with in the same run) and rendered into these tables by "
             "`scripts/gen_benchmarks.py`. Figures from different machines, and often from "
             "different hours of one machine, do not compare: these are shared 2-core VMs "
             "whose speed moves by up to 1.5x from hour to hour, so each bench measures its "
             "yardstick in the same run. The workload file is "
             "`benchmarks/workloads/throughput-256.jsonl`; how the engine gets its figures is "
             "in [inside the engine](engine.md).", ""]
    benches = list(BENCHES) + sorted({r["bench"] for r in runs} - set(BENCHES))
    for bench in benches:
        mine = sorted((r for r in runs if r["bench"] == bench), key=_newest_first, reverse=True)
        if not mine:
            continue
        title, about = BENCHES.get(bench, (bench, ""))
        lines += [f"## {title}", "", about, ""] if about else [f"## {title}", ""]
        flat = [r for r in mine if not any(isinstance(v, dict) for v in r["figures"].values())]
        if flat:
            lines += _flat_table(flat)
        for r in mine:
            if r not in flat:
                lines += _variant_table(r)
    lines += ["## The fleet's economics", "",
              "The simulator's comparison of a thousand small sites with one campus is on "
              "its own page, [fleet economics](fleet-economics.md), with its data in "
              "`docs/fleet-economics/results.json`.", ""]
    return "\n".join(lines)


def main() -> None:
    out = output_page("Write the benchmarks page from the recorded runs in "
                      "benchmarks/results/*.json.", "docs/benchmarks.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(load_runs()))


if __name__ == "__main__":
    main()
