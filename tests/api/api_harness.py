"""Test harness for the API: a real uvicorn server in a thread, and a protocol-speaking site.

`EchoSite` is a real client of the fleet protocol (lease, heartbeat with checkpoint deltas,
complete over HTTP with a site token). It answers without a model: each choice's text is the
words of "echo <last message>", one word per token, so tests can predict every output. A prompt
containing FAIL_CONTEXT is failed with context_length_exceeded, as an engine would. A chat with
tools whose last message says `text CALL name {json} CALL ...` is answered with "echo text" and
those calls, written as Hermes `<tool_call>` blocks (4 characters a token), as a model with
tools would write them.
"""

from __future__ import annotations

import functools
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import psycopg
import pytest
import uvicorn

from minimill.api.app import Settings, create_app
from minimill.control.keys import create_key, create_operator_key
from minimill.control.records import ALL_SITE_SCOPES
from minimill.control.sites import create_site
from minimill.control.store import Store, open_store

MODEL = "smollm2-135m"
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def fresh_pg_database(pg_server: str) -> str:
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(f"{pg_server}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{pg_server}/{name}"


class ServerThread:
    """`create_app(settings)` served by uvicorn on a free port, in a daemon thread."""

    def __init__(self, settings: Settings) -> None:
        self.app = create_app(settings)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                lifespan="on", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@dataclass
class ApiEnv:
    """A running control plane plus credentials (a tenant's key, an operator key, a site
    token that serves every part of the worker protocol); `store` is the test's own handle on
    its DB."""

    backend: str
    db_url: str
    server: ServerThread
    store: Store
    key: str
    operator_key: str
    site_token: str

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def v1(self) -> str:
        return self.server.base_url + "/v1"

    def new_key(self, tenant: str) -> str:
        return create_key(self.store, tenant)


def start_env(backend: str, db_url: str, **settings: Any) -> ApiEnv:
    defaults: dict[str, Any] = {"janitor_interval_s": 0.1, "lease_ttl_s": 5.0,
                                "realtime_timeout_s": 60.0}
    server = ServerThread(Settings(db=db_url, **{**defaults, **settings}))
    store = open_store(db_url)
    return ApiEnv(backend=backend, db_url=db_url, server=server, store=store,
                  key=create_key(store, "tenant-a"), operator_key=create_operator_key(store),
                  site_token=create_site(store, f"site-{uuid.uuid4().hex[:6]}", 0.36, "cpu",
                                         serves=ALL_SITE_SCOPES))


def make_env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             backend: str, **settings: Any) -> ApiEnv:
    """A fresh store of the backend (SQLite file, or a new PostgreSQL database) and a server."""
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'minimill.db'}"
    else:
        url = fresh_pg_database(request.getfixturevalue("pg_server"))
    return start_env(backend, url, **settings)


def stop_env(env: ApiEnv) -> None:
    env.server.stop()
    env.store.close()


def reply_words(kind: str, body: dict[str, Any]) -> list[str]:
    if kind == "chat":
        source = str(body["messages"][-1].get("content") or "")
    else:
        prompt = body["prompt"]
        source = prompt if isinstance(prompt, str) else str(prompt[0])
    return ["echo"] + [f" {w}" for w in source.split()]


def tool_format(kind: str, body: dict[str, Any]) -> str | None:
    """The tool syntax a site reports for a request: hermes when it may call its tools."""
    calls = kind == "chat" and body.get("tools") and body.get("tool_choice") != "none"
    return "hermes" if calls else None


def reply_tokens(kind: str, body: dict[str, Any]) -> list[str]:
    """The answer's tokens: the echo, or (a chat with tools asked to CALL) text and calls."""
    source = str(body["messages"][-1].get("content") or "") if kind == "chat" else ""
    if tool_format(kind, body) is None or "CALL " not in source:
        return reply_words(kind, body)
    head, *calls = source.split("CALL ")
    blocks = [f"echo {head.strip()}"] if head.strip() else []
    for call in calls:
        name, _, arguments = call.strip().partition(" ")
        blocks.append("<tool_call>\n" + json.dumps(
            {"name": name, "arguments": json.loads(arguments or "{}")}) + "\n</tool_call>")
    text = "\n".join(blocks)
    return [text[i:i + 4] for i in range(0, len(text), 4)]


