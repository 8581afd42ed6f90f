"""Prefix reuse as a client sees it, through `serve` and the official openai client: a second
request sharing a long prefix reports `usage.prompt_tokens_details.cached_tokens` (Responses:
`input_tokens_details`), is billed the cached-input price for them, and answers as a cold
request does."""

from __future__ import annotations

from typing import Any

import pytest
from serve_process import MODEL, Serve

# $ per million tokens: cached input far below input, so a wrong bill shows.
INPUT, CACHED, OUTPUT = 10.0, 1.0, 20.0
SYSTEM = ("You are a careful assistant for a team of field botanists. " * 40).strip()


def _bill(usage: Any) -> float:
    cached = usage.prompt_tokens_details.cached_tokens
    return ((usage.prompt_tokens - cached) * INPUT + cached * CACHED
            + usage.completion_tokens * OUTPUT) / 1e6


@pytest.fixture
def priced(serve: Serve) -> Any:
    done = serve.cli("prices", "set", MODEL, "--input", str(INPUT), "--cached-input",
                     str(CACHED), "--output", str(OUTPUT), "--db", serve.db_url())
    assert done.returncode == 0, done.stderr
    yield serve
    serve.cli("prices", "delete", MODEL, "--db", serve.db_url())


def test_second_request_with_a_shared_prefix_reports_and_bills_cached_tokens(
        priced: Serve) -> None:
    client = priced.client()

    def ask(question: str, **extra: Any) -> Any:
        return client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=8, prompt_cache_key="botany-1",
            messages=[{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": question}], **extra)

    first = ask("Name a fern.")
    assert first.usage is not None and first.usage.prompt_tokens > 400
    second = ask("Name a moss.")
    usage = second.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    # The system prompt's full blocks are reused; the question is not.
    assert 400 <= cached < usage.prompt_tokens
    assert usage.model_extra is not None
    assert usage.model_extra["cost_usd"] == pytest.approx(_bill(usage))
    # The same question again: the answer a cache hit gives is the cold answer.
    again = ask("Name a fern.")
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    # Every full block but the one holding the last prompt token (always computed).
    assert again.usage.prompt_tokens_details.cached_tokens == \
        (again.usage.prompt_tokens - 1) // 16 * 16

    chunks = list(ask("Name a lichen.", stream=True, stream_options={"include_usage": True}))
    final = chunks[-1].usage
    assert final is not None and final.prompt_tokens_details is not None
    assert final.prompt_tokens_details.cached_tokens >= 400

    response = client.responses.create(model=MODEL, instructions=SYSTEM, input="Name a tree.",
                                       max_output_tokens=8, temperature=0,
                                       prompt_cache_key="botany-1")
    assert response.usage is not None
    assert response.usage.input_tokens_details.cached_tokens >= 400


def test_prompt_cache_key_is_validated(serve: Serve) -> None:
    import openai

    client = serve.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, max_tokens=2, prompt_cache_key="",
                                       messages=[{"role": "user", "content": "hi"}])
    assert err.value.body is not None and "prompt_cache_key" in str(err.value.body)
    done = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2,
                                     extra_body={"prompt_cache_key": "story-7"})
    assert done.usage is not None and done.usage.prompt_tokens_details is not None
