"""A real worker process against a real control plane, through a recording proxy: results are
not thrown away when an answer is lost or a lease lapses that nobody took over, and checkpoints
carry only what is new, at the interval the control plane sets.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fleet_checks import wait_until
from proxy import FleetProxy, fleet_proxy
from serve_process import MODEL, Serve, Worker, free_port
from sqlalchemy import select

from minimill.control.store import open_store
from minimill.control.tables import requests

pytestmark = pytest.mark.slow
STREAM_INTERVAL_S = 0.6


@pytest.fixture(scope="module")
def serve(fleet_home: Path) -> Iterator[Serve]:
    control = Serve(fleet_home, local_worker=False, extra_env={
        "MINIMILL_STREAM_CHECKPOINT_INTERVAL_S": str(STREAM_INTERVAL_S)})
    try:
        yield control.start_and_wait()
    finally:
        control.stop()


@pytest.fixture
def linked(serve: Serve, fleet_home: Path,
           request: pytest.FixtureRequest) -> Iterator[tuple[Worker, FleetProxy]]:
    """A fresh site whose worker reaches the control plane through a proxy."""
    name = request.node.name.split("[")[0][-30:].replace("_", "-")
    token = serve.cli("sites", "create", name).stdout.strip().splitlines()[-1]
    with fleet_proxy(f"http://127.0.0.1:{serve.port}", free_port()) as proxy:
        worker = Worker(fleet_home, proxy.url, name, token)
        try:
            yield worker.start_and_wait(), proxy
        finally:
            worker.stop()


def site_stats(serve: Serve, name: str) -> dict[str, Any]:
    listed: dict[str, Any] = {s["name"]: s for s in json.loads(
        serve.cli("sites", "list", "--json").stdout)}[name]
    return listed


def ask(serve: Serve, content: str, **extra: Any) -> concurrent.futures.Future[Any]:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(serve.client(timeout=300).chat.completions.create, model=MODEL,
                         messages=[{"role": "user", "content": content}], temperature=0,
                         **extra)
    pool.shutdown(wait=False)
    return future


def row(serve: Serve) -> Any:
    """The newest realtime request's row, as the control plane stores it."""
    store = open_store(serve.db_url())
    try:
        with store.read() as conn:
            return conn.execute(select(requests).where(requests.c.batch_id.is_(None))
                                .order_by(requests.c.seq.desc()).limit(1)).first()
    finally:
        store.close()


def test_a_result_resent_after_a_lost_answer_is_accepted(
        serve: Serve, linked: tuple[Worker, FleetProxy]) -> None:
    worker, proxy = linked
    proxy.lose_answers["/complete"] = 1
    answer = ask(serve, "Say hi.", max_tokens=6).result(timeout=300)
    assert answer.choices[0].message.content
    # The client may have its answer before the proxy has logged the lost call and its resend.
    sent = wait_until(lambda: (calls := list(proxy.find("/complete"))) and len(calls) >= 2
                      and calls, 30, "the lost complete and its resend")
    assert sent[0].lost and sent[0].response["accepted"] == [answer.id.replace("chatcmpl-",
                                                                                "req_")]
    assert sent[-1].response == sent[0].response  # the resend: accepted again, not refused
    stats = site_stats(serve, worker.site)
    assert (stats["completions"], stats["stale_completions"], stats["wasted_tokens"]) == \
        (1, 0, 0)


