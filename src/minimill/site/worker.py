"""`minimill worker`: one site of the fleet. Loads an engine, pulls leases from the control
plane over HTTP and runs them (fleet/loops.py), until SIGTERM/SIGINT (or SIGHUP, its owner's
death): then it stops leasing,
lets running requests finish for a while (MINIMILL_WORKER_DRAIN_S, default 10 s), checkpoints
and hands back whatever is left, and exits; a second signal skips the wait. If its engine
dies (its process, or one of its pipeline stages, killed or crashed), it hands back every
unfinished lease with its checkpoint at once and exits with status 3, for a supervisor to
start the site again. A signal while it
is still starting (loading the model, or before its control plane ever answered) ends it at
once. Started by `serve` (or any owner naming itself in MINIMILL_PARENT_PID), it also exits
when its parent dies (lifetime.py). Its log says where its start time went (startup.py).

A site runs one worker, so whatever the site still holds when its worker starts was the
previous run's (killed, not drained). With a KV flash tier, whose files outlive the process
(the KV of every full block is written through), the worker takes those leases back with its
first lease call and resumes them from the KV on flash instead of recomputing their context.
Without one, it gives them back before its first lease call, so that other sites resume them at
once instead of when the leases expire.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Coroutine
from types import FrameType
from typing import Any

from minimill import event_loop
from minimill.agents.runner import AgentRunner, RunnerStartError, open_runner
from minimill.boxes.host import BoxHost
from minimill.boxes.host_setup import BoxHostStartError, BoxOptions, open_box_host
from minimill.fleet.engine_factory import open_engine
from minimill.fleet.engines import EngineDiedError, EngineStartError
from minimill.fleet.kv_options import KvOptions
from minimill.fleet.loops import Worker
from minimill.fleet.startup import StartClock
from minimill.lifetime import STOP_SIGNALS, die_with_parent, stop_reason
from minimill.transport.client import (
    ControlPlaneClient,
    SiteAuthError,
)
from minimill.transport.protocol import MAX_CHIP_CHARS

log = logging.getLogger("minimill.worker")
NO_ENGINE = "none"  # --engine none: a box host that serves no tokens
# The exit status of a worker whose engine died (a pipeline stage killed, the engine process
# crashed): its leases went back, and a supervisor starts the site again.
ENGINE_DIED_STATUS = 3


class StoppedWhileStarting(BaseException):
    """SIGTERM or SIGINT arrived before the worker was running: nothing to hand back. A
    BaseException, as KeyboardInterrupt is, so that no `except Exception` on the way swallows
    it."""


def _stop_while_starting(signum: int, _frame: FrameType | None) -> None:
    # Raised in the main thread, between two bytecodes of whatever starts (imports, model
    # load, engine construction): the start unwinds and the process exits.
    raise StoppedWhileStarting(stop_reason(signum))


async def _stoppable_start(main: Coroutine[Any, Any, None]) -> None:
    """Run `main`, a stop signal cancelling it until it installs its own handlers (once the
    worker runs). asyncio's handlers wake the loop whichever thread the kernel hands the
    signal to: while the engine starts in a thread of its own, a plain Python handler would
    only run when the loop's poll next ended, i.e. when the engine had started."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    received: list[int] = []

    def cancel_start(signum: int) -> None:
        received.append(signum)
        task.cancel()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, cancel_start, sig)
    try:
        await main
    except asyncio.CancelledError:
        if received:
            raise StoppedWhileStarting(stop_reason(received[0])) from None
        raise


def _stop(worker: Worker, signum: int, box_host: BoxHost | None = None,
          runner: AgentRunner | None = None) -> None:
    log.info("%s: stopping", stop_reason(signum))
    worker.stop()
    _stop_sidelines(box_host, runner)


def _stop_sidelines(box_host: BoxHost | None, runner: AgentRunner | None,
                    signum: int | None = None) -> None:
    """Stop what a worker runs beside the engine: its box host and its agent runner."""
    if signum is not None:
        log.info("%s: stopping", stop_reason(signum))
    if box_host is not None:
        box_host.stop()
    if runner is not None:
        runner.stop()