@dataclass
class EchoSite:
    """A worker site that answers over the real protocol from its own thread."""

    base_url: str
    token: str
    capacity: int = 64
    tokens_per_s: float = 100.0
    # The price per hour it declares with each lease call (None: declares none).
    price_per_hour: float | None = None
    # Seconds between streamed tokens (streaming leases checkpoint after every token).
    token_delay_s: float = 0.02
    # Seconds each other lease takes to serve (time the site holds it before completing).
    serve_delay_s: float = 0.0
    # Stop leasing after this many leases (None: no limit).
    max_leases: int | None = None
    # Stream checkpoints as whole progress (what older workers send) rather than deltas.
    full_checkpoints: bool = False
    # At this token of a stream, send a delta from a base one token short (as after a lost
    # answer): the control plane asks for a resync and the site sends its whole progress.
    stale_base_at: int | None = None
    resyncs: list[str] = field(default_factory=list)
    # Seconds a batch of leases is held before it is completed (as generating would take).
    hold_s: float = 0.0
    completed: list[str] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    leases_seen: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._client = httpx.Client(base_url=self.base_url + "/v1/fleet", timeout=30,
                                    headers={"Authorization": f"Bearer {self.token}"})

    def __enter__(self) -> EchoSite:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._client.close()

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        resp = self._client.post(path, json=payload)
        resp.raise_for_status()
        answer: dict[str, Any] = resp.json()
        return answer

    def _run(self) -> None:
        while not self._stop.is_set():
            room = self.capacity
            if self.max_leases is not None:
                room = min(room, self.max_leases - len(self.leases_seen))
                if room <= 0:
                    return
            try:
                ask = {"capacity": room, "models": [MODEL], "tokens_per_s": self.tokens_per_s}
                if self.price_per_hour is not None:
                    ask["price_per_hour"] = self.price_per_hour
                leases = self._post("/lease", ask)["leases"]
            except httpx.HTTPError:
                time.sleep(0.1)  # the server is restarting or gone
                continue
            if not leases:
                time.sleep(0.02)
                continue
            self.leases_seen.extend(leases)
            results = [self._serve(lease) for lease in leases]
            if self.hold_s:
                self._stop.wait(self.hold_s)
            try:
                answer = self._post("/complete", {"results": results})
            except httpx.HTTPError:
                continue
            self.completed.extend(answer["accepted"])
            self.rejected.extend(answer["rejected"])

    def _serve(self, lease: dict[str, Any]) -> dict[str, Any]:
        body, kind = lease["body"], lease["kind"]
        base = {"request_id": lease["request_id"], "epoch": lease["epoch"]}
        if kind == "embedding":  # one unit vector per input, nothing generated
            from minimill.control.embeddings import embedding_inputs

            inputs = embedding_inputs(body["input"])
            return {**base, "outcome": "succeeded", "choices": [
                {"index": i, "text": "", "embedding": [1.0, 0.0, 0.0, 0.0]}
                for i in range(len(inputs))]}
        words = reply_tokens(kind, body)
        fmt = {"tool_format": f} if (f := tool_format(kind, body)) else {}
        if any("FAIL_CONTEXT" in w for w in words):
            return {**base, "outcome": "failed", "error": {
                "code": "context_length_exceeded", "param": "messages",
                "message": "This model's maximum context length is 8192 tokens."}}
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 10_000
        stop = body.get("stop")
        n_choices = int(body.get("n") or 1)
        if kind == "completion" and isinstance(body["prompt"], list) \
                and isinstance(body["prompt"][0], str):
            n_choices *= len(body["prompt"])
        if kind == "chat":
            want_lp, top = bool(body.get("logprobs")), int(body.get("top_logprobs") or 0)
        else:
            want_lp, top = body.get("logprobs") is not None, int(body.get("logprobs") or 0)
        tokens = words[:limit]
        finish = "length" if len(words) > limit else "stop"
        if stop and any(s in "".join(tokens) for s in ([stop] if isinstance(stop, str) else stop)):
            finish = "stop"
        resumed = {c["index"]: c for c in (lease.get("checkpoint") or {}).get("choices", [])}

        def progress(i: int, upto: int) -> dict[str, Any]:
            lps = ([{"token": t, "logprob": -0.5,
                     "top_logprobs": [{"token": t, "logprob": -0.5}] * top}
                    for t in tokens[:upto]] if want_lp else None)
            return {"index": i, "token_ids": list(range(upto)), "text": "".join(tokens[:upto]),
                    "logprobs": lps, **fmt}

        def delta(i: int, lo: int, hi: int) -> dict[str, Any]:
            new = progress(i, hi)
            lps = new["logprobs"]
            return {"index": i, "base_tokens": lo, "base_chars": len("".join(tokens[:lo])),
                    "base_logprobs": lo if want_lp else 0, "token_ids": new["token_ids"][lo:],
                    "text": "".join(tokens[lo:hi]), "logprobs": None if lps is None else lps[lo:],
                    **fmt}

        if lease.get("stream"):
            full = self.full_checkpoints
            for upto in range(1, len(tokens) + 1):
                if full:
                    item = {**base, "checkpoint": {
                        "choices": [progress(i, upto) for i in range(n_choices)],
                        "num_prompt_tokens": 5}}
                else:
                    lo = upto - 2 if upto == self.stale_base_at and upto >= 2 else upto - 1
                    item = {**base, "delta": {
                        "choices": [delta(i, lo, upto) for i in range(n_choices)],
                        "num_prompt_tokens": 5}}
                answer = self._post("/heartbeat", {"leases": [item]})
                full = self.full_checkpoints or lease["request_id"] in answer["resync"]
                self.resyncs.extend(answer["resync"])
                time.sleep(self.token_delay_s)
        else:
            time.sleep(self.serve_delay_s)
        # A resumed lease continues its checkpoint: the echo text is the same from any point.
        assert all(r.get("text", "") == "".join(tokens)[:len(r.get("text", ""))]
                   for r in resumed.values())
        choices = [{**progress(i, len(tokens)), "finish_reason": finish}
                   for i in range(n_choices)]
        return {**base, "outcome": "succeeded", "choices": choices,
                "usage": {"prompt_tokens": 5, "completion_tokens": len(tokens) * n_choices}}


@functools.cache
def _tokenizer() -> Any:
    from minimill.models.registry import resolve_model
    from minimill.models.tokenizer_files import load_tokenizer

    return load_tokenizer(resolve_model(MODEL))[0]


def chat_prompt_tokens(*messages: str | dict[str, Any]) -> int:
    """The prompt tokens of a chat (a plain string is a user message), as a builtin worker
    renders and encodes it (models/prompt.py): what the control plane bills, whatever a site
    reports."""
    from minimill.models.prompt import render_chat_prompt

    return len(render_chat_prompt(_tokenizer(), [
        {"role": "user", "content": m} if isinstance(m, str) else m for m in messages]))


def wait_for(predicate: Any, timeout_s: float = 30.0, interval_s: float = 0.05) -> Any:
    deadline = time.time() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {predicate}")
        time.sleep(interval_s)


def iter_lines(text: str) -> Iterator[dict[str, Any]]:
    import json

    for line in text.splitlines():
        if line.strip():
            yield json.loads(line)
