"""`minimill worker`: one site of the fleet. Loads an engine, pulls leases from the control
plane over HTTP and runs them (fleet/loops.py), until SIGTERM/SIGINT (or SIGHUP, its owner's
death): then it stops leasing,
lets running requests finish for a while (MINIMILL_WORKER_DRAIN_S, default 10 s), checkpoints
and hands back whatever is left, and exits; a second signal skips the wait. A signal while it
is still starting (loading the model, or before its control plane ever answered) ends it at
once. Started by `serve` (or any owner naming itself in MINIMILL_PARENT_PID), it also exits
when its parent dies (lifetime.py). Its log says where its start time went (startup.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import sys
import time
from types import FrameType

from minimill.fleet.client import ControlPlaneClient, SiteAuthError
from minimill.fleet.engines import EngineStartError, open_engine
from minimill.fleet.kv_options import KvOptions
from minimill.fleet.loops import Worker
from minimill.fleet.startup import StartClock
from minimill.lifetime import STOP_SIGNALS, die_with_parent, stop_reason
from minimill.protocol import MAX_CHIP_CHARS

log = logging.getLogger("minimill.worker")


class StoppedWhileStarting(BaseException):
    """SIGTERM or SIGINT arrived before the worker was running: nothing to hand back. A
    BaseException, as KeyboardInterrupt is, so that no `except Exception` on the way swallows
    it."""


def _stop_while_starting(signum: int, _frame: FrameType | None) -> None:
    # Raised in the main thread, between two bytecodes of whatever starts (imports, model
    # load, engine construction): the start unwinds and the process exits.
    raise StoppedWhileStarting(stop_reason(signum))


def _stop(worker: Worker, signum: int) -> None:
    log.info("%s: stopping", stop_reason(signum))
    worker.stop()


async def _log_first_lease(worker: Worker, clock: StartClock) -> None:
    while worker.first_lease_at is None:
        await asyncio.sleep(0.05)
    clock.mark("first lease")
    log.info("%s", clock.summary("first lease"))


async def _amain(*, server: str, site: str, token: str, engine: str, model: str, dtype: str,
                 capacity: int, price_per_hour: float | None, chip: str | None,
                 clock: StartClock, kv: KvOptions) -> None:
    adapter = await open_engine(engine, model=model, dtype=dtype, capacity=capacity,
                                clock=clock, engine_options=kv.engine_overrides())
    client = ControlPlaneClient(server, token)
    effective = min(capacity, adapter.capacity) if engine == "builtin" else capacity
    worker = Worker(client, adapter, capacity=effective,
                    drain_timeout_s=float(os.environ.get("MINIMILL_WORKER_DRAIN_S", "10")),
                    stats_every_s=float(os.environ.get("MINIMILL_WORKER_STATS_S", "0")),
                    price_per_hour=price_per_hour, chip=chip)
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, _stop, worker, sig)
    log.info("worker for site %r ready: engine %s, models %s, capacity %d, control plane %s",
             site, engine, adapter.models, effective, server)
    timing = asyncio.create_task(_log_first_lease(worker, clock))
    try:
        await worker.run()
    finally:
        timing.cancel()
        await client.close()
        await adapter.close()
        log.info("worker stopped: %s, generated_tokens %d", worker.stats,
                 worker.tally.generated_tokens)


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
               kv: KvOptions | None = None) -> None:
    """Join the fleet at `server` as `site` and serve until SIGTERM/SIGINT.

    The worker declares `price_per_hour` and `chip` with every lease call: they replace what
    the site was registered with (`minimill sites create`), and metering and placement use
    them. None keeps the registered values. It also reports its measured tokens/s with every
    lease and heartbeat call.
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
    chip = _check_declared(price_per_hour, chip)
    started = time.monotonic()
    try:
        asyncio.run(_amain(server=server, site=site, token=token, engine=engine, model=model,
                           dtype=dtype, capacity=capacity, price_per_hour=price_per_hour,
                           chip=chip, clock=clock, kv=kv or KvOptions()))
    except (EngineStartError, SiteAuthError) as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None
    except StoppedWhileStarting as exc:
        log.info("%s while starting (after %.1fs): exiting", exc, time.monotonic() - started)
