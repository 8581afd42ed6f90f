"""The lean path of the token sites' calls (api/lean_fleet.py) answers byte for byte as the
FastAPI routes do: one store, two servers (the lean path on and off), the same call to each,
for success and for every kind of refusal; and a well-formed call never reaches FastAPI."""

from __future__ import annotations

import asyncio
import io
import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from api_harness import MODEL, ApiEnv, ServerThread, start_env, stop_env, wait_for
from openai import OpenAI
from starlette.types import Receive, Scope, Send

from minimill.api.app import create_app
from minimill.api.lean_fleet import API_ROUTES, LEAN_ROUTES, LeanFleetPath
from minimill.api.settings import Settings
from minimill.control.records import SiteScope
from minimill.control.sites import create_site

# Small enough that an oversize body is cheap to send, large enough for the calls below.
SETTINGS: dict[str, Any] = {"max_fleet_body_bytes": 4096, "lease_ttl_s": 30.0}
PATHS = ("/lease", "/heartbeat", "/complete", "/release")
# A well-formed body of each route that changes nothing another call here depends on.
NEUTRAL = {"/lease": {"capacity": 0, "models": [MODEL]}, "/heartbeat": {"leases": []},
           "/complete": {"results": []}, "/release": {"leases": []}}


class Pair:
    """The lean server (the env's) and a server of the FastAPI routes alone, on one store."""

    def __init__(self, env: ApiEnv, plain: ServerThread) -> None:
        self.env, self.plain = env, plain

    def both(self, path: str, token: str | None, *, chunks: list[bytes] | None = None,
             **kwargs: Any) -> tuple[httpx.Response, ...]:
        """The same call to each; `chunks`: a body sent in them, without a Content-Length."""
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        headers.update(kwargs.pop("headers", {}))
        answers = []
        for base in (self.env.base_url, self.plain.base_url):
            if chunks is not None:  # an iterator is spent by one call: a fresh one for each
                kwargs["content"] = iter(chunks)
            answers.append(httpx.post(base + "/v1/fleet" + path, headers=headers, timeout=30,
                                      **kwargs))
        return tuple(answers)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'minimill.db'}"
    env = start_env("sqlite", url, **SETTINGS)
    plain = ServerThread(Settings(db=url, lean_fleet_path=False, janitor_interval_s=0.1,
                                  **SETTINGS))
    yield Pair(env, plain)
    plain.stop()
    stop_env(env)


def comparable(answer: httpx.Response) -> tuple[int, list[tuple[str, str]], bytes]:
    """Status, headers and body; the headers a server writes anew for every call left out."""
    headers = [(k, v) for k, v in answer.headers.multi_items()
               if k not in ("date", "x-request-id")]
    return answer.status_code, headers, answer.content


def assert_same(lean: httpx.Response, plain: httpx.Response, *,
                expect: int | None = None) -> None:
    assert comparable(lean) == comparable(plain), (lean.content, plain.content)
    if expect is not None:
        assert lean.status_code == expect, lean.content


def answered(base_url: str, operator_key: str, path: str) -> float:
    """How many 200s /metrics counted for the route (the lean path's calls too)."""
    text = httpx.get(base_url + "/metrics",
                     headers={"Authorization": f"Bearer {operator_key}"}).text
    line = (f'minimill_http_requests_total{{method="POST",route="/v1/fleet{path}",'
            f'status="200"}} ')
    return sum(float(row[len(line):]) for row in text.splitlines() if row.startswith(line))


def test_success_of_each_call_is_the_same(pair: Pair) -> None:
    counted = {p: answered(pair.env.base_url, pair.env.operator_key, p) for p in PATHS}
    for path in PATHS:
        lean, plain = pair.both(path, pair.env.site_token, json=NEUTRAL[path])
        assert_same(lean, plain, expect=200)
        assert answered(pair.env.base_url, pair.env.operator_key, path) == counted[path] + 1
    lean, _ = pair.both("/lease", pair.env.site_token, json=NEUTRAL["/lease"])
    assert lean.json() == {"leases": [], "lease_ttl_s": 30.0}


