"""`minimill bench control-plane`: what the control plane costs per request at fleet scale.

For each store setup (SQLite with one process; PostgreSQL with 1, 2, 4 ... processes) and each
site count, it starts fresh `minimill serve --no-local-worker` processes on one store, registers
the sites, and runs them from a few processes (control_plane_sites.py: the real worker loop and
HTTP client, the fake engine at a declared rate), each site reaching the control-plane processes
as through a load balancer. Once every site asks for work, one tenant submits a batch and
another makes streaming realtime calls (control_plane_load.py); the run ends when all of them
are done.

Figures per run: completed requests/s; the control plane's CPU seconds per completed request
(user + system of the serve processes and their children, from /proc, over the run); p50 and
p99 of lease (those not held open), heartbeat and complete calls as the sites saw them; leases
that expired (the control plane did not extend them in time: no site dies here) and leases the
sites heard were revoked; on PostgreSQL the rows written per request (pg_stat_database's
inserted + updated + deleted tuples); and the exactly-once checks: every batch line in the
output exactly once, every realtime stream finished, the store's rows all succeeded, and the
accepted completions the sites' counters hold equal to the requests.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rich.console import Console

from minimill.bench import stages
from minimill.bench.control_plane_load import BatchJob, Realtime, batch_lines, exactly_once
from minimill.bench.control_plane_store import fresh_store, pg_rows_written, register, store_counts
from minimill.bench.local_fleet import BenchError, LocalProcess, free_port
from minimill.bench.proc_tree import cpu_seconds, process_tree
from minimill.bench.steal import StealMeter

MODEL = "bench-fake"
READY_TIMEOUT_S = 120.0
# Requests of the unmeasured round before each measured one.
WARM_UP_REQUESTS = 20


@dataclass(frozen=True, slots=True)
class ControlPlaneBenchOptions:
    sites: tuple[int, ...] = (10, 100, 1000)
    db: str | None = None  # a PostgreSQL URL: its runs beside SQLite's
    processes: tuple[int, ...] = (1, 2, 4)  # control-plane processes on PostgreSQL
    compare: bool = True  # with `db`: SQLite's run too
    requests: int | None = None  # None: 10 per site, at least 200
    realtime_share: float = 0.1
    capacity: int = 16  # requests a site runs at once
    request_s: float = 4.0  # how long a site takes over a request
    max_tokens: int = 8
    drivers: int = 2  # processes that run the sites
    lease_ttl_s: float = 30.0
    checkpoint_interval_s: float = 1.0
    kill_one: bool = False  # SIGKILL one control-plane process halfway (needs 2 or more)
    timeout_s: float = 900.0


@dataclass
class Setup:
    """One run's store and processes."""

    store: str  # "sqlite" | "postgresql"
    url: str
    processes: int
    sites: int
    home: Path
    serves: list[LocalProcess] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    drivers: list[subprocess.Popen[str]] = field(default_factory=list)
    keys: dict[str, str] = field(default_factory=dict)

    @property
    def servers(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]


def _percentiles(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "p50_ms": None, "p99_ms": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)], 2)

    return {"n": len(ordered), "p50_ms": at(0.50), "p99_ms": at(0.99)}


def _env(options: ControlPlaneBenchOptions, home: Path) -> dict[str, str]:
    return {**os.environ, "MINIMILL_HOME": str(home), "MINIMILL_LOG_LEVEL": "WARNING",
            "MINIMILL_LEASE_TTL_S": str(options.lease_ttl_s),
            "MINIMILL_CHECKPOINT_INTERVAL_S": str(options.checkpoint_interval_s),
            # Placement's view of the other sites, as a large fleet would run (api/settings.py).
            "MINIMILL_PEER_VIEW_MAX_AGE_S": os.environ.get("MINIMILL_PEER_VIEW_MAX_AGE_S", "0.5")}


def _start_serves(setup: Setup, options: ControlPlaneBenchOptions) -> None:
    env = _env(options, setup.home)
    for i in range(setup.processes):
        port = free_port()
        args = [sys.executable, "-m", "minimill.cli", "serve", "--no-local-worker",
                "--port", str(port), "--model", MODEL, "--db", setup.url]
        proc = LocalProcess(args, env, setup.home / f"serve-{i}.log")
        proc.start()
        setup.serves.append(proc)
        setup.ports.append(port)
    for proc, url in zip(setup.serves, setup.servers, strict=True):
        proc.wait_for_serve(url, timeout=READY_TIMEOUT_S)


