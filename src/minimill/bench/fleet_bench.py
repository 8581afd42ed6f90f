"""`minimill bench fleet`: goodput of 3 local workers while one is killed (-9) every few seconds
and restarted, against the same fleet and workload without kills, measured in the same run.

Figures: goodput_tok_s (output tokens of accepted results per second, batch create to
completed), baseline_tok_s (the same without kills), lost_requests and duplicate_results over
the output and error files (both must be 0), and wasted_token_fraction: tokens the engines
decoded that no result kept (work after a killed worker's last checkpoint, stale results), from
the workers' token counters (logged every 0.5 s; a kill loses at most that much of the count).
"""

from __future__ import annotations

import json
import random
import re
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from minimill.bench.local_fleet import BenchError, LocalFleet
from minimill.bench.stages import stage

NUM_WORKERS = 3
DTYPE = "bfloat16"
# Short leases so that a killed worker's requests move on quickly; checkpoints every second.
# Three workers share the machine's cores: OpenMP threads that spin while they wait for work
# would starve the others, a restarting worker most of all, so they sleep instead.
FLEET_ENV = {"MINIMILL_LEASE_TTL_S": "5", "MINIMILL_CHECKPOINT_INTERVAL_S": "1",
             "MINIMILL_JANITOR_INTERVAL_S": "0.25", "MINIMILL_WORKER_STATS_S": "0.5",
             "OMP_WAIT_POLICY": "PASSIVE"}
# Each worker's KV flash tier (--kv-flash): what a killed worker's engine computed is on
# flash when it starts again, and it resumes its requests from there.
FLASH_GB = 2.0
_STATS = re.compile(r"stats generated_tokens=(\d+)")
_START = re.compile(r"start: ([\d.]+)s to first lease \((.*)\)")


def restarts_in_logs(logs: list[Path], offsets: list[int]) -> dict[str, Any]:
    """How long restarted workers took from process start to their first lease, and the
    slowest one's phases (each worker logs where its start went)."""
    starts = [(float(m.group(1)), m.group(2)) for log, offset in zip(logs, offsets, strict=True)
              for m in _START.finditer(log.read_text(errors="replace")[offset:])]
    if not starts:
        return {"restarts": 0}
    seconds = sorted(s for s, _ in starts)
    return {"restarts": len(starts), "restart_to_lease_median_s": seconds[len(seconds) // 2],
            "restart_to_lease_max_s": seconds[-1],
            "slowest_restart": max(starts)[1]}


def generated_tokens_in_log(log_path: Path, start: int = 0) -> int:
    """Tokens decoded by every incarnation of a worker since byte `start` of its log (the
    worker logs its counter when MINIMILL_WORKER_STATS_S is set)."""
    text = log_path.read_text(errors="replace")
    before = _STATS.findall(text[:start])
    # The incarnation alive at `start` had already counted this many (its counter is cumulative).
    last = int(before[-1]) if before else 0
    total = -last
    for match in _STATS.finditer(text[start:]):
        value = int(match.group(1))
        if value < last:  # a new incarnation (restarted after a kill) counts from zero
            total += last
        last = value
    return total + last


class Chaos:
    """Kills a random worker every `every_s` and starts it again at once."""

    def __init__(self, fleet: LocalFleet, every_s: float, seed: int = 0) -> None:
        self.fleet, self.every_s = fleet, every_s
        self.random = random.Random(seed)
        self.kills = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            proc = self.fleet.workers[self.random.choice(sorted(self.fleet.workers))]
            proc.kill9()
            self.kills += 1
            proc.start()

    def __enter__(self) -> Chaos:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _run_batch(fleet: LocalFleet, lines: list[str], tmp: Path, every_s: float | None
               ) -> dict[str, Any]:
    from openai import OpenAI

    client = OpenAI(base_url=fleet.base_url, api_key=fleet.key, timeout=600)
    path = tmp / "workload.jsonl"
    path.write_text("\n".join(lines) + "\n")
    offsets = {site: p.log_path.stat().st_size for site, p in fleet.workers.items()}
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    start = time.perf_counter()
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    chaos = Chaos(fleet, every_s) if every_s else None
    if chaos is not None:
        chaos.__enter__()
    try:
        while True:
            batch = client.batches.retrieve(batch.id)
            if batch.status in ("completed", "failed", "expired", "cancelled"):
                break
            time.sleep(0.25)
    finally:
        if chaos is not None:
            chaos.__exit__()
    seconds = time.perf_counter() - start
    time.sleep(1.0)  # the last stats lines of the workers
    records = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id:
            records += [json.loads(line) for line in client.files.content(file_id).read()
                        .splitlines() if line.strip()]
    ids = Counter(r["custom_id"] for r in records)
    expected = {json.loads(line)["custom_id"] for line in lines}
    useful = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in records
                 if r.get("response"))
    generated = sum(generated_tokens_in_log(p.log_path, offsets[s])
                    for s, p in fleet.workers.items())
    sites = sorted(fleet.workers)
    return {"status": batch.status, "seconds": seconds, "output_tokens": useful,
            "tok_s": useful / seconds, "failed": sum(1 for r in records if r.get("error")),
            "lost": len(expected - set(ids)), "duplicates": sum(n - 1 for n in ids.values()),
            "generated": generated, "kills": chaos.kills if chaos else 0,
            **restarts_in_logs([fleet.workers[s].log_path for s in sites],
                               [offsets[s] for s in sites])}


