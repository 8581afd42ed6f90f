"""`minimill bench fairness`: does a heavy tenant starve a light one?

A real `minimill serve` (no local worker) and one `minimill worker`; two tenants with keys of
their own, each submitting Batch API jobs through the official openai client. First the light
tenant's batch runs alone (after one unmeasured run); then the heavy tenant submits ten times as
much work, and once it fills the site (its requests finish at staggered times, as a real
engine's of mixed lengths do) the light tenant submits the same batch again. Figures: the light
tenant's p50 finish time (each request's end, from the control plane's rows, less the batch's
creation) alone and beside the heavy tenant, their ratio beside the target, and the site's busy
share while the light batch ran (leased requests over the site's capacity, sampled from the
store): fair share must not leave the machine idle.

The worker runs the fake engine by default (`fake:RATE`: a request takes max_tokens x
capacity / RATE seconds whatever else runs, fleet/fake_engine.py): what is measured is the
control plane's placement, and a model on a small CPU would take many minutes to show it.
`--engine builtin` runs the real model instead.
"""

from __future__ import annotations

import io
import json
import statistics
import threading
from dataclasses import dataclass
from typing import Any

TARGET_RATIO = 1.5
TARGET_BUSY_SHARE = 0.8


@dataclass(frozen=True, slots=True)
class FairnessBenchOptions:
    model: str = "smollm2-135m"
    dtype: str = "auto"
    engine: str = "fake"  # "fake" (at `rate`) or "builtin"
    light_requests: int = 8
    heavy_factor: int = 10
    capacity: int = 16
    rate: float = 320.0  # fake engine: output tokens/s of a full batch
    max_tokens: int = 32
    timeout_s: float = 900.0


def _lines(tag: str, model: str, count: int, max_tokens: Any) -> bytes:
    out = io.StringIO()
    for i in range(count):
        out.write(json.dumps({
            "custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": max_tokens(i),
                     "messages": [{"role": "user", "content": f"Request {i} of {tag}."}]}}))
        out.write("\n")
    return out.getvalue().encode()


def _submit(client: Any, tag: str, content: bytes) -> Any:
    uploaded = client.files.create(file=(f"{tag}.jsonl", content), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                 completion_window="24h")


class _BusySampler:
    """Leased requests (and the light tenant's of them) sampled from the store."""

    def __init__(self, store: Any, light_tenant: str, interval_s: float = 0.1) -> None:
        self.store, self.light_tenant, self.interval_s = store, light_tenant, interval_s
        self.samples: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from sqlalchemy import case, func, select

        from minimill.control.tables import requests

        light = func.sum(case((requests.c.tenant_id == self.light_tenant, 1), else_=0))
        query = select(func.count(), light).where(requests.c.status == "leased")
        while not self._stop.wait(self.interval_s):
            with self.store.read() as conn:
                total, of_light = conn.execute(query).one()
            self.samples.append((int(total or 0), int(of_light or 0)))

    def __enter__(self) -> _BusySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _finish_times(store: Any, batch_id: str, created_at: float) -> list[float]:
    from sqlalchemy import select

    from minimill.control.tables import requests

    with store.read() as conn:
        ends = conn.execute(select(requests.c.finished_at).where(
            requests.c.batch_id == batch_id, requests.c.status == "succeeded")).scalars().all()
    return sorted(end - created_at for end in ends if end is not None)


def _run_light(client: Any, store: Any, content: bytes, timeout_s: float) -> dict[str, Any]:
    from minimill.bench.batch_wait import wait_for_batch

    batch = _submit(client, "light", content)
    done = wait_for_batch(client, batch.id, lambda b: b.status in (
        "completed", "failed", "expired", "cancelled"), timeout_s)
    if done.status != "completed":
        raise RuntimeError(f"the light batch ended {done.status}")
    times = _finish_times(store, batch.id, float(batch.created_at))
    return {"p50_s": statistics.median(times), "max_s": max(times), "requests": len(times)}