def test_refused_tokens_are_answered_alike(pair: Pair) -> None:
    name = f"site-{uuid.uuid4().hex[:6]}"
    old = create_site(pair.env.store, name, 0.5, "cpu")
    new = create_site(pair.env.store, name, 0.5, "cpu", replace=True)  # old stops at once
    boxes = create_site(pair.env.store, f"box-{uuid.uuid4().hex[:6]}", 0.5, "cpu",
                        serves=frozenset({SiteScope.BOXES}))
    for path in PATHS:
        for token, status in ((old, 401), ("mms-" + "0" * 40, 401), (pair.env.key, 401),
                              (None, 401), (boxes, 403)):
            lean, plain = pair.both(path, token, json=NEUTRAL[path])
            assert_same(lean, plain, expect=status)
        lean, plain = pair.both(path, new, json=NEUTRAL[path])
        assert_same(lean, plain, expect=200)
    lean, _ = pair.both("/heartbeat", old, json=NEUTRAL["/heartbeat"])
    assert lean.json()["error"]["code"] == "invalid_site_token"
    assert lean.headers["www-authenticate"] == "Bearer"


MALFORMED: tuple[tuple[bytes, str], ...] = (
    (b"{", "application/json"), (b"", "application/json"), (b"[]", "application/json"),
    (b'{"leases": 5, "results": 5, "capacity": "x"}', "application/json"),
    (b'{"leases": {}}', "application/json"),
    (b'{"capacity": -1, "models": [], "leases": 7}', "application/json"),
    (b'{"leases": [], "results": []}', "text/plain"),
)


def test_malformed_bodies_are_answered_alike(pair: Pair) -> None:
    """Also with a replaced token, refused before a word about a body that is JSON."""
    name = f"site-{uuid.uuid4().hex[:6]}"
    old = create_site(pair.env.store, name, 0.5, "cpu")
    create_site(pair.env.store, name, 0.5, "cpu", replace=True)
    statuses = set()
    for path in PATHS:
        for body, content_type in MALFORMED:
            for token in (pair.env.site_token, old):
                lean, plain = pair.both(path, token, content=body,
                                        headers={"Content-Type": content_type})
                assert_same(lean, plain)
                statuses.add((token == old, lean.status_code))
    # Bodies that are not JSON at all are refused before FastAPI solves the credential: a
    # replaced token sees that 400 on both paths alike.
    assert statuses == {(False, 400), (True, 400), (True, 401)}


def test_oversize_bodies_are_answered_alike(pair: Pair) -> None:
    big = json.dumps({"leases": [], "pad": "x" * 5000}).encode()
    for path in PATHS:
        lean, plain = pair.both(path, pair.env.site_token, content=big,
                                headers={"Content-Type": "application/json"})
        assert_same(lean, plain, expect=413)
        # Without a Content-Length: counted as it comes.
        lean, plain = pair.both(path, pair.env.site_token, chunks=[big[:2000], big[2000:]],
                                headers={"Content-Type": "application/json"})
        assert_same(lean, plain, expect=413)
        assert "content-length" not in lean.request.headers


def two_requests(env: ApiEnv) -> None:
    lines = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST",
                                "url": "/v1/chat/completions",
                                "body": {"model": MODEL, "messages": [{"role": "user",
                                                                       "content": f"hi {i}"}]}})
                    + "\n" for i in range(2))
    with OpenAI(base_url=env.v1, api_key=env.key, max_retries=0) as client:
        file_id = client.files.create(file=("in.jsonl", io.BytesIO(lines.encode())),
                                      purpose="batch").id
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                              completion_window="24h")