def _start_drivers(setup: Setup, options: ControlPlaneBenchOptions,
                   tokens: list[str]) -> None:
    drivers = max(1, min(options.drivers, len(tokens)))
    rate = options.max_tokens * options.capacity / options.request_s
    for d in range(drivers):
        first = d * len(tokens) // drivers
        mine = tokens[first:(d + 1) * len(tokens) // drivers]
        proc = subprocess.Popen([sys.executable, "-m", "minimill.bench.control_plane_sites"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env=_env(options, setup.home), start_new_session=True,
                                stderr=(setup.home / f"sites-{d}.log").open("a"))
        setup.drivers.append(proc)
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"servers": setup.servers, "tokens": mine,
                                     "first_site": first, "model": MODEL,
                                     "capacity": options.capacity, "rate": rate}) + "\n")
        proc.stdin.flush()
    for proc in setup.drivers:
        line = _readline(proc.stdout, READY_TIMEOUT_S)
        if line.strip() != "ready":
            raise BenchError(f"a sites process did not start; see {setup.home}/sites-*.log")


def _readline(stream: IO[str] | None, timeout_s: float) -> str:
    import select

    assert stream is not None
    ready, _, _ = select.select([stream], [], [], timeout_s)
    return stream.readline() if ready else ""


def _tell_drivers(setup: Setup, line: str) -> None:
    for proc in setup.drivers:
        assert proc.stdin is not None
        with contextlib.suppress(OSError):
            proc.stdin.write(line + "\n")
            proc.stdin.flush()


def _stop_drivers(setup: Setup) -> list[dict[str, Any]]:
    reports = []
    _tell_drivers(setup, "stop")
    for proc in setup.drivers:
        line = _readline(proc.stdout, 60.0)
        with contextlib.suppress(ValueError):
            reports.append(json.loads(line))
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    setup.drivers.clear()
    return reports


def _serve_cpu(setup: Setup) -> dict[int, float]:
    pids = [pid for p in setup.serves if p.popen is not None and p.popen.poll() is None
            for pid in process_tree(p.popen.pid)]
    return cpu_seconds(pids)


def _kill_one_when_half_done(setup: Setup, job: BatchJob, total: int) -> bool:
    """SIGKILL the last control-plane process once half the batch is done; True if it was."""
    counts = job.batch.get("request_counts") or {}
    if counts.get("completed", 0) * 2 < total:
        return False
    setup.serves[-1].kill9()
    return True


def _say_progress(err: Console, setup: Setup, job: BatchJob, realtime: Realtime,
                  started: float) -> None:
    counts = job.batch.get("request_counts") or {}
    err.print(f"{setup.store} x{setup.processes}, {setup.sites} sites: "
              f"{counts.get('completed', 0)} of {counts.get('total', '?')} batch requests "
              f"done, {realtime.answered} realtime answered "
              f"({time.perf_counter() - started:.0f}s)", highlight=False, soft_wrap=True)


def _drive(setup: Setup, options: ControlPlaneBenchOptions, total: int, err: Console,
           tag: str = "req", may_kill: bool = False) -> dict[str, Any]:
    """Submit `total` requests, wait for all of them; the figures measured meanwhile."""
    realtime_count = round(total * options.realtime_share)
    batch_count = total - realtime_count
    base = setup.servers[0] + "/v1"
    job = BatchJob(base, setup.keys["batch-tenant"])
    realtime = Realtime(base, setup.keys["realtime-tenant"], MODEL, realtime_count,
                        options.max_tokens)
    killed = not (may_kill and options.kill_one and setup.processes >= 2)
    cpu_before = _serve_cpu(setup)
    started = said = time.perf_counter()
    try:
        with StealMeter() as steal:
            job.submit(batch_lines(MODEL, batch_count, options.max_tokens, tag))
            realtime.start()
            deadline = time.monotonic() + options.timeout_s
            while not job.done():
                if time.monotonic() > deadline:
                    raise BenchError(f"the batch did not finish in {options.timeout_s:.0f}s; "
                                     f"see {setup.home}")
                if not killed:
                    killed = _kill_one_when_half_done(setup, job, batch_count)
                if time.perf_counter() - said >= stages.PROGRESS_EVERY_S:
                    said = time.perf_counter()
                    _say_progress(err, setup, job, realtime, started)
                time.sleep(0.25)
            if not realtime.join(max(1.0, deadline - time.monotonic())):
                raise BenchError("realtime calls did not finish in time")
        seconds = time.perf_counter() - started
        cpu_after = _serve_cpu(setup)
        ids, failed = job.custom_ids()
    finally:
        job.close()
    # A process that ended meanwhile (the one killed) counts up to its last reading.
    cpu = sum(cpu_after.get(pid, cpu_before.get(pid, 0.0)) - cpu_before.get(pid, 0.0)
              for pid in set(cpu_before) | set(cpu_after))
    return {"seconds": seconds, "cpu_s": cpu, "batch_status": job.batch.get("status"),
            "batch_failed": failed, "realtime_answered": realtime.answered,
            "realtime_expected": realtime_count, "realtime_errors": realtime.errors[:3],
            "killed_one": may_kill and options.kill_one and setup.processes >= 2 and killed,
            "steal": steal.share, **exactly_once(ids, batch_count, tag)}


