"""A lease call waits a bounded time for its turn (token_calls.LEASE_QUEUE_S).

At a thousand sites lease calls waited up to the workers' 30 s timeout for one of the
process's lease threads; the calls timed out and what their transactions had just granted
expired unread. Here every lease thread of a real server is held (from its own event loop), a
lease call with work queued for it is refused with a 503 once its wait is up, without touching
the store (the worker asks again as it asked), and a call that gets its turn within the bound
is granted the work.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import anyio
import httpx
import pytest
from api_harness import MODEL, ApiEnv, wait_for
from openai import OpenAI
from sqlalchemy import func, select
from test_api_fleet import fleet, new_site, one_line_batch

from minimill.api import token_calls
from minimill.api.deps import LEASE_THREADS
from minimill.control.tables import requests, sites
from minimill.transport.client import ControlPlaneClient, ControlPlaneUnavailable
from minimill.transport.protocol import LEASE_QUEUE_S, LeaseRequest

# Long, since nothing waits it out but the one test that shortens the bound.
SERVER_SETTINGS = {"lease_ttl_s": 30.0, "janitor_interval_s": 0.1}


class HeldThreads:
    """Every lease thread of the server's process, held by borrowers of the test."""

    def __init__(self, env: ApiEnv) -> None:
        self.loop = env.server.server.servers[0].get_loop()
        self.limiter: anyio.CapacityLimiter = env.server.app.state.lease_threads
        self.borrowers = [object() for _ in range(LEASE_THREADS)]
        self._run(self._acquire())

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def waiting(self) -> int:
        """Calls in line for a thread."""
        async def count() -> int:
            return self.limiter.statistics().tasks_waiting

        return int(self._run(count()))

    async def _acquire(self) -> None:
        for borrower in self.borrowers:
            await self.limiter.acquire_on_behalf_of(borrower)

    async def _release(self) -> None:
        for borrower in self.borrowers:
            self.limiter.release_on_behalf_of(borrower)

    def release(self) -> None:
        self._run(self._release())


@contextmanager
def queued_work(env: ApiEnv, client: OpenAI) -> Iterator[httpx.Client]:
    """A site whose first lease call made the process's lease threads, and one batch line
    queued for it."""
    _, token = new_site(env)
    with fleet(env, token) as site:
        assert site.post("/lease", json={"capacity": 0, "models": [MODEL]}).status_code == 200
        one_line_batch(client, "the queued line")
        wait_for(lambda: queued(env) == 1)
        yield site


def queued(env: ApiEnv) -> int:
    with env.store.read() as conn:
        return int(conn.execute(select(func.count()).select_from(requests)
                                .where(requests.c.status == "queued")).scalar() or 0)


def last_seen(env: ApiEnv) -> list[float | None]:
    with env.store.read() as conn:
        return list(conn.execute(select(sites.c.last_seen_at).order_by(sites.c.id)).scalars())


def test_a_call_that_gets_no_turn_in_time_is_refused_to_be_asked_again(
        env: ApiEnv, client: OpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token_calls, "LEASE_QUEUE_S", 0.5)
    with queued_work(env, client) as site:
        seen = last_seen(env)
        held = HeldThreads(env)
        try:
            answer = site.post("/lease", json={"capacity": 1, "models": [MODEL]})
            # Refused, not answered with no work: it was never looked at.
            assert answer.status_code == 503
            assert answer.headers["retry-after"] == "1"
            assert answer.json()["error"]["code"] == "overloaded"
            # The worker's client takes it for a passing failure: it asks again as it asked
            # (its adoption of held leases, its ask's name), after its backoff.
            worker = ControlPlaneClient(env.base_url, site.headers["Authorization"][7:])
            with pytest.raises(ControlPlaneUnavailable, match="HTTP 503"):
                asyncio.run(_lease_once(worker))
            # It waited in line only: no transaction, the site row as it was, the work queued.
            assert last_seen(env) == seen
            assert queued(env) == 1
        finally:
            held.release()
        leases = site.post("/lease", json={"capacity": 1, "models": [MODEL]}).json()["leases"]
        assert [lease["body"]["messages"][0]["content"] for lease in leases] == [
            "the queued line"]


async def _lease_once(worker: ControlPlaneClient) -> None:
    try:
        await worker.lease(LeaseRequest(capacity=1, models=[MODEL]))
    finally:
        await worker.close()


def test_a_call_that_gets_its_turn_within_the_bound_is_granted(env: ApiEnv,
                                                               client: OpenAI) -> None:
    with queued_work(env, client) as site:
        held = HeldThreads(env)
        answered: Future[httpx.Response] = Future()

        def ask() -> None:
            answered.set_result(site.post("/lease", json={"capacity": 1, "models": [MODEL]}))

        asker = threading.Thread(target=ask)
        asker.start()
        wait_for(lambda: held.waiting() == 1)
        held.release()
        asker.join(timeout=LEASE_QUEUE_S + 30)
        leases = answered.result(timeout=0)
        assert leases.status_code == 200
        assert len(leases.json()["leases"]) == 1
        assert queued(env) == 0