def run_fairness_bench(options: FairnessBenchOptions) -> dict[str, Any]:
    """Run the bench; returns the report (the CLI prints it)."""
    from openai import OpenAI

    from minimill.bench.batch_wait import wait_for_batch
    from minimill.bench.local_fleet import LocalFleet
    from minimill.control.keys import create_key, ensure_tenant
    from minimill.control.store import open_store

    engine = f"fake:{options.rate:g}" if options.engine == "fake" else options.engine
    light_n = options.light_requests
    heavy_n = light_n * options.heavy_factor
    fleet = LocalFleet(options.model, options.dtype, local_worker=False,
                       env={"MINIMILL_JANITOR_INTERVAL_S": "0.1"})
    try:
        fleet.start()
        fleet.worker("bench", fleet.site_token("bench"), "--engine", engine,
                     "--capacity", str(options.capacity)).start()
        fleet.workers["bench"].wait_for_log(r"worker for site 'bench' ready")
        store = open_store(f"sqlite:///{fleet.home / 'data' / 'minimill.db'}")
        try:
            keys = {t: create_key(store, t) for t in ("light", "heavy")}
            light_id = ensure_tenant(store, "light").id
            light_lines = _lines("light", options.model, light_n, lambda _: options.max_tokens)
            # Mixed lengths around the light tenant's, so that the heavy tenant's requests
            # end at staggered times, as a real engine's do.
            heavy_lines = _lines("heavy", options.model, heavy_n,
                                 lambda i: max(1, options.max_tokens // 4
                                               + (i * 37) % (options.max_tokens * 3 // 2 + 1)))
            light = OpenAI(base_url=fleet.base_url, api_key=keys["light"], max_retries=2)
            heavy = OpenAI(base_url=fleet.base_url, api_key=keys["heavy"], max_retries=2)
            _run_light(light, store, light_lines, options.timeout_s)  # warm-up: first leases
            with _BusySampler(store, light_id) as alone_busy:
                alone = _run_light(light, store, light_lines, options.timeout_s)
            heavy_batch = _submit(heavy, "heavy", heavy_lines)
            # The heavy tenant has filled the site and its requests now end at staggered times.
            wait_for_batch(heavy, heavy_batch.id, lambda b: b.request_counts is not None
                           and b.request_counts.completed >= options.capacity,
                           options.timeout_s)
            with _BusySampler(store, light_id) as beside_busy:
                beside = _run_light(light, store, light_lines, options.timeout_s)
            heavy_state = heavy.batches.retrieve(heavy_batch.id)
            if heavy_state.status in ("validating", "in_progress"):
                heavy.batches.cancel(heavy_batch.id)  # the rest is not measured
        finally:
            store.close()
    finally:
        fleet.close()
    ratio = beside["p50_s"] / alone["p50_s"]
    samples = beside_busy.samples or [(0, 0)]
    # A finished request stays leased until its completion call lands, while the worker may
    # already run the next one in its slot: a sample over capacity counts as full.
    busy_share = statistics.mean(min(total, options.capacity)
                                 for total, _ in samples) / options.capacity
    light_share = statistics.mean(of_light for _, of_light in samples) / options.capacity
    alone_samples = alone_busy.samples or [(0, 0)]
    return {
        "engine": engine, "model": options.model, "capacity": options.capacity,
        "light_requests": light_n, "heavy_requests": heavy_n,
        "max_tokens": options.max_tokens,
        "light_p50_alone_s": round(alone["p50_s"], 3),
        "light_p50_beside_heavy_s": round(beside["p50_s"], 3),
        "light_max_alone_s": round(alone["max_s"], 3),
        "light_max_beside_heavy_s": round(beside["max_s"], 3),
        "p50_ratio": round(ratio, 3), "ratio_target": TARGET_RATIO,
        "busy_share_beside": round(busy_share, 3), "busy_share_target": TARGET_BUSY_SHARE,
        "light_share_of_slots_beside": round(light_share, 3),
        "busy_share_alone": round(statistics.mean(min(t, options.capacity)
                                                  for t, _ in alone_samples)
                                  / options.capacity, 3),
        "heavy_completed_when_light_finished": (heavy_state.request_counts.completed
                                                if heavy_state.request_counts else None),
        "meets_targets": ratio <= TARGET_RATIO and busy_share >= TARGET_BUSY_SHARE,
    }
