"""Control planes share nothing but the store: one restarted mid-batch loses nothing, and two
at once serve one client (the waiter's progress arrives through the other one's fleet routes)."""

from __future__ import annotations

import io
import json

import httpx
import pytest
from api_harness import (
    BACKENDS,
    MODEL,
    EchoSite,
    iter_lines,
    make_env,
    start_env,
    stop_env,
    wait_for,
)
from openai import OpenAI


@pytest.mark.parametrize("backend", BACKENDS)
def test_restart_mid_batch_loses_nothing(backend: str, request: pytest.FixtureRequest,
                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    first = make_env(request, tmp_path_factory, backend, lease_ttl_s=1.0)
    text = "\n".join(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                 "url": "/v1/chat/completions",
                                 "body": {"model": MODEL, "messages": [
                                     {"role": "user", "content": f"number {i}"}]}})
                     for i in range(60))
    with OpenAI(base_url=first.v1, api_key=first.key, max_retries=0) as client:
        file_id = client.files.create(file=("in.jsonl", io.BytesIO(text.encode())),
                                      purpose="batch").id
        batch_id = client.batches.create(input_file_id=file_id, completion_window="24h",
                                         endpoint="/v1/chat/completions").id
    with EchoSite(first.base_url, first.site_token, max_leases=25) as echo:
        wait_for(lambda: len(echo.completed) == 25)
    # Five more are leased and in flight when the control plane goes away.
    with httpx.Client(base_url=first.base_url + "/v1/fleet",
                      headers={"Authorization": f"Bearer {first.site_token}"}) as fleet:
        assert len(fleet.post("/lease", json={"capacity": 5, "models": [MODEL]})
                   .json()["leases"]) == 5
    stop_env(first)

    second = start_env(backend, first.db_url, lease_ttl_s=1.0)
    try:
        with EchoSite(second.base_url, first.site_token) as echo, \
                OpenAI(base_url=second.v1, api_key=first.key, max_retries=0) as client:
            done = wait_for(lambda: (b := client.batches.retrieve(batch_id)).status
                            == "completed" and b)
            assert len(echo.completed) == 35
            assert done.request_counts is not None and done.request_counts.completed == 60
            assert done.error_file_id is None and done.output_file_id
            out = list(iter_lines(client.files.content(done.output_file_id).text))
        assert sorted(o["custom_id"] for o in out) == sorted(f"r{i}" for i in range(60))
        assert all(o["response"]["body"]["choices"][0]["message"]["content"]
                   == f"echo number {o['custom_id'][1:]}" for o in out)
    finally:
        stop_env(second)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_control_planes_on_one_store(backend: str, request: pytest.FixtureRequest,
                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    front = make_env(request, tmp_path_factory, backend)
    back = start_env(backend, front.db_url)
    try:
        with EchoSite(back.base_url, back.site_token, token_delay_s=0.05) as echo, \
                OpenAI(base_url=front.v1, api_key=front.key, max_retries=0) as client:
            answer = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "across planes"}])
            assert answer.choices[0].message.content == "echo across planes"
            chunks = list(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "a b c d e f"}],
                stream=True))
            deltas = [c.choices[0].delta.content for c in chunks
                      if c.choices and c.choices[0].delta.content]
            assert "".join(deltas) == "echo a b c d e f" and len(deltas) >= 3
            # The stream ends when the plane stores the result; the site records it when the
            # plane's answer to its complete call reaches it, a moment later.
            wait_for(lambda: len(echo.completed) >= 2, timeout_s=10)
            assert len(echo.completed) == 2
    finally:
        stop_env(back)
        stop_env(front)
