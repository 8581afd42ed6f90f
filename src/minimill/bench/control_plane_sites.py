"""Many simulated sites in one process, for `minimill bench control-plane`.

Each site is the real worker (fleet/loops.py's `Worker`: lease, heartbeat with checkpoint
deltas, complete, release) over the real HTTP client (transport/client.py), running the fake
engine (fleet/fake_engine.py) at a declared rate, so what the control plane serves is the fleet
protocol exactly as remote sites speak it; only the engine is a stand-in. Hundreds of sites
share one event loop, so a few processes drive a thousand sites.

The client in front of each site stands in for a load balancer: it starts on one of the
control-plane processes and moves to the next one when a call cannot reach it (a process
killed). Every call's latency is kept per route: lease calls only when they did not ask to be
held open (a held call's time is the wait for work, not the control plane's).

Run as `python -m minimill.bench.control_plane_sites` with a JSON spec on stdin's first line;
the sites run until stdin's next line other than "mark" (which starts the calls' timings
afresh), or its end; then one JSON line of figures goes to stdout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import BaseModel

from minimill import event_loop
from minimill.fleet.fake_engine import FakeEngineAdapter
from minimill.fleet.loops import Worker
from minimill.transport.client import ControlPlaneClient, ControlPlaneUnavailable
from minimill.transport.protocol import FLEET_PREFIX, LeaseRequest

log = logging.getLogger("minimill.bench")
ROUTES = ("lease", "heartbeat", "complete", "release")


@dataclass
class Latencies:
    """Seconds per answered call, by route (`/lease` without the leading slash)."""

    seconds: dict[str, list[float]] = field(default_factory=lambda: {r: [] for r in ROUTES})
    # Every call answered, by route, held lease calls included.
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROUTES, 0))
    failed: int = 0
    # Lease calls the control plane refused for want of a turn (503): asked again, not lost.
    shed: int = 0
    failovers: int = 0


class BalancedClient(ControlPlaneClient):
    """A site's client: timed calls, moving to the next server when one cannot be reached."""

    def __init__(self, servers: list[str], first: int, token: str,
                 latencies: Latencies) -> None:
        super().__init__(servers[first % len(servers)], token)
        self._servers, self._at, self._latencies = servers, first % len(servers), latencies

    def _fail_over(self) -> None:
        self._at = (self._at + 1) % len(self._servers)
        self._client.base_url = httpx.URL(self._servers[self._at].rstrip("/") + FLEET_PREFIX)
        self._latencies.failovers += 1

    async def _post(self, path: str, message: BaseModel, response_type: type[Any]) -> Any:
        started = time.perf_counter()
        try:
            answer = await super()._post(path, message, response_type)
        except ControlPlaneUnavailable as exc:
            if exc.status == 503:
                self._latencies.shed += 1
            else:
                self._latencies.failed += 1
            if isinstance(exc.__cause__, httpx.TransportError) and len(self._servers) > 1:
                self._fail_over()
            raise
        self._latencies.calls[path.strip("/")] += 1
        held_open = isinstance(message, LeaseRequest) and message.wait_s > 0
        if not held_open:
            self._latencies.seconds[path.strip("/")].append(time.perf_counter() - started)
        return answer


async def _run_sites(spec: dict[str, Any]) -> dict[str, Any]:
    latencies = Latencies()
    workers = []
    for i, token in enumerate(spec["tokens"]):
        adapter = FakeEngineAdapter(spec["model"], spec["capacity"], spec["rate"])
        client = BalancedClient(spec["servers"], spec["first_site"] + i, token, latencies)
        workers.append(Worker(client, adapter, capacity=spec["capacity"], drain_timeout_s=0.0))
    tasks = [asyncio.create_task(w.run()) for w in workers]
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    # The orchestrator says when the measured part starts ("mark") and when to stop.
    while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "mark":
        latencies.seconds = {r: [] for r in ROUTES}
        latencies.calls = dict.fromkeys(ROUTES, 0)
    for worker in workers:
        worker.stop()
        worker.stop()  # no drain: whatever still runs is handed back
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for worker in workers:
        await worker.client.close()
    stats: dict[str, int] = {}
    for worker in workers:
        for key, value in worker.stats.items():
            stats[key] = stats.get(key, 0) + value
    return {"latencies": latencies.seconds, "calls": latencies.calls,
            "failed_calls": latencies.failed, "shed_calls": latencies.shed,
            "failovers": latencies.failovers, "stats": stats,
            "errors": [repr(r) for r in results if isinstance(r, BaseException)][:5]}


def main() -> None:
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr,
                        format="%(asctime)s sites %(levelname)s %(message)s")
    spec = json.loads(sys.stdin.readline())
    report = event_loop.run(_run_sites(spec))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