async def _log_first_lease(worker: Worker, clock: StartClock) -> None:
    while worker.first_lease_at is None:
        await asyncio.sleep(0.05)
    clock.mark("first lease")
    log.info("%s", clock.summary("first lease"))


async def _run_runner(runner: AgentRunner | None) -> None:
    if runner is None:
        return
    try:
        await runner.run()
    finally:
        await runner.client.close()
        log.info("agent runner stopped: %s", runner.stats)


async def _run_box_host(host: BoxHost | None) -> None:
    if host is None:
        return
    try:
        await host.run()
    finally:
        await host.client.close()
        log.info("box host stopped: %s", host.stats)


async def _amain(*, server: str, site: str, token: str, engine: str, model: str, dtype: str,
                 capacity: int, price_per_hour: float | None, chip: str | None,
                 clock: StartClock, kv: KvOptions, boxes: BoxOptions,
                 agents: int = 0, pipeline_stages: int = 1, expert_parallel: int = 1,
                 max_memory_gb: float | None = None, stages_listen: str | None = None
                 ) -> None:
    # Boxes first: a host that cannot isolate them says so before a long model load.
    box_host = open_box_host(server, token, site, boxes) if boxes.slots > 0 else None
    runner = open_runner(server, token, agents, boxes.insecure_no_sandbox) if agents else None
    try:
        loop = asyncio.get_running_loop()
        if engine == NO_ENGINE:
            if box_host is None and runner is None:
                raise SystemExit("--engine none serves no tokens: give it --boxes N or --agents N")
            for sig in STOP_SIGNALS:
                loop.add_signal_handler(sig, _stop_sidelines, box_host, runner, sig)
            log.info("worker for site %r ready: no engine, %d boxes, %d agents, control plane %s",
                     site, boxes.slots, agents, server)
            await asyncio.gather(_run_box_host(box_host), _run_runner(runner))
            return
        client = ControlPlaneClient(server, token)
        keeps_kv = engine == "builtin" and bool(kv.flash_dir)
        engine_options = kv.engine_overrides()
        if pipeline_stages > 1:
            engine_options["pipeline_stages"] = pipeline_stages
        if expert_parallel > 1:
            engine_options["expert_parallel"] = expert_parallel
        if max_memory_gb is not None:
            engine_options["max_memory_gb"] = max_memory_gb
        if stages_listen is not None:
            engine_options["stages_listen"] = stages_listen
        try:
            adapter = await open_engine(engine, model=model, dtype=dtype, capacity=capacity,
                                        clock=clock, engine_options=engine_options)
        except BaseException:
            await client.close()
            raise
        effective = min(capacity, adapter.capacity) if engine == "builtin" else capacity
        worker = Worker(client, adapter, capacity=effective,
                        drain_timeout_s=float(os.environ.get("MINIMILL_WORKER_DRAIN_S", "10")),
                        stats_every_s=float(os.environ.get("MINIMILL_WORKER_STATS_S", "0")),
                        price_per_hour=price_per_hour, chip=chip)
        # The site may still hold leases from this worker's killed run: a worker whose KV survived
        # (a flash tier) takes them back and resumes them from it; any other gives them back first,
        # so they go out again at once instead of after their TTL.
        worker.adopt_held = keeps_kv
        worker.give_back_held = not keeps_kv
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, _stop, worker, sig, box_host, runner)
        log.info("worker for site %r ready: engine %s, models %s, capacity %d, boxes %d, "
                 "control plane %s", site, engine, adapter.models, effective, boxes.slots, server)
        timing = asyncio.create_task(_log_first_lease(worker, clock))
        sidelines = asyncio.gather(_run_box_host(box_host), _run_runner(runner))
        try:
            await worker.run()
        finally:
            timing.cancel()
            # After a signal they are stopping already, and a second stop() would cut the agent
            # runner's hand-back short (it skips the wait for effects in flight).
            if not worker.stopping.is_set():
                _stop_sidelines(box_host, runner)
            await asyncio.gather(sidelines, return_exceptions=True)
            await client.close()
            await adapter.close()
            log.info("worker stopped: %s, generated_tokens %d", worker.stats,
                     worker.tally.generated_tokens)
    finally:
        if box_host is not None and boxes.box_dir is None:
            # Its directory is this process's own (named by its pid): nothing of it is
            # needed once the host has stopped, or if it never ran.
            shutil.rmtree(box_host.root, ignore_errors=True)