def test_a_lease_whose_answer_was_lost_is_delivered_by_the_call_made_again(
        serve: Serve, linked: tuple[Worker, FleetProxy]) -> None:
    """The control plane grants a lease and the worker never reads the answer (as when its
    call times out at a loaded control plane): its next call names the same ask and gets the
    lease back at its epoch, instead of the request waiting out the lease's TTL."""
    worker, proxy = linked
    proxy.lose_only["/lease"] = lambda answer: bool(answer and answer.get("leases"))
    proxy.lose_answers["/lease"] = 1
    answer = ask(serve, "Say hi.", max_tokens=6).result(timeout=300)
    request_id = answer.id.replace("chatcmpl-", "req_")
    calls = proxy.find("/lease")
    (lost,) = [e for e in calls if e.lost]
    assert [g["request_id"] for g in lost.response["leases"]] == [request_id]
    again = next(e for e in calls if e.at > lost.at and e.response and e.response["leases"])
    assert again.request["ask_id"] == lost.request["ask_id"]
    assert [(g["request_id"], g["epoch"]) for g in again.response["leases"]] == \
        [(request_id, lost.response["leases"][0]["epoch"])]
    done = row(serve)
    assert done.id == request_id and done.status == "succeeded" and done.epoch == 1
    stats = site_stats(serve, worker.site)
    assert (stats["completions"], stats["leases_expired"], stats["leases_granted"]) == (1, 0, 1)


def test_a_finished_result_outlives_its_expired_lease(
        serve: Serve, linked: tuple[Worker, FleetProxy]) -> None:
    """The lease lapses (heartbeats cut) after the result is done but before it is delivered;
    nobody else takes the request, so its epoch is still current: the result is delivered
    instead of being dropped and generated again."""
    worker, proxy = linked
    proxy.blocked.add("/complete")
    answer = ask(serve, "Count to three.", max_tokens=8)
    wait_until(lambda: (r := row(serve)) is not None and r.progress is not None and all(
        c["finish_reason"] for c in r.progress["choices"]), 120, "the finished checkpoint")
    proxy.blocked.update({"/heartbeat", "/lease"})
    wait_until(lambda: row(serve).status == "queued", 30, "the lease to expire")
    proxy.blocked.discard("/heartbeat")
    request_id = row(serve).id
    wait_until(lambda: any(request_id in e.response.get("revoked", [])
                           for e in proxy.find("/heartbeat")), 60, "the revocation")
    proxy.blocked.discard("/complete")
    text = answer.result(timeout=120).choices[0].message.content
    proxy.blocked.clear()
    done = row(serve)
    assert text and done.status == "succeeded" and done.epoch == 1  # never leased again
    assert any(request_id in e.response.get("accepted", []) for e in proxy.find("/complete"))
    stats = site_stats(serve, worker.site)
    assert (stats["completions"], stats["stale_completions"], stats["wasted_tokens"]) == \
        (1, 0, 0)


def test_stream_checkpoints_are_deltas_at_the_servers_interval(
        serve: Serve, linked: tuple[Worker, FleetProxy]) -> None:
    _, proxy = linked
    # The end tokens are forbidden and the limit far: the stream runs until this test has
    # seen the checkpoints it checks, however fast the engine (then it closes the stream).
    stream = serve.client(timeout=300).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a story about a boat."}],
        max_tokens=4000, temperature=0, stream=True, logit_bias={"0": -100, "2": -100})

    def deltas(request_id: str) -> list[tuple[float, Any]]:
        return [(e.at, item) for e in proxy.find("/heartbeat") for item in e.request["leases"]
                if item["request_id"] == request_id and (item.get("delta") or
                                                         item.get("checkpoint"))]

    text, request_id = "", ""
    with stream:
        for chunk in stream:
            request_id = "req_" + chunk.id.removeprefix("chatcmpl-")
            text += "".join(c.delta.content or "" for c in chunk.choices)
            if len(deltas(request_id)) >= 3:
                break
    items = deltas(request_id)
    assert len(items) >= 3
    assert all(item.get("checkpoint") is None for _, item in items)  # never the whole text
    sent = "".join(c["text"] for _, item in items for c in item["delta"]["choices"])
    assert len(sent) > 0
    # Each character sent once, in order: what the client read and what was checkpointed
    # are both the start of one text.
    assert text.startswith(sent) or sent.startswith(text)
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(items)]
    assert min(gaps) >= STREAM_INTERVAL_S * 0.8, gaps


