"""Models, chat and completions through the official openai client, with a protocol site."""

from __future__ import annotations

import openai
import pytest
from api_harness import MODEL, ApiEnv, EchoSite, chat_prompt_tokens, wait_for
from openai import OpenAI
from sqlalchemy import select

from minimill.control.tables import requests


def test_models_list_and_retrieve(client: OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "minimill"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-404")


def test_chat_completion_non_stream(client: OpenAI, site: EchoSite) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there friend"}],
        max_tokens=50, seed=7, temperature=0.3, top_p=0.9)
    assert r.object == "chat.completion"
    assert r.choices[0].message.content == "echo hello there friend"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None
    # The prompt as the control plane counted it (the site reported 5).
    prompt = chat_prompt_tokens("hello there friend")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        prompt, 4, prompt + 4)
    # The built-in price (no price list set): 0.10 $/Mtok in, 0.40 out; realtime at full price.
    assert r.usage.model_extra is not None
    assert r.usage.model_extra["cost_usd"] == pytest.approx((prompt * 0.10 + 4 * 0.40) / 1e6)
    assert r.service_tier == "default"


def test_chat_n_choices_max_tokens_and_logprobs(client: OpenAI, site: EchoSite) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "one two three four"}], n=3,
        max_completion_tokens=2, logprobs=True, top_logprobs=2, stop=["zzz"])
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == "echo one" and c.finish_reason == "length"
               for c in r.choices)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None
    assert [t.token for t in lp.content] == ["echo", " one"]
    assert len(lp.content[0].top_logprobs) == 2 and lp.content[0].logprob == -0.5


def test_flex_tier_is_background_and_cheaper(client: OpenAI, site: EchoSite) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a b c"}], service_tier="flex")
    assert r.service_tier == "flex"
    assert r.usage is not None and r.usage.model_extra is not None
    assert r.usage.model_extra["cost_usd"] == pytest.approx(
        (chat_prompt_tokens("a b c") * 0.10 + 4 * 0.40) / 1e6 * 0.5)


def test_chat_stream_deltas_and_usage(client: OpenAI, site: EchoSite) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "alpha beta gamma delta"}],
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "echo alpha beta gamma delta"
    # Checkpoints arrive token by token, so the text comes in several deltas.
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 3
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and finishes.count("stop") == 1
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5


@pytest.mark.parametrize("mode", ["deltas", "stale_base", "full_checkpoints"])
def test_stream_of_choices_and_logprobs_is_exact(env: ApiEnv, client: OpenAI,
                                                  mode: str) -> None:
    """Deltas, a delta from a stale base (resync, then the whole progress once), and whole
    checkpoints as older workers send them: the client gets the same stream."""
    with EchoSite(env.base_url, env.site_token, full_checkpoints=mode == "full_checkpoints",
                  stale_base_at=3 if mode == "stale_base" else None) as echo:
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "one two three four five"}],
            stream=True, n=2, logprobs=True, top_logprobs=1))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) == "echo one two three four five"
        tokens = [lp.token for c in mine if c.logprobs and c.logprobs.content
                  for lp in c.logprobs.content]
        assert tokens == ["echo", " one", " two", " three", " four", " five"]
    assert echo.resyncs == ([] if mode != "stale_base" else [echo.leases_seen[0]["request_id"]])


def test_completions_non_stream_and_stream(client: OpenAI, site: EchoSite) -> None:
    r = client.completions.create(model=MODEL, prompt="the quick fox", max_tokens=3,
                                  logprobs=1)
    assert r.object == "text_completion"
    assert r.choices[0].text == "echo the quick"
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].logprobs is not None
    assert r.choices[0].logprobs.tokens == ["echo", " the", " quick"]
    assert r.choices[0].logprobs.text_offset == [0, 4, 8]
    # OpenAI's default max_tokens for completions is 16.
    long = client.completions.create(model=MODEL, prompt=" ".join(["w"] * 40))
    assert long.usage is not None and long.usage.completion_tokens == 16
    parts = list(client.completions.create(model=MODEL, prompt="x y", stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == "echo x y"
    assert parts[-1].choices[0].finish_reason == "stop"


def test_completions_several_prompts(client: OpenAI, site: EchoSite) -> None:
    r = client.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=5)
    assert len(r.choices) == 4


def test_worker_failure_is_a_400_with_its_code(client: OpenAI, site: EchoSite) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "FAIL_CONTEXT please"}])
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as streamed:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "FAIL_CONTEXT"}], stream=True)
    assert streamed.value.code == "context_length_exceeded"


def test_unknown_model_and_bad_parameters(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, temperature=3.5,
                                       messages=[{"role": "user", "content": "x"}])
    assert bad.value.param == "temperature"


def test_client_timeout_cancels_the_request(env: ApiEnv) -> None:
    """No site is running: the client gives up, and its request is cancelled, not left queued."""
    def realtime_ids(status: str) -> set[str]:
        with env.store.read() as conn:
            return set(conn.execute(select(requests.c.id).where(
                requests.c.batch_id.is_(None), requests.c.status == status)).scalars())

    # Other tests of this store may leave queued work of their own (background responses).
    queued_before, cancelled_before = realtime_ids("queued"), realtime_ids("cancelled")
    with OpenAI(base_url=env.v1, api_key=env.key, max_retries=0, timeout=1.0) as c, \
            pytest.raises(openai.APITimeoutError):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "bye"}])

    def cancelled() -> bool:
        return not realtime_ids("queued") - queued_before \
            and bool(realtime_ids("cancelled") - cancelled_before)

    wait_for(cancelled, timeout_s=10)


def test_closing_a_stream_cancels_the_request(env: ApiEnv, client: OpenAI) -> None:
    with EchoSite(env.base_url, env.site_token, token_delay_s=0.1) as slow:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": " ".join(["w"] * 25)}],
            stream=True)
        first = next(iter(stream))
        assert first.choices[0].delta.role == "assistant"
        stream.close()

        def cancelled() -> bool:
            with env.store.read() as conn:
                statuses = conn.execute(select(requests.c.status).where(
                    requests.c.batch_id.is_(None)).order_by(requests.c.seq.desc())).scalars()
                return next(statuses) == "cancelled"

        wait_for(cancelled, timeout_s=10)
        wait_for(lambda: slow.rejected, timeout_s=20)
    assert slow.rejected[0]["reason"] == "already_completed"