def result(lease: dict[str, Any], epoch: int) -> dict[str, Any]:
    return {"results": [{"request_id": lease["request_id"], "epoch": epoch,
                         "outcome": "succeeded",
                         "choices": [{"index": 0, "text": "ok", "token_ids": [1, 2],
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 2}}]}


def test_unknown_and_fenced_off_leases_and_completions_are_answered_alike(pair: Pair) -> None:
    name = f"site-{uuid.uuid4().hex[:6]}"
    token = create_site(pair.env.store, name, 0.5, "cpu")
    two_requests(pair.env)

    def granted() -> list[dict[str, Any]]:
        answer = httpx.post(pair.env.base_url + "/v1/fleet/lease", timeout=30,
                            headers={"Authorization": f"Bearer {token}"},
                            json={"capacity": 2, "models": [MODEL]}).json()
        return list(answer["leases"])

    leases = wait_for(granted, timeout_s=20)
    if len(leases) < 2:
        leases += wait_for(granted, timeout_s=20)
    first, second = leases[:2]
    unknown = {"request_id": "req_unknown", "epoch": 1}
    for path, body in (("/heartbeat", {"leases": [unknown]}),
                       ("/complete", result(unknown, 1)),
                       ("/release", {"leases": [unknown]}),
                       ("/heartbeat", {"leases": [{"request_id": first["request_id"],
                                                   "epoch": first["epoch"] + 1}]}),
                       ("/complete", result(first, first["epoch"] + 1)),
                       ("/release", {"leases": [{"request_id": first["request_id"],
                                                 "epoch": first["epoch"] + 1}]})):
        lean, plain = pair.both(path, token, json=body)
        assert_same(lean, plain, expect=200)
    lean, _ = pair.both("/complete", token, json=result(first, first["epoch"] + 1))
    assert lean.json()["rejected"][0]["reason"] == "stale_epoch"
    lean, _ = pair.both("/heartbeat", token, json={"leases": [unknown]})
    assert lean.json()["revoked"] == ["req_unknown"]
    # Accepted completions, one through each server: the same answer but for the request id.
    answers = []
    for base, lease in ((pair.env.base_url, first), (pair.plain.base_url, second)):
        answer = httpx.post(base + "/v1/fleet/complete", json=result(lease, lease["epoch"]),
                            headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert answer.json() == {"accepted": [lease["request_id"]], "rejected": []}
        answers.append(re.sub(lease["request_id"].encode(), b"ID",
                              comparable(answer)[2]))
    assert answers[0] == answers[1]


def test_well_formed_calls_never_reach_fastapi(tmp_path: Any) -> None:
    """What the lean path hands on is what it cannot answer itself, and nothing more."""
    app = create_app(Settings(db=f"sqlite:///{tmp_path / 'm.db'}", run_janitor=False,
                              run_webhooks=False))
    token = create_site(app.state.store, "site-a", 0.5, "cpu")
    reached: list[str] = []

    async def fastapi_stand_in(scope: Scope, receive: Receive, send: Send) -> None:
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 418, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    lean = LeanFleetPath(fastapi_stand_in)

    async def with_app(scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = app
        await lean(scope, receive, send)

    async def calls() -> list[int]:
        transport = httpx.ASGITransport(app=with_app)
        statuses = []
        async with httpx.AsyncClient(transport=transport, base_url="http://x/v1/fleet",
                                     headers={"Authorization": f"Bearer {token}"}) as client:
            for path in PATHS:
                statuses.append((await client.post(path, json=NEUTRAL[path])).status_code)
            for path in PATHS:
                statuses.append((await client.post(path, content=b"{")).status_code)
        return statuses

    try:
        statuses = asyncio.run(calls())
    finally:
        app.state.store.close()
    assert statuses == [200] * 4 + [418] * 4
    assert reached == ["/v1/fleet" + p for p in PATHS]
    assert set(API_ROUTES) == set(LEAN_ROUTES) == {"/v1/fleet" + p for p in PATHS}
