"""Bad input never yields a 500: every error is a 4xx OpenAI error object."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from api_harness import MODEL, ApiEnv
from openai import OpenAI

SERVER_SETTINGS = {"max_file_bytes": 2000, "max_body_bytes": 4096,
                   "max_fleet_body_bytes": 8192}
CHAT = "/v1/chat/completions"


@pytest.fixture
def http(env: ApiEnv) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=env.base_url, timeout=30,
                      headers={"Authorization": f"Bearer {env.key}"}) as c:
        yield c


def assert_error(resp: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert "Traceback" not in resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def test_missing_and_invalid_keys(env: ApiEnv) -> None:
    for headers in ({}, {"Authorization": "Bearer mm-wrong"}, {"Authorization": "Basic abc"},
                    {"Authorization": "Bearer"}):
        for method, path in (("GET", "/v1/models"), ("GET", "/v1/files"),
                             ("POST", CHAT), ("GET", "/v1/batches/batch_x")):
            resp = httpx.request(method, env.base_url + path, headers=headers, json={})
            error = assert_error(resp, 401)
            assert error["code"] in ("missing_api_key", "invalid_api_key")
    with OpenAI(base_url=env.v1, api_key="mm-not-a-key", max_retries=0) as bad, \
            pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_malformed_and_mistyped_bodies(http: httpx.Client) -> None:
    headers = {"Content-Type": "application/json"}
    assert_error(http.post(CHAT, content=b'{"model": ', headers=headers), 400)
    assert_error(http.post(CHAT, content=b"[1, 2]", headers=headers), 400)
    assert_error(http.post(CHAT, content=b"hello", headers={"Content-Type": "text/plain"}),
                 400)
    assert_error(http.post(CHAT, content=b"", headers=headers), 400)
    msg = [{"role": "user", "content": "x"}]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"model": MODEL}, "messages"),
        ({"messages": msg}, "model"),
        ({"model": MODEL, "messages": "hi"}, "messages"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"model": MODEL, "messages": msg, "n": "2"}, "n"),
        ({"model": MODEL, "messages": msg, "max_tokens": True}, "max_tokens"),
        ({"model": MODEL, "messages": msg, "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "messages": msg, "top_p": 0}, "top_p"),
        ({"model": MODEL, "messages": msg, "seed": 2**70}, "seed"),
        ({"model": MODEL, "messages": msg, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": MODEL, "messages": msg, "service_tier": "priority"}, "service_tier"),
        ({"model": MODEL, "messages": msg, "top_logprobs": 3}, "top_logprobs"),
        ({"model": MODEL, "messages": msg, "stream_options": {"include_usage": True}},
         "stream_options"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content"),
    ]
    for body, param in cases:
        assert_error(http.post(CHAT, json=body), 400, param=param)
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": []}), 400,
                 param="prompt")
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                    "echo": True}), 400, param="echo")
    assert_error(http.post(CHAT, json={"model": "nope", "messages": msg}), 404,
                 code="model_not_found")
    assert_error(http.post("/v1/batches", json={"input_file_id": 5, "endpoint": CHAT}), 400,
                 param="input_file_id")
    assert_error(http.get("/v1/batches", params={"limit": "many"}), 400, param="limit")
    assert_error(http.get("/v1/batches", params={"limit": 0}), 400, param="limit")
    assert_error(http.post("/v1/files", data={"purpose": "batch"}), 400, param="file")


def test_unknown_ids_routes_and_methods(http: httpx.Client) -> None:
    for method, path in (("GET", "/v1/files/file-nope"), ("GET", "/v1/files/file-nope/content"),
                         ("DELETE", "/v1/files/file-nope"), ("GET", "/v1/batches/batch_nope"),
                         ("POST", "/v1/batches/batch_nope/cancel"),
                         ("GET", "/v1/batches?after=batch_nope"),
                         ("GET", "/v1/files?after=file-nope"), ("GET", "/v1/models/nope")):
        assert_error(http.request(method, path), 404)
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.delete("/v1/models"), 405)
    assert_error(http.put(CHAT, json={}), 405)


def test_oversized_uploads_are_413(env: ApiEnv, client: OpenAI, http: httpx.Client) -> None:
    ok = client.files.create(file=("ok.jsonl", io.BytesIO(b"x" * 2000)), purpose="batch")
    assert ok.bytes == 2000
    with pytest.raises(openai.APIStatusError) as big:
        client.files.create(file=("big.jsonl", io.BytesIO(b"x" * 2001)), purpose="batch")
    assert big.value.status_code == 413
    with pytest.raises(openai.APIStatusError) as huge:
        client.files.create(file=("huge.jsonl", io.BytesIO(b"x" * 300_000)), purpose="batch")
    assert huge.value.status_code == 413

    boundary = "mmboundary"

    def chunked() -> Iterator[bytes]:
        yield (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
               f"batch\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
               f"filename=\"a.jsonl\"\r\nContent-Type: application/octet-stream\r\n\r\n").encode()
        for _ in range(100):
            yield b"y" * 4096
        yield f"\r\n--{boundary}--\r\n".encode()

    resp = http.post("/v1/files", content=chunked(),
                     headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert_error(resp, 413, code="file_too_large")
    assert [f.id for f in client.files.list()] == [ok.id]


def test_every_route_has_a_body_limit(env: ApiEnv, client: OpenAI, http: httpx.Client) -> None:
    big = "word " * 1000  # a 5,000-byte message: over the 4,096-byte limit of JSON routes
    with pytest.raises(openai.APIStatusError) as chat:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": big}])
    assert chat.value.status_code == 413 and chat.value.code == "request_too_large"
    with pytest.raises(openai.APIStatusError) as batch:
        client.batches.create(input_file_id="file-x", endpoint=CHAT, completion_window="24h",
                              metadata={"k": big})
    assert batch.value.status_code == 413
    # Without a Content-Length the body is counted as it arrives.
    streamed = http.post(CHAT, content=iter([b'{"model": "' + b"m" * 3000, b"m" * 3000 + b'"}']),
                         headers={"Content-Type": "application/json"})
    assert_error(streamed, 413, code="request_too_large")
    assert_error(http.post("/v1/completions", content=b"{" + b" " * 5000 + b"}",
                           headers={"Content-Type": "application/json"}), 413)
    # The worker protocol's routes have their own (larger) limit, with the same answer.
    fleet = {"Authorization": f"Bearer {env.site_token}"}
    under = http.post("/v1/fleet/heartbeat", headers=fleet, json={"leases": [
        {"request_id": "req_x", "epoch": 1, "delta": {"choices": [{"text": "y" * 6000}]}}]})
    assert under.status_code == 200 and under.json()["revoked"] == ["req_x"]
    over = http.post("/v1/fleet/heartbeat", headers=fleet, json={"leases": [
        {"request_id": "req_x", "epoch": 1, "delta": {"choices": [{"text": "y" * 9000}]}}]})
    assert_error(over, 413, code="request_too_large")
    # Within the limits everything still works.
    assert http.get("/v1/models").status_code == 200
