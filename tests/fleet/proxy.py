"""A loopback HTTP proxy between one worker and the control plane, for fleet tests.

It forwards every request unchanged and records the fleet messages (heartbeats with their
checkpoints, completions with their answers). It can also black-hole chosen routes: a request
to a blocked route hangs while the route stays blocked (as over a cut link) and then fails. And
it can lose answers: the control plane handles the request, the worker gets a 502.
Runs uvicorn in a thread of the test process; the worker and control plane are real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


@dataclass
class Exchange:
    path: str
    request: Any
    status: int
    response: Any
    at: float = field(default_factory=time.time)
    lost: bool = False  # the control plane answered; the worker never saw it


class FleetProxy:
    def __init__(self, upstream: str, port: int) -> None:
        self.upstream = upstream.rstrip("/")
        self.port = port
        self.exchanges: list[Exchange] = []
        self.blocked: set[str] = set()  # path suffixes, e.g. "/heartbeat"; "" blocks all
        self.lose_answers: dict[str, int] = {}  # path suffix -> how many answers to lose
        # path suffix -> which of its answers lose_answers counts (every one when absent)
        self.lose_only: dict[str, Callable[[Any], bool]] = {}
        self._lock = threading.Lock()
        app = Starlette(routes=[Route("/{path:path}", self._forward,
                                      methods=["GET", "POST", "DELETE"])])
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                     log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _is_blocked(self, path: str) -> bool:
        return any(path.endswith(suffix) for suffix in self.blocked)

    async def _forward(self, request: Request) -> Response:
        path = request.url.path
        body = await request.body()
        if self._is_blocked(path):
            while self._is_blocked(path):
                await asyncio.sleep(0.05)
            return Response(status_code=504)
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "content-type")}
        async with httpx.AsyncClient(timeout=60.0) as client:
            resp = await client.request(request.method, self.upstream + path, content=body,
                                        headers=headers, params=request.query_params)
        try:
            answer = resp.json()
        except ValueError:
            answer = None
        lose = next((s for s, n in self.lose_answers.items() if n > 0 and path.endswith(s)
                     and self.lose_only.get(s, lambda _answer: True)(answer)), None)
        if lose is not None:
            self.lose_answers[lose] -= 1
        with contextlib.suppress(ValueError):
            with self._lock:
                self.exchanges.append(Exchange(path, json.loads(body) if body else None,
                                               resp.status_code, answer,
                                               lost=lose is not None))
        if lose is not None:
            return Response(status_code=502)
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type"))

    def find(self, suffix: str) -> list[Exchange]:
        with self._lock:
            return [e for e in self.exchanges if e.path.endswith(suffix)]

    def start(self) -> None:
        self._thread.start()
        deadline = time.time() + 10
        while not self._server.started:
            if time.time() > deadline:
                raise RuntimeError("proxy did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.blocked.clear()
        self._server.should_exit = True
        self._thread.join(timeout=10)


@contextlib.contextmanager
def fleet_proxy(upstream: str, port: int) -> Iterator[FleetProxy]:
    proxy = FleetProxy(upstream, port)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
