"""`minimill serve` end to end through the official openai client: the control plane process,
its local worker process over loopback HTTP, the builtin engine and a real SQLite store."""

from __future__ import annotations

import time

import openai
import pytest
from serve_process import MODEL, Serve, chat_line, read_jsonl

pytestmark = pytest.mark.slow


def test_models_lists_the_served_model(serve: Serve) -> None:
    ids = [m.id for m in serve.client().models.list().data]
    assert MODEL in ids


def test_chat_non_stream_returns_text_usage_and_cost(serve: Serve) -> None:
    resp = serve.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8, temperature=0)
    choice = resp.choices[0]
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage is not None
    assert resp.usage.prompt_tokens > 5
    assert 1 <= resp.usage.completion_tokens <= 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_stream_delivers_chunks_then_a_finish_reason(serve: Serve) -> None:
    stream = serve.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from one to ten."}],
        max_tokens=24, temperature=0, stream=True)
    pieces, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert "".join(pieces).strip()
    assert finish in ("stop", "length")


def test_seeded_sampling_is_reproducible_and_n_choices_differ(serve: Serve) -> None:
    def ask() -> list[str]:
        resp = serve.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
            max_tokens=6, temperature=1.0, seed=7, n=3)
        return [c.message.content or "" for c in sorted(resp.choices, key=lambda c: c.index)]

    first = ask()
    assert len(first) == 3
    assert len(set(first)) > 1  # each choice samples with its own seed
    assert ask() == first


def test_completions_with_logprobs(serve: Serve) -> None:
    resp = serve.client().completions.create(model=MODEL, prompt="The capital of France is",
                                             max_tokens=5, temperature=0, logprobs=2)
    choice = resp.choices[0]
    assert choice.text
    assert choice.logprobs is not None and choice.logprobs.token_logprobs
    assert len(choice.logprobs.token_logprobs) == resp.usage.completion_tokens  # type: ignore
    assert all(lp is not None and lp <= 0 for lp in choice.logprobs.token_logprobs)


def test_prompt_longer_than_the_context_is_a_400_with_its_code(serve: Serve) -> None:
    long_text = "word " * 9000
    with pytest.raises(openai.BadRequestError) as info:
        serve.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long_text}], max_tokens=4)
    assert info.value.code == "context_length_exceeded"


def wait_batch(serve: Serve, batch_id: str, timeout: float = 300.0) -> object:
    deadline = time.time() + timeout
    client = serve.client()
    while time.time() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.5)
    raise TimeoutError(f"batch {batch_id} did not finish in {timeout}s")


def test_batch_with_bad_lines(serve: Serve, tmp_path) -> None:  # type: ignore[no-untyped-def]
    good = [chat_line(f"ok-{i:03d}", f"Write one word about the number {i}.") for i in range(200)]
    bad = {
        "bad-model": chat_line("bad-model", "hi").replace(MODEL, "no-such-model"),
        "bad-params": chat_line("bad-params", "hi", temperature=-3),
        "ok-000": chat_line("ok-000", "a duplicate custom_id"),
    }
    lines = [*good[:100], bad["bad-model"], "{not json", *good[100:], bad["bad-params"],
             bad["ok-000"]]
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(lines) + "\n")
    client = serve.client()
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"suite": "e2e"})
    done = wait_batch(serve, batch.id)
    assert done.status == "completed", done  # type: ignore[attr-defined]
    out = read_jsonl(client.files.content(done.output_file_id).read())  # type: ignore
    errors = read_jsonl(client.files.content(done.error_file_id).read())  # type: ignore
    out_ids = [r["custom_id"] for r in out]
    assert sorted(out_ids) == sorted(f"ok-{i:03d}" for i in range(200))
    for record in out:
        body = record["response"]["body"]
        assert record["response"]["status_code"] == 200
        assert body["choices"][0]["message"]["content"] is not None
        assert body["usage"]["completion_tokens"] >= 1
    error_ids = [r["custom_id"] for r in errors]
    assert "bad-model" in error_ids and "bad-params" in error_ids
    assert len(errors) == 4  # + the unparseable line and the duplicate custom_id
    counts = done.request_counts  # type: ignore[attr-defined]
    assert (counts.completed, counts.failed, counts.total) == (200, 4, 204)


def test_cancel_mid_batch_keeps_finished_results(serve: Serve, tmp_path) -> None:  # type: ignore
    # A few short lines finish at once; the long ones are still running when the cancel comes.
    lines = [chat_line(f"c-{i:03d}", f"Tell a long story about ship number {i}.",
                       max_tokens=2 if i < 10 else 400) for i in range(240)]
    path = tmp_path / "cancel.jsonl"
    path.write_text("\n".join(lines) + "\n")
    client = serve.client()
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    deadline = time.time() + 300
    while time.time() < deadline:
        current = client.batches.retrieve(batch.id)
        if current.request_counts and current.request_counts.completed >= 1:
            break
        time.sleep(0.2)
    log_offset = len(serve.log_text())
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    done = wait_batch(serve, batch.id, timeout=60)
    assert done.status == "cancelled"  # type: ignore[attr-defined]
    counts = done.request_counts  # type: ignore[attr-defined]
    assert 1 <= counts.completed < 240
    out = read_jsonl(client.files.content(done.output_file_id).read())  # type: ignore
    ids = [r["custom_id"] for r in out]
    assert len(ids) == len(set(ids)) == counts.completed
    # The worker learns of the cancel with its next heartbeat and stops generating.
    serve.wait_for_log(r"leases revoked", timeout=30, start=log_offset)
