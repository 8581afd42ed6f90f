"""The control plane's HTTP app: routers, errors, and the background tasks of one process.

Each process runs a janitor (reap expired leases, expire batches, delete expired files; on
PostgreSQL one process at a time ticks: janitor_lock.py), the batch jobs (queue the lines of
new batches, write the files of finished ones: in a worker process, so that the event loop and
the heartbeats it serves never wait on them; each batch is claimed by one process), a webhook
sender, and a progress poller for its waiting realtime requests and streams. Every piece of
state is in the store, so any number of these processes can serve one store, and any of them
can be killed at any moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.to_process
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from sqlalchemy.engine import make_url
from starlette.routing import Route

from minimill import __version__
from minimill.api import errors, metrics
from minimill.api.box_wakeup import Wakeup
from minimill.api.lean_fleet import LeanFleetPath
from minimill.api.lease_wakeup import lease_wakeup_of, relook
from minimill.api.limits import BodyLimitMiddleware
from minimill.api.progress import ProgressWatcher
from minimill.api.request_ids import RequestIds
from minimill.api.routes import (
    agent_fleet,
    agents,
    batches,
    box_fleet,
    boxes,
    chat,
    completions,
    dashboard,
    embeddings,
    files,
    fleet,
    keys,
    models,
    prices,
    responses,
    sites,
    tenants,
    webhook_endpoints,
)
from minimill.api.routes import metrics as metrics_route
from minimill.api.settings import Settings
from minimill.api.webhook_sender import run_webhook_sender
from minimill.control.config import ControlConfig
from minimill.control.janitor import TickReport, batch_jobs, run_batch_jobs, tick
from minimill.control.janitor_lock import JanitorLock
from minimill.control.prompt_count import counter_for
from minimill.control.site_view import PeerView
from minimill.control.store import Store, open_store

__all__ = ["Settings", "create_app"]
log = logging.getLogger("minimill.api")


def _tick_if_held(lock: JanitorLock, store: Store, config: ControlConfig) -> TickReport | None:
    return tick(store, time.time(), config, False) if lock.held() else None


async def _janitor(store: Store, config: ControlConfig, interval_s: float,
                  requeued: Wakeup) -> None:
    """The janitor's ticks, in whichever process holds the janitor's lock (janitor_lock.py)."""
    lock = JanitorLock(store)
    try:
        while True:
            await _janitor_tick(lock, store, config, requeued)
            await asyncio.sleep(interval_s)
    finally:
        lock.release()


async def _janitor_tick(lock: JanitorLock, store: Store, config: ControlConfig,
                        requeued: Wakeup) -> None:
    try:
        report = await anyio.to_thread.run_sync(_tick_if_held, lock, store, config)
        if report is not None:
            if report.reaped_leases:
                requeued.notify(report.reaped_leases)  # back in the queue: workers take them
            if (report.reaped_leases or report.expired_batches or report.reaped_boxes
                    or report.reaped_agents or report.idle_boxes or report.purged_requests):
                log.info("janitor: %s", report)
    except Exception:  # the store may be briefly unreachable; try again next tick
        log.exception("janitor tick failed")


async def _batch_jobs(store: Store, config: ControlConfig, wake: asyncio.Event,
                      interval_s: float, in_process: bool, queued: Wakeup) -> None:
    """Ingest new batches as they come and finalize finished ones (a create wakes it; it also
    polls, for batches of other processes or left behind by a dead one). A store held only
    in this process's memory cannot be opened by another: then the jobs run in a thread."""
    in_process = in_process or make_url(store.url).database in (None, "", ":memory:")
    while True:
        wake.clear()
        try:
            if in_process:
                done = await anyio.to_thread.run_sync(batch_jobs, store, time.time(), config)
            else:
                # Cancellable: on shutdown the worker process is killed; its claims go stale
                # and another process resumes its jobs.
                done = await anyio.to_process.run_sync(run_batch_jobs, store.url, time.time(),
                                                       config, cancellable=True)
            if any(done):
                log.info("batch jobs: %d validated, %d finalized", *done)
            if done[0]:
                queued.notify()  # a validated batch's requests are queued (lines by the many)
        except Exception:  # the store may be briefly unreachable; try again
            log.exception("batch jobs failed")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), interval_s)