def _run_one(options: ControlPlaneBenchOptions, store: str, url: str, processes: int,
             sites: int, home: Path, err: Console) -> dict[str, Any]:
    total = options.requests or max(200, 10 * sites)
    setup = Setup(store, url, processes, sites, home)
    fresh_store(url)
    what = f"{store} x{processes}, {sites} sites"
    try:
        with stages.stage(err, f"{what}: starting the control plane and the sites ..."):
            _start_serves(setup, options)
            setup.keys, tokens = register(url, setup.sites)
            _start_drivers(setup, options, tokens)
            # Unmeasured: every site's first calls, and the first batch's start-up costs (the
            # batch-jobs process, the first imports of each route).
            warm = _drive(setup, options, WARM_UP_REQUESTS, err, tag="warm")
        rows_before = pg_rows_written(url)
        _tell_drivers(setup, "mark")
        with stages.stage(err, f"{what}: {total} requests ..."):
            run = _drive(setup, options, total, err, may_kill=True)
        reports = _stop_drivers(setup)
    finally:
        _stop_drivers(setup)
        for proc in setup.serves:
            proc.stop()
    rows_after = pg_rows_written(url)  # after the processes flushed their statistics
    counts = store_counts(url)
    latencies: dict[str, list[float]] = {}
    stats: dict[str, int] = {}
    for report in reports:
        for route, values in report["latencies"].items():
            latencies.setdefault(route, []).extend(values)
        for key, value in report["stats"].items():
            stats[key] = stats.get(key, 0) + value
    rows = (rows_after - rows_before if rows_after is not None and rows_before is not None
            else None)
    everything = total + WARM_UP_REQUESTS
    ok = all(r["lost"] == 0 and r["duplicates"] == 0 and r["batch_failed"] == 0
             and r["realtime_answered"] == r["realtime_expected"] for r in (warm, run)) \
        and counts["succeeded"] == everything and counts["completions_accepted"] == everything
    return {
        "store": store, "processes": processes, "sites": sites, "requests": total,
        "seconds": round(run["seconds"], 2),
        "completed_per_s": round(total / run["seconds"], 1),
        "control_plane_cpu_s": round(run["cpu_s"], 2),
        "control_plane_cpu_ms_per_request": round(1000 * run["cpu_s"] / total, 3),
        "latency": {route: _percentiles(latencies.get(route, []))
                    for route in ("lease", "heartbeat", "complete")},
        "calls_per_request": {route: round(sum(r["calls"][route] for r in reports) / total, 2)
                              for route in ("lease", "heartbeat", "complete", "release")},
        "leases_expired": counts["leases_expired"],
        "leases_revoked_at_sites": stats.get("revoked", 0),
        "leases_granted": counts["leases_granted"],
        "stale_completions": counts["stale_completions"],
        "rows_written_per_request": round(rows / total, 2) if rows is not None else None,
        "exactly_once": ok, "lost": run["lost"], "duplicates": run["duplicates"],
        "unfinished": counts["unfinished"], "batch_status": run["batch_status"],
        "realtime_answered": run["realtime_answered"],
        "realtime_errors": run["realtime_errors"],
        "failed_calls": sum(r["failed_calls"] for r in reports),
        "shed_calls": sum(r["shed_calls"] for r in reports),
        "failovers": sum(r["failovers"] for r in reports),
        "killed_one_process": run["killed_one"],
        "site_errors": [e for r in reports for e in r["errors"]][:3],
        "cpu_steal": None if run["steal"] is None else round(run["steal"], 3),
    }


def setups(options: ControlPlaneBenchOptions, sqlite_url: str) -> Iterator[tuple[str, str, int]]:
    """(store kind, URL, processes) of each configuration to run."""
    if options.db is None or options.compare:
        yield "sqlite", sqlite_url, 1
    if options.db is not None:
        for k in options.processes:
            yield "postgresql", options.db, k


def run_control_plane_bench(options: ControlPlaneBenchOptions) -> dict[str, Any]:
    """Every configuration at every site count; the report as a dict."""
    from minimill.engine.hardware import cpu_info

    runs = []
    err = Console(stderr=True)
    root = Path(tempfile.mkdtemp(prefix="minimill-cp-bench-"))
    try:
        for n, sites in enumerate(options.sites):
            for m, (store, url, processes) in enumerate(setups(options, "")):
                home = root / f"run-{n}-{m}"
                home.mkdir()
                url = url or f"sqlite:///{home / 'data' / 'minimill.db'}"
                runs.append(_run_one(options, store, url, processes, sites, home, err))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"bench": "control-plane", "cpu_model": cpu_info().model, "cores": os.cpu_count(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "options": {"capacity": options.capacity, "request_s": options.request_s,
                        "max_tokens": options.max_tokens,
                        "realtime_share": options.realtime_share, "drivers": options.drivers,
                        "lease_ttl_s": options.lease_ttl_s,
                        "checkpoint_interval_s": options.checkpoint_interval_s},
            "runs": runs}
