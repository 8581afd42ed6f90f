"""A worker whose engine is another OpenAI-compatible server (`--engine URL`).

Upstream: a `minimill serve` with its builtin local worker plays the OpenAI-compatible server
(as vLLM or llama.cpp would). Front: a control plane with no local worker; the only site is a
worker that streams every request from the upstream server.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from serve_process import MODEL, Serve, Worker, make_home

pytestmark = pytest.mark.slow


@dataclass
class HttpFleet:
    front: Serve
    http_worker: Worker
    home: Path


@pytest.fixture(scope="module")
def fleet(fleet_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpFleet]:
    upstream = Serve(make_home(tmp_path_factory.mktemp("upstream"),
                               fleet_home / "models")).start_and_wait()
    front = Serve(fleet_home, local_worker=False).start_and_wait()
    token = front.cli("sites", "create", "remote-gpu").stdout.strip().splitlines()[-1]
    worker = Worker(fleet_home, f"http://127.0.0.1:{front.port}", "remote-gpu", token,
                    engine=upstream.base_url,
                    extra_env={"MINIMILL_ENGINE_API_KEY": upstream.key})
    try:
        worker.start_and_wait()
        yield HttpFleet(front, worker, fleet_home)
    finally:
        worker.stop()
        front.stop()
        upstream.stop()


@pytest.fixture
def front(fleet: HttpFleet) -> Serve:
    return fleet.front


def test_chat_through_an_http_engine(front: Serve) -> None:
    resp = front.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
        temperature=0, seed=3)
    assert resp.choices[0].message.content
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage is not None
    assert resp.usage.prompt_tokens > 5  # the upstream's usage figure
    assert 1 <= resp.usage.completion_tokens <= 8


def test_stream_and_n_through_an_http_engine(front: Serve) -> None:
    stream = front.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three fruits."}],
        max_tokens=12, temperature=1.0, seed=11, n=2, stream=True)
    texts: dict[int, str] = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] and texts[1]


def test_completion_and_bad_request_through_an_http_engine(front: Serve) -> None:
    resp = front.client().completions.create(model=MODEL, prompt="One, two, three,",
                                             max_tokens=6, temperature=0)
    assert resp.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        front.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "word " * 9000}], max_tokens=4)
    assert info.value.code == "context_length_exceeded"


def test_a_text_checkpoint_resumes_on_a_builtin_worker(fleet: HttpFleet) -> None:
    """The HTTP site checkpoints text only; a builtin site takes over from that text."""
    stream = fleet.front.client(timeout=300).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a long story about a fox."}],
        max_tokens=120, temperature=0, stream=True)
    chunks = iter(stream)
    first = ""
    while len(first) < 20:
        first += "".join(c.delta.content or "" for c in next(chunks).choices)
    os.kill(fleet.http_worker.pid, signal.SIGSTOP)
    token = fleet.front.cli("sites", "create", "builtin-b").stdout.strip().splitlines()[-1]
    builtin = Worker(fleet.home, f"http://127.0.0.1:{fleet.front.port}", "builtin-b", token)
    try:
        builtin.start_and_wait()
        rest = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
        builtin.wait_for_log(r"1 resume from checkpoints", 30)
        assert rest  # the builtin site continued the answer the HTTP site had begun
    finally:
        os.kill(fleet.http_worker.pid, signal.SIGCONT)
        builtin.stop()