def create_app(settings: Settings | None = None, store: Store | None = None) -> FastAPI:
    """The app; `store` may be passed in (tests, or a caller that opened it already)."""
    settings = settings or Settings()
    config = settings.control_config()
    owned = store is None
    the_store = store if store is not None else open_store(settings.db)
    watcher = ProgressWatcher(the_store, settings.poll_interval_s)
    ingest_wake = asyncio.Event()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # The served models' tokenizers (what bills are counted with), once per process: a
        # model without one is named in the log now rather than at its first request.
        for model in config.served_models:
            await anyio.to_thread.run_sync(counter_for, model)
        tasks = [asyncio.create_task(watcher.run(), name="minimill-progress"),
                 asyncio.create_task(relook(the_store, lease_wakeup_of(_app)),
                                     name="minimill-lease-relook")]
        if settings.run_janitor:
            wakeup = lease_wakeup_of(_app)
            tasks.append(asyncio.create_task(
                _janitor(the_store, config, settings.janitor_interval_s, wakeup),
                name="minimill-janitor"))
            tasks.append(asyncio.create_task(
                _batch_jobs(the_store, config, ingest_wake, settings.janitor_interval_s,
                            settings.batch_jobs_in_process, wakeup),
                name="minimill-batch-jobs"))
        if settings.run_webhooks:
            tasks.append(asyncio.create_task(
                run_webhook_sender(the_store, config, settings.webhook_interval_s,
                                   settings.webhook_timeout_s), name="minimill-webhooks"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if owned:
                the_store.close()

    # FastAPI's own OpenTelemetry is off: minimill's metrics are Prometheus (metrics.py), and
    # the check for configured OpenTelemetry providers, three environment lookups at every
    # request, was 2% of the control plane's CPU under `bench control-plane`.
    app = FastAPI(title="minimill", version=__version__, lifespan=lifespan,
                  telemetry={"tracing": False, "metrics": False, "logs": False},
                  description="OpenAI-compatible token factory: chat, completions, embeddings, "
                              "responses, files, batches, webhooks, boxes, agents; plus the fleet "
                              "protocol for worker sites.")
    app.state.store = the_store
    app.state.config = config
    app.state.settings = settings
    app.state.watcher = watcher
    app.state.peer_view = PeerView(settings.peer_view_max_age_s)
    app.state.ingest_wake = ingest_wake
    errors.install(app)
    if settings.lean_fleet_path:
        app.add_middleware(LeanFleetPath)  # innermost: every middleware below wraps it
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes,
                       max_file_bytes=settings.max_file_bytes,
                       max_fleet_body_bytes=settings.max_fleet_body_bytes)
    app.state.metrics = metrics.install(app, the_store)
    app.add_middleware(RequestIds)
    for module in (models, chat, completions, embeddings, responses, files, batches,
                   webhook_endpoints, boxes, agents, fleet, box_fleet, agent_fleet):
        app.include_router(module.router)
    operator_routers = (sites.router, prices.router, keys.router, tenants.router,
                        metrics_route.router, dashboard.router)
    for router in operator_routers:
        app.include_router(router)
    # A wrong method on these answers 404 too (errors.py), as an unknown URL would.
    app.state.operator_paths = [r.path_regex for router in operator_routers
                                for r in router.routes if isinstance(r, APIRoute)]
    _openapi_without_422(app)
    _openapi_off_the_loop(app)
    return app


def _openapi_off_the_loop(app: FastAPI) -> None:
    """/openapi.json builds the schema in a thread: for an app this size that takes seconds
    (FastAPI's route runs it on the event loop, where it would hold every other call, sites'
    leases and heartbeats included, until it is done); it is cached after the first call."""

    async def openapi_json(_request: Request) -> JSONResponse:
        return JSONResponse(await anyio.to_thread.run_sync(app.openapi))

    routes = app.router.routes
    for i, route in enumerate(routes):
        if isinstance(route, Route) and route.path == app.openapi_url:
            routes[i] = Route(route.path, openapi_json, include_in_schema=False)


def _openapi_without_422(app: FastAPI) -> None:
    """Validation errors are 400 OpenAI error objects here, never FastAPI's 422."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
