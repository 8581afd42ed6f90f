"""Attack: a site forges an embedding request's result to bill more, or to hand the tenant
vectors that are not one per input.

A lying site (a real client of the worker protocol) completes a tenant's `/v1/embeddings` call
with: fewer vectors than inputs, vectors of different sizes, a missing vector, generated tokens
billed as completion tokens, embeddings on a chat completion. Each completion is refused as a
protocol error (usage_mismatch) and the request goes back to the queue. A well-formed result
whose report inflates the prompt is accepted and billed the prompt the control plane counted,
and nothing for completion: the tenant gets its vectors, in input order."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest
from api_harness import MODEL, ApiEnv, wait_for
from openai import OpenAI

from minimill.control.prompt_count import counter_for
from minimill.control.sites import create_site

BIG = 2**31 - 1
INPUTS = ["first input", "the second one"]
INPUT_PRICE = 0.10 / 1e6  # the built-in realtime input price, $ per token


def vector(size: int, at: int) -> list[float]:
    return [1.0 if i == at else 0.0 for i in range(size)]


def vectors(*sizes: int | None) -> list[dict[str, Any]]:
    return [{"index": i, "finish_reason": "stop",
             **({"embedding": vector(size, i)} if size is not None else {})}
            for i, size in enumerate(sizes)]


def complete(http: httpx.Client, result: dict[str, Any]) -> dict[str, Any]:
    lease = wait_for(lambda: http.post("/lease", json={
        "capacity": 1, "models": [MODEL]}).json()["leases"])[0]
    assert lease["kind"] == "embedding"
    answer: dict[str, Any] = http.post("/complete", json={"results": [{
        "request_id": lease["request_id"], "epoch": lease["epoch"], "outcome": "succeeded",
        **result}]}).json()
    return answer


FORGERIES = {
    "fewer-vectors": {"choices": vectors(8), "usage": {"prompt_tokens": 5,
                                                       "completion_tokens": 0}},
    "mixed-sizes": {"choices": vectors(8, 9), "usage": {"prompt_tokens": 5,
                                                        "completion_tokens": 0}},
    "a-missing-vector": {"choices": vectors(8, None), "usage": {"prompt_tokens": 5,
                                                                "completion_tokens": 0}},
    "generated-tokens": {"choices": [{**c, "token_ids": [1, 2, 3], "text": "abc"}
                                     for c in vectors(8, 8)],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 6}},
    "billed-completion": {"choices": vectors(8, 8), "usage": {"prompt_tokens": 5,
                                                              "completion_tokens": BIG}},
}


def test_forged_results_are_refused_and_the_tenant_billed_its_prompt(env: ApiEnv) -> None:
    http = httpx.Client(base_url=env.v1 + "/fleet", timeout=30, headers={
        "Authorization": f"Bearer {create_site(env.store, 'embed-liar', 0.1)}"})
    answers: list[Any] = []
    with OpenAI(base_url=env.v1, api_key=env.key, max_retries=0, timeout=60) as client:
        def call() -> None:
            answers.append(client.embeddings.create(model=MODEL, input=INPUTS,
                                                    encoding_format="float"))
        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        for name, forged in FORGERIES.items():
            answer = complete(http, forged)
            assert answer["accepted"] == [], name
            (refused,) = answer["rejected"]
            assert refused["reason"] == "usage_mismatch", name
        # Well formed, with an inflated prompt report: accepted, billed the control
        # plane's count.
        answer = complete(http, {"choices": vectors(8, 8), "usage": {
            "prompt_tokens": BIG, "completion_tokens": 0, "cached_tokens": 0}})
        assert len(answer["accepted"]) == 1
        thread.join(timeout=60)
    (served,) = answers
    assert [d.embedding for d in served.data] == [vector(8, 0), vector(8, 1)]
    prompt = sum(counter_for(MODEL).count_texts(INPUTS, add_special_tokens=True))
    assert (served.usage.prompt_tokens, served.usage.total_tokens) == (prompt, prompt)
    assert served.usage.model_extra["cost_usd"] == pytest.approx(prompt * INPUT_PRICE)


def test_embeddings_on_a_chat_completion_are_refused(env: ApiEnv) -> None:
    http = httpx.Client(base_url=env.v1 + "/fleet", timeout=30, headers={
        "Authorization": f"Bearer {create_site(env.store, 'chat-liar', 0.1)}"})
    with OpenAI(base_url=env.v1, api_key=env.key, max_retries=0, timeout=5) as client:
        def call() -> None:
            # Nobody serves it after the refusal: the call times out and goes away.
            with pytest.raises(Exception, match="timed out"):
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        lease = wait_for(lambda: http.post("/lease", json={
            "capacity": 1, "models": [MODEL]}).json()["leases"])[0]
        answer = http.post("/complete", json={"results": [{
            "request_id": lease["request_id"], "epoch": lease["epoch"],
            "outcome": "succeeded",
            "choices": [{"index": 0, "token_ids": [5], "text": "x", "finish_reason": "length",
                         "embedding": [0.5, 0.5]}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1}}]}).json()
        assert answer["accepted"] == []
        assert answer["rejected"][0]["reason"] == "usage_mismatch"
        thread.join(timeout=30)
