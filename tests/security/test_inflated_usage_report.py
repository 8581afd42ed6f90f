"""Attack: a site decides how much a tenant pays, by what it reports.

Before, usage came from the site's report, checked against nothing: a request with
`max_tokens: 5` that produced one token was billed $1,073.74. Here a lying site (a real client
of the worker protocol) completes requests with inflated reports: absurd token counts, more
choices than the request asked for, more token ids than max_tokens allows. Each completion is
rejected as a protocol error (usage_mismatch), counted against the site (the operators' site
list and /metrics show it), and its request goes back to the queue, where an honest site serves
it: the tenant is billed the prompt the control plane counted at admission and the tokens
returned. A report that only inflates the prompt or the cached tokens changes nothing."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest
from api_harness import (
    MODEL,
    ApiEnv,
    EchoSite,
    chat_prompt_tokens,
    wait_for,
)
from openai import OpenAI

from minimill.control.sites import create_site

BIG = 2**31 - 1
# The built-in price (no price list set), realtime, $ per token.
INPUT, OUTPUT = 0.10 / 1e6, 0.40 / 1e6


class LyingSite:
    """Leases one request and completes it with whatever `forge` makes of the lease."""

    def __init__(self, env: ApiEnv, name: str) -> None:
        self.name = name
        token = create_site(env.store, name, 0.1)
        self.http = httpx.Client(base_url=env.v1 + "/fleet", timeout=30,
                                 headers={"Authorization": f"Bearer {token}"})

    def lie(self, forge: Any) -> dict[str, Any]:
        lease = wait_for(lambda: self.http.post("/lease", json={
            "capacity": 1, "models": [MODEL]}).json()["leases"])[0]
        result = {"request_id": lease["request_id"], "epoch": lease["epoch"],
                  "outcome": "succeeded", **forge(lease)}
        answer: dict[str, Any] = self.http.post("/complete", json={"results": [result]}).json()
        return answer


def choice(index: int = 0, tokens: int = 1, text: str = "echo") -> dict[str, Any]:
    return {"index": index, "token_ids": list(range(tokens)), "text": text,
            "finish_reason": "length"}


def ask(client: OpenAI, content: str, answers: list[Any], **body: Any) -> threading.Thread:
    """The tenant's call, waiting in a thread while the sites play."""
    def call() -> None:
        answers.append(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], **body))
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


def site_row(env: ApiEnv, name: str) -> dict[str, Any]:
    sites = httpx.get(env.v1 + "/sites", headers={"Authorization": f"Bearer {env.operator_key}"})
    row: dict[str, Any] = next(s for s in sites.json()["data"] if s["name"] == name)
    return row


@pytest.mark.parametrize("forge", [
    # The reproduced case: one token produced, billions reported.
    lambda lease: {"choices": [choice()], "usage": {
        "prompt_tokens": BIG, "completion_tokens": BIG, "cached_tokens": BIG}},
    # More choices than n = 1, each within max_tokens.
    lambda lease: {"choices": [choice(i, 5) for i in range(4)], "usage": {
        "prompt_tokens": 10, "completion_tokens": 20}},
    # More tokens than max_tokens = 5, and a report that says so.
    lambda lease: {"choices": [choice(0, 100)], "usage": {
        "prompt_tokens": 10, "completion_tokens": 100}},
    # Text only (as an engine that hands out text), and far more tokens than it holds.
    lambda lease: {"choices": [{"index": 0, "text": "echo", "finish_reason": "length"}],
                   "usage": {"prompt_tokens": 10, "completion_tokens": 5000}},
], ids=["absurd", "extra-choices", "past-max-tokens", "text-only"])
def test_an_inflated_report_is_refused_and_the_tenant_billed_the_counts(
        env: ApiEnv, forge: Any, request: pytest.FixtureRequest) -> None:
    name = f"liar-{request.node.callspec.id}"
    liar = LyingSite(env, name)
    answers: list[Any] = []
    content = "hello there friend"
    with OpenAI(base_url=env.v1, api_key=env.key, max_retries=0, timeout=60) as client:
        call = ask(client, content, answers, max_tokens=5)
        answer = liar.lie(forge)
        assert answer["accepted"] == []
        (refused,) = answer["rejected"]
        assert refused["reason"] == "usage_mismatch" and refused["message"]
        # Back in the queue: an honest site serves it.
        with EchoSite(env.base_url, env.site_token):
            call.join(timeout=60)
    (served,) = answers
    assert served.choices[0].message.content == "echo hello there friend"
    usage = served.usage
    prompt = chat_prompt_tokens(content)
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt, 4)
    assert usage.model_extra["cost_usd"] == pytest.approx(prompt * INPUT + 4 * OUTPUT)
    row = site_row(env, name)
    assert (row["usage_rejections"], row["completions"], row["billed_usd"]) == (1, 0, 0.0)
    metrics = httpx.get(env.base_url + "/metrics",
                        headers={"Authorization": f"Bearer {env.operator_key}"}).text
    assert f'minimill_site_usage_rejections_total{{chip="cpu",site="{name}"}} 1.0' in metrics


def test_an_inflated_prompt_or_cache_report_changes_no_bill(env: ApiEnv) -> None:
    liar = LyingSite(env, "prompt-liar")
    answers: list[Any] = []
    content = "count my prompt yourself"
    with OpenAI(base_url=env.v1, api_key=env.key, max_retries=0, timeout=60) as client:
        call = ask(client, content, answers, max_tokens=5)
        answer = liar.lie(lambda lease: {"choices": [choice(0, 3, "a b c")], "usage": {
            "prompt_tokens": BIG, "completion_tokens": 3, "cached_tokens": BIG}})
        assert answer["rejected"] == [] and len(answer["accepted"]) == 1
        call.join(timeout=60)
    (served,) = answers
    prompt = chat_prompt_tokens(content)
    assert (served.usage.prompt_tokens, served.usage.completion_tokens) == (prompt, 3)
    # Cached tokens never more than the prompt: here all of it, at the cached price (the
    # input price, with no price list set).
    assert served.usage.prompt_tokens_details.cached_tokens == prompt
    assert served.usage.model_extra["cost_usd"] == pytest.approx(prompt * INPUT + 3 * OUTPUT)
    assert site_row(env, "prompt-liar")["usage_rejections"] == 0
