"""`minimill worker`: one site of the fleet. Loads an engine, pulls leases from the control
plane over HTTP and runs them (fleet/loops.py), until SIGTERM/SIGINT: then it stops leasing,
lets running requests finish for a while (MINIMILL_WORKER_DRAIN_S, default 10 s), checkpoints
whatever is left, and exits. Started by `serve`, it also exits when its parent dies.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from minimill.fleet.client import ControlPlaneClient, SiteAuthError
from minimill.fleet.engines import EngineStartError, open_engine
from minimill.fleet.loops import Worker

log = logging.getLogger("minimill.worker")


def _watch_parent(worker: Worker) -> None:
    """Exit with the process that started us (serve), set through MINIMILL_PARENT_PID."""
    parent = os.environ.get("MINIMILL_PARENT_PID")
    if parent and os.getppid() != int(parent):
        log.warning("parent process %s is gone; stopping", parent)
        worker.stop()
        return
    asyncio.get_running_loop().call_later(1.0, _watch_parent, worker)


async def _amain(*, server: str, site: str, token: str, engine: str, model: str, dtype: str,
                 capacity: int) -> None:
    adapter = await open_engine(engine, model=model, dtype=dtype, capacity=capacity)
    client = ControlPlaneClient(server, token)
    effective = min(capacity, adapter.capacity) if engine == "builtin" else capacity
    worker = Worker(client, adapter, capacity=effective,
                    drain_timeout_s=float(os.environ.get("MINIMILL_WORKER_DRAIN_S", "10")),
                    stats_every_s=float(os.environ.get("MINIMILL_WORKER_STATS_S", "0")))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    _watch_parent(worker)
    log.info("worker for site %r ready: engine %s, models %s, capacity %d, control plane %s",
             site, engine, adapter.models, effective, server)
    try:
        await worker.run()
    finally:
        await client.close()
        await adapter.close()
        log.info("worker stopped: %s, generated_tokens %d", worker.stats,
                 worker.tally.generated_tokens)


def run_worker(*, server: str, site: str, token: str, price_per_hour: float, chip: str,
               engine: str, model: str, dtype: str, capacity: int) -> None:
    """Join the fleet at `server` as `site` and serve until SIGTERM/SIGINT.

    The site's price and chip are registered with the site (`minimill sites create`); the worker
    reports its measured tokens/s with every lease and heartbeat call.
    """
    logging.basicConfig(level=os.environ.get("MINIMILL_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s worker[{site}] %(levelname)s %(message)s",
                        stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per call is noise
    del price_per_hour, chip  # registered with the site; the protocol does not carry them
    if capacity < 1:
        raise SystemExit("--capacity must be at least 1")
    try:
        asyncio.run(_amain(server=server, site=site, token=token, engine=engine, model=model,
                           dtype=dtype, capacity=capacity))
    except (EngineStartError, SiteAuthError) as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None