def run_fleet_bench(workload: Path, *, json_out: bool, kill_every_s: float,
                    limit: int | None, kv_flash: bool = True) -> None:
    """Print goodput with kills beside the baseline without kills, plus loss figures."""
    from rich.console import Console

    from minimill.models.registry import DEFAULT_MODEL

    err = Console(stderr=True)
    if not workload.is_file():
        raise SystemExit(f"error: workload {workload} not found")
    lines = [line for line in workload.read_text().splitlines() if line.strip()]
    lines = lines[:limit] if limit is not None else lines
    fleet = LocalFleet(DEFAULT_MODEL, DTYPE, local_worker=False, env=FLEET_ENV)

    def start_workers(run: str) -> None:
        """Fresh workers (empty KV pools, and flash tiers of their own) for each run: the
        workload is greedy, so KV left by one run would spare the other's recomputing."""
        for proc in fleet.workers.values():
            proc.terminate()
        for proc in fleet.workers.values():
            proc.stop()
        procs = []
        for i in range(NUM_WORKERS):
            flash = ["--kv-flash-dir", str(fleet.home / f"kv-flash-{run}-{i}"),
                     "--kv-flash-gb", str(FLASH_GB)] if kv_flash else []
            procs.append(fleet.worker(f"mill-{i}", fleet.site_token(f"mill-{i}"), *flash))
        # A site's log goes on from its earlier workers': read only what the new one writes.
        offsets = [len(p.log_path.read_text(errors="replace")) if p.log_path.exists() else 0
                   for p in procs]
        for proc in procs:
            proc.start()
        for i, (proc, offset) in enumerate(zip(procs, offsets, strict=True)):
            proc.wait_for_log(rf"worker for site 'mill-{i}' ready", start=offset)
            # Its start line too, before the run's logs are read for restarts.
            proc.wait_for_log(r"start: [\d.]+s to first lease", start=offset)

    try:
        with tempfile.TemporaryDirectory() as tmp:
            with stage(err, f"starting serve and {NUM_WORKERS} workers ..."):
                fleet.start()
                start_workers("baseline")
            with stage(err, f"baseline: {len(lines)} requests, no kills ..."):
                base = _run_batch(fleet, lines, Path(tmp), None)
            with stage(err, f"starting {NUM_WORKERS} fresh workers ..."):
                start_workers("chaos")
            with stage(err, f"chaos: a worker killed every {kill_every_s:g}s ..."):
                chaos = _run_batch(fleet, lines, Path(tmp), kill_every_s)
    except (BenchError, RuntimeError, TimeoutError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise SystemExit(1) from None
    finally:
        fleet.close()
    wasted = max(0, chaos["generated"] - chaos["output_tokens"])
    restarts: dict[str, Any] = {k: chaos[k] for k in ("restarts", "restart_to_lease_median_s",
                                                      "restart_to_lease_max_s",
                                                      "slowest_restart") if k in chaos}
    report: dict[str, Any] = {
        "requests": len(lines), "workers": NUM_WORKERS, "kill_every_s": kill_every_s,
        "kv_flash": kv_flash,
        "kills": chaos["kills"], "lease_ttl_s": float(FLEET_ENV["MINIMILL_LEASE_TTL_S"]),
        "goodput_tok_s": round(chaos["tok_s"], 2), "baseline_tok_s": round(base["tok_s"], 2),
        "goodput_fraction": round(chaos["tok_s"] / base["tok_s"], 3) if base["tok_s"] else None,
        "seconds": round(chaos["seconds"], 2), "baseline_seconds": round(base["seconds"], 2),
        "lost_requests": chaos["lost"], "duplicate_results": chaos["duplicates"],
        "failed_requests": chaos["failed"],
        "wasted_tokens": wasted, "generated_tokens": chaos["generated"],
        "wasted_token_fraction": round(wasted / chaos["generated"], 4)
        if chaos["generated"] else 0.0,
        "baseline_lost_requests": base["lost"], "baseline_duplicate_results": base["duplicates"],
        **restarts,
    }
    if json_out:
        print(json.dumps(report))
        return
    for key, value in report.items():
        print(f"{key:>28}: {value}")
