"""A lease call with `wait_s` is held open while there is no work and answered when work comes,
over real HTTP against a real control plane (SQLite and PostgreSQL)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))

from api_harness import BACKENDS, MODEL, ApiEnv, make_env, stop_env  # beside the API tests


@pytest.fixture(params=BACKENDS)
def env(request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiEnv]:
    # A TTL of 30 s lets a call be held up to 10 s.
    the_env = make_env(request, tmp_path_factory, request.param, lease_ttl_s=30.0)
    yield the_env
    stop_env(the_env)


def fleet(env: ApiEnv, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{env.v1}/fleet/{path}", timeout=60, json=body,
                      headers={"Authorization": f"Bearer {env.site_token}"})
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


def lease(env: ApiEnv, wait_s: float, **ask: Any) -> tuple[dict[str, Any], float]:
    start = time.monotonic()
    answer = fleet(env, "lease", {"capacity": 4, "models": [MODEL], "wait_s": wait_s, **ask})
    return answer, time.monotonic() - start


def test_a_held_lease_call_waits_for_work_and_takes_it(env: ApiEnv) -> None:
    # Nothing queued: held until its wait is up, then answered with nothing.
    empty, seconds = lease(env, 1.5)
    assert empty["leases"] == [] and seconds >= 1.4
    # Without a wait it answers at once, as before.
    empty, seconds = lease(env, 0.0)
    assert empty["leases"] == [] and seconds < 1.4

    # Held for up to 10 s; a realtime request comes 0.5 s in and the held call takes it.
    answer: list[tuple[dict[str, Any], float]] = []
    held = threading.Thread(target=lambda: answer.append(lease(env, 10.0)))
    held.start()
    time.sleep(0.5)
    client = OpenAI(base_url=env.v1, api_key=env.key, max_retries=0, timeout=30)
    asked = threading.Thread(target=lambda: _ask(client), daemon=True)
    asked.start()
    held.join(timeout=30)
    assert answer, "the held lease call did not come back"
    granted, seconds = answer[0]
    assert len(granted["leases"]) == 1, granted
    assert granted["leases"][0]["body"]["messages"][0]["content"] == "wake the worker"
    assert seconds < 10.0  # answered when the work came, not at the end of its wait


def _ask(client: OpenAI, content: str = "wake the worker") -> None:
    try:  # nobody completes it: only its lease matters here
        client.chat.completions.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": content}])
    except Exception:
        pass


def test_a_held_call_offers_the_slots_its_finished_requests_freed(env: ApiEnv) -> None:
    """A worker with 2 slots, both busy, waits in its lease call; one request ends (its result
    comes in another call) and the held call takes one queued request, not two."""
    client = OpenAI(base_url=env.v1, api_key=env.key, max_retries=0, timeout=30)
    for n in range(4):
        threading.Thread(target=_ask, args=(client, f"request {n}"), daemon=True).start()
    busy: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30
    while len(busy) < 2:
        assert time.monotonic() < deadline, busy
        busy += lease(env, 0.0, capacity=2 - len(busy))[0]["leases"]
    answer: list[tuple[dict[str, Any], float]] = []
    held = threading.Thread(target=lambda: answer.append(
        lease(env, 10.0, capacity=0, slots=2)))
    held.start()
    time.sleep(1.5)  # it has looked at least once with no slot free
    assert not answer
    done = busy[0]
    accepted = fleet(env, "complete", {"results": [{
        "request_id": done["request_id"], "epoch": done["epoch"], "outcome": "failed",
        "error": {"code": "server_error", "message": "ended by the test"}}]})
    assert accepted["accepted"] == [done["request_id"]]
    held.join(timeout=30)
    assert answer, "the held lease call did not come back"
    assert len(answer[0][0]["leases"]) == 1, answer[0][0]


def test_a_lease_wait_out_of_range_is_refused(env: ApiEnv) -> None:
    resp = httpx.post(f"{env.v1}/fleet/lease", timeout=30,
                      headers={"Authorization": f"Bearer {env.site_token}"},
                      json={"capacity": 4, "models": [MODEL], "wait_s": 3600})
    assert resp.status_code == 400, resp.text
    assert "wait_s" in str(resp.json()["error"]), resp.text
