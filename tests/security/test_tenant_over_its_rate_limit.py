"""Attack: one tenant floods the factory (more requests, more tokens, more boxes, agents and
bytes than it is allowed) to starve its neighbours.

Two control-plane servers share one store (SQLite, PostgreSQL); the operator limits the
greedy tenant with `minimill tenants set` (a process of its own). Its requests beyond the
limit, sent to either server, are refused with OpenAI's 429 (type requests or tokens, code
rate_limit_exceeded, x-ratelimit-* and retry-after headers) and queue nothing; its answers
within the limit carry the x-ratelimit-* headers too. Quotas answer 429 insufficient_quota.
The neighbour, without limits, is served throughout."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from api_harness import BACKENDS, MODEL, ApiEnv, EchoSite, ServerThread, make_env, stop_env
from security_harness import minimill
from sqlalchemy import func, select

from minimill.control.tables import requests, tenants


@pytest.fixture(scope="module", params=BACKENDS)
def env(request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiEnv]:
    the_env = make_env(request, tmp_path_factory, request.param)
    yield the_env
    stop_env(the_env)


def limit(env: ApiEnv, tenant: str, *options: str) -> None:
    done = minimill("tenants", "set", tenant, *options, "--db", env.db_url)
    assert done.returncode == 0, done.stderr


def chat(base_url: str, key: str, max_tokens: int = 5) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": MODEL, "max_tokens": max_tokens,
                            "messages": [{"role": "user", "content": "hello there"}]})


def queued_of(env: ApiEnv, tenant: str) -> int:
    with env.store.read() as conn:
        tenant_id = conn.execute(select(tenants.c.id).where(tenants.c.name == tenant)).scalar()
        return int(conn.execute(select(func.count()).select_from(requests)
                                .where(requests.c.tenant_id == tenant_id)).scalar() or 0)


def test_requests_over_the_limit_are_refused_on_every_server_and_the_neighbour_is_served(
        env: ApiEnv, second: ServerThread) -> None:
    greedy, neighbour = env.new_key("greedy"), env.new_key("neighbour")
    limit(env, "greedy", "--requests-per-minute", "3")
    with EchoSite(env.base_url, env.site_token):
        remaining = []
        for i in range(3):  # alternating servers: one bucket in the store
            answer = chat((env.base_url, second.base_url)[i % 2], greedy)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-ratelimit-limit-requests"] == "3"
            remaining.append(int(answer.headers["x-ratelimit-remaining-requests"]))
            assert answer.headers["x-ratelimit-reset-requests"].endswith("s")
        assert remaining == [2, 1, 0]
        before = queued_of(env, "greedy")
        for base_url in (env.base_url, second.base_url):
            refused = chat(base_url, greedy)
            assert refused.status_code == 429
            error = refused.json()["error"]
            assert error["type"] == "requests" and error["code"] == "rate_limit_exceeded"
            assert error["param"] is None and "requests per min" in error["message"]
            assert refused.headers["x-ratelimit-remaining-requests"] == "0"
            assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert queued_of(env, "greedy") == before  # a refused request queues nothing
        for i in range(6):  # the neighbour has no limit: served, without headers
            answer = chat((env.base_url, second.base_url)[i % 2], neighbour)
            assert answer.status_code == 200, answer.text
            assert "x-ratelimit-limit-requests" not in answer.headers


def test_a_burst_at_two_servers_at_once_gets_exactly_the_limit(
        env: ApiEnv, second: ServerThread) -> None:
    burst = env.new_key("bursty")
    limit(env, "bursty", "--requests-per-minute", "5")
    answers: list[int] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        code = chat((env.base_url, second.base_url)[i % 2], burst).status_code
        with lock:
            answers.append(code)

    with EchoSite(env.base_url, env.site_token):
        threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    assert sorted(answers) == [200] * 5 + [429] * 7


def test_tokens_over_the_limit_are_refused_and_a_request_larger_than_it_is_never_retried(
        env: ApiEnv) -> None:
    wordy = env.new_key("wordy")
    limit(env, "wordy", "--tokens-per-minute", "200")
    with EchoSite(env.base_url, env.site_token):
        answer = chat(env.base_url, wordy, max_tokens=100)
        assert answer.status_code == 200, answer.text
        used = 200 - int(answer.headers["x-ratelimit-remaining-tokens"])
        assert used > 100  # the prompt as counted plus max_tokens
        again = chat(env.base_url, wordy, max_tokens=100)
        assert again.status_code == 429
        assert again.json()["error"]["type"] == "tokens"
        assert again.json()["error"]["code"] == "rate_limit_exceeded"
        huge = chat(env.base_url, wordy, max_tokens=500)
        assert huge.status_code == 429 and "too large" in huge.json()["error"]["message"]
        assert huge.headers["x-should-retry"] == "false"


def test_concurrent_realtime_requests_past_the_limit_are_refused(env: ApiEnv) -> None:
    busy = env.new_key("busy")
    limit(env, "busy", "--max-concurrent-realtime", "1")
    first: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: first.append(chat(env.base_url, busy)))
    waiter.start()  # no site runs yet: it stays queued
    deadline = time.monotonic() + 30
    while queued_of(env, "busy") < 1:
        assert time.monotonic() < deadline, "the first request was never queued"
        time.sleep(0.02)
    second_call = chat(env.base_url, busy)
    assert second_call.status_code == 429
    assert "concurrent" in second_call.json()["error"]["message"]
    with EchoSite(env.base_url, env.site_token):
        waiter.join(timeout=60)
        assert first and first[0].status_code == 200
        assert chat(env.base_url, busy).status_code == 200  # the first one finished


def test_quotas_on_boxes_agents_and_stored_bytes(env: ApiEnv) -> None:
    hoarder, neighbour = env.new_key("hoarder"), env.new_key("bystander")
    limit(env, "hoarder", "--max-boxes", "0", "--max-agents", "0", "--max-stored-bytes", "100")

    def post(key: str, path: str, **kwargs: object) -> httpx.Response:
        return httpx.post(f"{env.base_url}/v1/{path}", timeout=30,
                          headers={"Authorization": f"Bearer {key}"}, **kwargs)  # type: ignore[arg-type]

    box = post(hoarder, "boxes", json={})
    agent = post(hoarder, "agents", json={"code": "async def main(ctx, task):\n    pass\n"})
    upload = post(hoarder, "files", data={"purpose": "batch"},
                  files={"file": ("big.jsonl", b"x" * 101)})
    for refused in (box, agent, upload):
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "insufficient_quota"
        assert refused.json()["error"]["type"] == "insufficient_quota"
        assert refused.headers["x-should-retry"] == "false"
    small = post(hoarder, "files", data={"purpose": "batch"},
                 files={"file": ("small.jsonl", b"y" * 100)})
    assert small.status_code == 200, small.text
    assert post(hoarder, "files", data={"purpose": "batch"},
                files={"file": ("one.jsonl", b"z")}).status_code == 429  # full now
    assert post(neighbour, "files", data={"purpose": "batch"},
                files={"file": ("big.jsonl", b"x" * 101)}).status_code == 200
    assert post(neighbour, "agents",
                json={"code": "async def main(ctx, task):\n    pass\n"}).status_code == 200


def test_the_operator_route_reads_and_sets_limits(env: ApiEnv) -> None:
    env.new_key("routed")
    auth = {"Authorization": f"Bearer {env.operator_key}"}
    set_ = httpx.post(f"{env.base_url}/v1/tenants/routed/limits", headers=auth,
                      json={"requests_per_minute": 7, "weight": 2})
    assert set_.status_code == 200, set_.text
    assert set_.json()["requests_per_minute"] == 7 and set_.json()["weight"] == 2
    reset = httpx.post(f"{env.base_url}/v1/tenants/routed/limits", headers=auth,
                       json={"reset": ["requests_per_minute"]})
    assert reset.json()["requests_per_minute"] is None
    assert reset.json()["overrides"] == {"weight": 2}
    bad = httpx.post(f"{env.base_url}/v1/tenants/routed/limits", headers=auth,
                     json={"requests_per_minte": 7})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "requests_per_minte"
    # A tenant does not learn the route exists.
    assert httpx.get(f"{env.base_url}/v1/tenants", headers={
        "Authorization": f"Bearer {env.key}"}).status_code == 404


def test_the_command_line_shows_limits_and_refuses_nonsense(env: ApiEnv) -> None:
    env.new_key("shown")
    limit(env, "shown", "--tokens-per-minute", "900", "--weight", "2.5")
    shown = minimill("tenants", "show", "shown", "--json", "--db", env.db_url)
    assert shown.returncode == 0, shown.stderr
    (view,) = json.loads(shown.stdout)
    assert view["tokens_per_minute"] == 900 and view["weight"] == 2.5
    assert view["requests_per_minute"] is None  # the operator's default: unlimited
    listed = minimill("tenants", "list", "--json", "--db", env.db_url)
    assert "shown" in {v["tenant"] for v in json.loads(listed.stdout)}
    bad = minimill("tenants", "set", "shown", "--max-boxes", "lots", "--db", env.db_url)
    assert bad.returncode != 0 and "lots" in bad.stderr
    missing = minimill("tenants", "set", "nobody", "--max-boxes", "3", "--db", env.db_url)
    assert missing.returncode != 0 and "No such tenant" in missing.stderr
