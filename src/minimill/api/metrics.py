"""Prometheus metrics (prometheus_client conventions), one registry per app.

- HTTP, per process: `minimill_http_requests_total{method,route,status}` and
  `minimill_http_request_duration_seconds{method,route}` (route: the path template, so ids do
  not make new series; unmatched paths count as "unmatched").
- Fleet, from the store at scrape time (the same for every process): queue depth by tier and
  status, and per site tokens generated, completions, leases granted and expired, stale
  completions, completions refused for their usage report, wasted tokens, cost and billed
  dollars.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minimill.control.fleet_stats import fleet_stats
from minimill.control.records import ACTIVE_REQUEST_STATUSES, Tier
from minimill.control.store import Store

_SITE_COUNTERS = (
    ("tokens_generated", "minimill_site_tokens", "Output tokens of accepted completions."),
    ("completions", "minimill_site_completions", "Accepted completions."),
    ("leases_granted", "minimill_site_leases_granted", "Leases granted."),
    ("leases_expired", "minimill_site_lease_expiries", "Leases that expired (site went dark)."),
    ("stale_completions", "minimill_site_stale_completions",
     "Completions rejected at a stale epoch or after another site completed the request."),
    ("usage_rejections", "minimill_site_usage_rejections",
     "Completions rejected because their usage report disagreed with what they returned."),
    ("wasted_tokens", "minimill_site_wasted_tokens", "Tokens of rejected completions."),
    ("cost_usd", "minimill_site_cost_usd", "What the site's held time cost, in US dollars."),
    ("billed_usd", "minimill_site_billed_usd", "What tenants were billed for its tokens."),
)


class FleetCollector(Collector):
    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        stats = fleet_stats(self.store)
        depth = GaugeMetricFamily("minimill_queue_depth", "Requests queued or leased, by tier.",
                                  labels=["tier", "status"])
        for tier in Tier:
            for status in ACTIVE_REQUEST_STATUSES:
                depth.add_metric([tier.value, status.value],
                                 stats.queue.get((tier.value, status.value), 0))
        yield depth
        for field, name, doc in _SITE_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["site", "chip"])
            for site in stats.sites:
                family.add_metric([site.name, site.chip], getattr(site, field))
            yield family


class _Measure:
    """Counts and times every HTTP request by route template and status.

    A plain ASGI middleware, not Starlette's BaseHTTPMiddleware: that one wraps the receive
    channel, and a handler waiting on a realtime request would no longer see its client go
    away (and cancel the request)."""

    def __init__(self, app: ASGIApp, requests: Counter, latency: Histogram) -> None:
        self.app, self.requests, self.latency = app, requests, latency

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client gets if the app raises before it answers

        async def send_measured(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                self.latency.labels(scope["method"], _route_path(scope)).observe(
                    time.perf_counter() - start)
            await send(message)

        try:
            await self.app(scope, receive, send_measured)
        finally:
            self.requests.labels(scope["method"], _route_path(scope), str(status)).inc()


def _route_path(scope: Scope) -> str:
    """The matched route's template (`/v1/batches/{batch_id}`), so labels stay few."""
    return str(getattr(scope.get("route"), "path", "unmatched"))


def install(app: FastAPI, store: Store) -> CollectorRegistry:
    registry = CollectorRegistry()
    requests = Counter("minimill_http_requests", "HTTP requests answered.",
                       ["method", "route", "status"], registry=registry)
    latency = Histogram("minimill_http_request_duration_seconds",
                        "Time to the response's first byte.", ["method", "route"],
                        registry=registry)
    registry.register(FleetCollector(store))

    app.add_middleware(_Measure, requests=requests, latency=latency)
    return registry