def _check_declared(price_per_hour: float | None, chip: str | None) -> str | None:
    """Refuse a price or chip the control plane would refuse (at every lease call); returns
    the chip name as it is declared."""
    if price_per_hour is not None and not (math.isfinite(price_per_hour) and price_per_hour >= 0):
        raise SystemExit(f"--price-per-hour must be a number >= 0, not {price_per_hour}")
    if chip is None:
        return None
    chip = chip.strip()
    if not 1 <= len(chip) <= MAX_CHIP_CHARS:
        raise SystemExit(f"--chip must have 1 to {MAX_CHIP_CHARS} characters")
    return chip


def run_worker(*, server: str, site: str, token: str, price_per_hour: float | None,
               chip: str | None, engine: str, model: str, dtype: str, capacity: int,
               kv: KvOptions | None = None, boxes: BoxOptions | None = None,
               agents: int = 0, pipeline_stages: int = 1, expert_parallel: int = 1,
               max_memory_gb: float | None = None, stages_listen: str | None = None) -> None:
    """Join the fleet at `server` as `site` and serve until SIGTERM/SIGINT.

    The worker declares `price_per_hour` and `chip` with every lease call: they replace what
    the site was registered with (`minimill sites create`), and metering and placement use
    them. None keeps the registered values. It also reports its measured tokens/s with every
    lease and heartbeat call. With `boxes.slots` > 0 it is a box host too (boxes/host.py),
    with `agents` > 0 an agent runner (agents/runner.py); engine "none" serves no tokens.
    """
    logging.basicConfig(level=os.environ.get("MINIMILL_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s worker[{site}] %(levelname)s %(message)s",
                        stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per call is noise
    clock = StartClock()
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop_while_starting)
    die_with_parent()
    log.info("worker for site %r starting (pid %d)", site, os.getpid())
    if capacity < 1:
        raise SystemExit("--capacity must be at least 1")
    if pipeline_stages > 1 and engine != "builtin":
        raise SystemExit("--pipeline-stages needs the builtin engine (--engine builtin)")
    if expert_parallel > 1 and engine != "builtin":
        raise SystemExit("--expert-parallel needs the builtin engine (--engine builtin)")
    if max_memory_gb is not None and engine != "builtin":
        raise SystemExit("--max-memory-gb needs the builtin engine (--engine builtin)")
    if max_memory_gb is not None and not max_memory_gb > 0:
        raise SystemExit(f"--max-memory-gb must be > 0, not {max_memory_gb}")
    if stages_listen is not None and (engine != "builtin" or (
            pipeline_stages < 2 and expert_parallel < 2 and max_memory_gb is None)):
        raise SystemExit("--stages-listen needs the builtin engine and --pipeline-stages or "
                         "--expert-parallel of 2 or more")
    chip = _check_declared(price_per_hour, chip)
    started = time.monotonic()
    try:
        event_loop.run(_stoppable_start(_amain(
            server=server, site=site, token=token, engine=engine, model=model, dtype=dtype,
            capacity=capacity, price_per_hour=price_per_hour, chip=chip, clock=clock,
            kv=kv or KvOptions(), boxes=boxes or BoxOptions(), agents=agents,
            pipeline_stages=pipeline_stages, expert_parallel=expert_parallel,
            max_memory_gb=max_memory_gb, stages_listen=stages_listen)))
    except (EngineStartError, SiteAuthError, BoxHostStartError, RunnerStartError) as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None
    except EngineDiedError as exc:
        log.error("exiting with status %d: the engine of site %r died (%s); its leases were "
                  "handed back", ENGINE_DIED_STATUS, site, exc)
        raise SystemExit(ENGINE_DIED_STATUS) from None
    except StoppedWhileStarting as exc:
        log.info("%s while starting (after %.1fs): exiting", exc, time.monotonic() - started)
        # Nothing was handed out yet, so nothing is owed: leave at once. An ordinary exit
        # would wait for the engine's child (multiprocessing joins it at exit, and it ignores
        # SIGTERM: its parent decides when it stops) until it had finished starting; it dies
        # with this process instead (its parent-death signal).
        logging.shutdown()
        os._exit(0)
