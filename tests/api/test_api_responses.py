"""The Responses API through the official openai client, with a protocol site (SQLite and
PostgreSQL): foreground, background, conversations, cancel, delete, input items, streams
resumed after a disconnect, tenant scoping, batch lines, and bad input."""

from __future__ import annotations

import io
import json
from typing import Any

import httpx
import openai
import pytest
from api_harness import MODEL, ApiEnv, EchoSite, iter_lines, wait_for
from openai import OpenAI
from sqlalchemy import select

from minimill.control.tables import requests

LONG_INPUT = " ".join(f"w{i}" for i in range(40))


def request_id(response_id: str) -> str:
    return "req_" + response_id.removeprefix("resp_")


def lease_of(site: EchoSite, response_id: str) -> dict[str, Any]:
    return next(lease for lease in site.leases_seen
                if lease["request_id"] == request_id(response_id))


def poll(client: OpenAI, response_id: str, timeout_s: float = 30.0) -> Any:
    """The response once it has ended (polled as a client of a background response does)."""
    return wait_for(lambda: (lambda r: r if r.status not in ("queued", "in_progress")
                             else None)(client.responses.retrieve(response_id)), timeout_s)


def test_foreground_response_has_openai_shapes(client: OpenAI, site: EchoSite) -> None:
    r = client.responses.create(model=MODEL, input="hello there friend", instructions="Be brief.",
                                max_output_tokens=50, temperature=0.3, top_p=0.9,
                                metadata={"ticket": "T-1"}, extra_body={"seed": 7})
    assert (r.object, r.status, r.background) == ("response", "completed", False)
    assert r.output_text == "echo hello there friend"
    message = r.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "completed" and message.id.startswith("msg_")
    assert r.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (5, 4, 9)
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert r.usage.model_extra is not None
    assert r.usage.model_extra["cost_usd"] == pytest.approx((5 * 0.10 + 4 * 0.40) / 1e6)
    assert (r.instructions, r.max_output_tokens, r.metadata) == ("Be brief.", 50, {"ticket": "T-1"})
    assert (r.temperature, r.top_p, r.service_tier) == (0.3, 0.9, "default")
    assert r.completed_at is not None and r.store is True
    # The worker ran it as a chat: instructions as the system message, the input after it.
    lease = lease_of(site, r.id)
    assert lease["kind"] == "chat"
    assert lease["body"]["messages"] == [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "hello there friend"}]
    assert (lease["body"]["max_completion_tokens"], lease["body"]["seed"]) == (50, 7)
    assert client.responses.retrieve(r.id).output_text == r.output_text


def test_background_create_poll_complete_at_the_background_price(client: OpenAI,
                                                                   site: EchoSite) -> None:
    created = client.responses.create(model=MODEL, input="one two three", background=True)
    assert created.status in ("queued", "in_progress") and created.background is True
    assert created.output == [] and created.usage is None
    done = poll(client, created.id)
    assert done.status == "completed" and done.output_text == "echo one two three"
    assert done.service_tier == "flex"
    assert done.usage is not None and done.usage.model_extra is not None
    assert done.usage.model_extra["cost_usd"] == pytest.approx((5 * 0.10 + 4 * 0.40) / 1e6 * 0.5)


def test_max_output_tokens_makes_an_incomplete_response(client: OpenAI, site: EchoSite) -> None:
    r = client.responses.create(model=MODEL, input="a b c d e", max_output_tokens=2)
    assert r.status == "incomplete" and r.output_text == "echo a"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"


def test_three_turn_conversation_through_previous_response_id(client: OpenAI,
                                                               site: EchoSite) -> None:
    first = client.responses.create(model=MODEL, input="red green", instructions="Turn one.")
    second = client.responses.create(model=MODEL, input="blue", previous_response_id=first.id,
                                     instructions="Turn two.", background=True)
    second = poll(client, second.id)
    third = client.responses.create(model=MODEL, previous_response_id=second.id, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "yellow "},
                                     {"type": "input_text", "text": "cyan"}]}])
    assert [first.output_text, second.output_text, third.output_text] == [
        "echo red green", "echo blue", "echo yellow cyan"]
    assert (second.previous_response_id, third.previous_response_id) == (first.id, second.id)
    # The worker saw the whole conversation; earlier instructions are not carried over.
    messages = lease_of(site, third.id)["body"]["messages"]
    assert messages == [{"role": "user", "content": "red green"},
                        {"role": "assistant", "content": "echo red green"},
                        {"role": "user", "content": "blue"},
                        {"role": "assistant", "content": "echo blue"},
                        {"role": "user", "content": "yellow cyan"}]
    assert lease_of(site, second.id)["body"]["messages"][0] == {"role": "system",
                                                                "content": "Turn two."}
    # The chain's root id is its session key, on the row and in every lease.
    assert {lease_of(site, r.id)["session_key"] for r in (first, second, third)} == {first.id}
    items = client.responses.input_items.list(third.id, order="asc")
    assert [i.role for i in items.data] == ["user"]  # this turn's input only
    # An explicit prompt_cache_key is the session key instead.
    keyed = client.responses.create(model=MODEL, input="x", previous_response_id=third.id,
                                    prompt_cache_key="agent-42")
    assert lease_of(site, keyed.id)["session_key"] == "agent-42"
    assert keyed.prompt_cache_key == "agent-42"


def test_chat_prompt_cache_key_is_the_session_key(client: OpenAI, env: ApiEnv,
                                                  site: EchoSite) -> None:
    chat = client.chat.completions.create(model=MODEL, prompt_cache_key="sess-1",
                                          messages=[{"role": "user", "content": "hi"}])
    with env.store.read() as conn:
        row = conn.execute(select(requests.c.session_key).where(
            requests.c.id == "req_" + chat.id.removeprefix("chatcmpl-"))).one()
    assert row.session_key == "sess-1"


def test_cancel_a_queued_background_response(client: OpenAI, env: ApiEnv) -> None:
    created = client.responses.create(model=MODEL, input="never run", background=True)
    assert created.status == "queued"
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled" and cancelled.output == []
    assert client.responses.cancel(created.id).status == "cancelled"  # again: the same answer
    with EchoSite(env.base_url, env.site_token) as site:
        marker = client.responses.create(model=MODEL, input="after", background=True)
        poll(client, marker.id)
    assert request_id(created.id) not in {lease["request_id"] for lease in site.leases_seen}
    assert client.responses.retrieve(created.id).status == "cancelled"


def test_cancel_a_running_background_response(client: OpenAI, env: ApiEnv) -> None:
    with EchoSite(env.base_url, env.site_token, serve_delay_s=2.0) as site:
        created = client.responses.create(model=MODEL, input="slow one", background=True)
        wait_for(lambda: client.responses.retrieve(created.id).status == "in_progress")
        cancelled = client.responses.cancel(created.id)
        assert cancelled.status == "cancelled"
        # The worker's late answer is refused: the response was cancelled while it ran.
        wait_for(lambda: any(r["request_id"] == request_id(created.id) for r in site.rejected))
        foreground = client.responses.create(model=MODEL, input="q")
    assert {"request_id": request_id(created.id), "reason": "already_completed"} in site.rejected
    assert client.responses.retrieve(created.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError) as refused:  # only background ones cancel
        client.responses.cancel(foreground.id)
    assert refused.value.param == "response_id"


def test_cancel_of_a_completed_response_is_a_conflict(client: OpenAI, site: EchoSite) -> None:
    done = poll(client, client.responses.create(model=MODEL, input="x", background=True).id)
    with pytest.raises(openai.ConflictError):
        client.responses.cancel(done.id)


def _events(stream: Any, until_deltas: int | None = None) -> list[Any]:
    events = []
    for event in stream:
        events.append(event)
        deltas = sum(1 for e in events if e.type == "response.output_text.delta")
        if until_deltas is not None and deltas >= until_deltas:
            break
    return events


def test_streamed_background_response_resumes_without_gap_or_repeat(client: OpenAI,
                                                                    env: ApiEnv) -> None:
    with EchoSite(env.base_url, env.site_token, token_delay_s=0.05):
        stream = client.responses.create(model=MODEL, input=LONG_INPUT, background=True,
                                         stream=True)
        first = _events(stream, until_deltas=5)
        stream.close()  # the client drops its connection mid-answer
        response_id = first[0].response.id
        assert client.responses.retrieve(response_id).status in ("queued", "in_progress")
        resumed = _events(client.responses.retrieve(response_id, stream=True,
                                                    starting_after=first[-1].sequence_number))
        # The official helper replays from the start and skips what the client already has.
        with client.responses.stream(response_id=response_id,
                                     starting_after=first[-1].sequence_number) as again:
            replayed = _events(again)
            final = again.get_final_response()
    events = first + resumed
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress",
                                            "response.output_item.added",
                                            "response.content_part.added"]
    assert events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "echo " + LONG_INPUT == events[-1].response.output_text
    assert [(e.type, e.sequence_number) for e in replayed] == [
        (e.type, e.sequence_number) for e in resumed]
    assert final.output_text == text
    assert client.responses.retrieve(response_id).status == "completed"  # it ran on


def test_foreground_stream_closed_by_the_client_cancels_it(client: OpenAI, env: ApiEnv) -> None:
    with EchoSite(env.base_url, env.site_token, token_delay_s=0.05):
        stream = client.responses.create(model=MODEL, input=LONG_INPUT, stream=True)
        first = _events(stream, until_deltas=3)
        stream.close()
        response_id = first[0].response.id
        assert wait_for(lambda: client.responses.retrieve(response_id).status == "cancelled")


def test_streaming_helper_accumulates_the_final_response(client: OpenAI, site: EchoSite) -> None:
    with client.responses.stream(model=MODEL, input="alpha beta gamma") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "echo alpha beta gamma"
    assert final.status == "completed" and final.usage is not None


def test_a_failed_response(client: OpenAI, site: EchoSite) -> None:
    with pytest.raises(openai.BadRequestError) as failed:
        client.responses.create(model=MODEL, input="FAIL_CONTEXT now")
    assert failed.value.code == "context_length_exceeded"
    background = poll(client, client.responses.create(model=MODEL, input="FAIL_CONTEXT",
                                                      background=True).id)
    assert background.status == "failed" and background.error is not None
    assert background.error.code == "context_length_exceeded"
    with client.responses.stream(model=MODEL, input="FAIL_CONTEXT") as stream:
        types = [e.type for e in stream]
    assert types == ["response.created", "response.in_progress", "response.failed"]


def test_delete_and_store_false(client: OpenAI, site: EchoSite) -> None:
    r = client.responses.create(model=MODEL, input="keep me")
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    unstored = client.responses.create(model=MODEL, input="forget me", store=False)
    assert unstored.output_text == "echo forget me" and unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as chained:
        client.responses.create(model=MODEL, input="x", previous_response_id=unstored.id)
    assert chained.value.param == "previous_response_id"


def test_input_items_pages_in_either_order(client: OpenAI, site: EchoSite) -> None:
    r = client.responses.create(model=MODEL, input=[
        {"role": "developer", "content": "d"}, {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a"}, {"role": "user", "content": "u2"}])
    newest = client.responses.input_items.list(r.id, limit=3)
    assert [i.role for i in newest.data] == ["user", "assistant", "user"]
    assert newest.has_more
    rest = client.responses.input_items.list(r.id, limit=3, after=newest.data[-1].id)
    assert [i.role for i in rest.data] == ["developer"] and not rest.has_more
    oldest = [i for i in client.responses.input_items.list(r.id, order="asc")]
    assert [i.content[0].text for i in oldest] == ["d", "u1", "a", "u2"]
    assert oldest[2].content[0].type == "output_text"


def test_another_tenants_response_is_not_found(client: OpenAI, env: ApiEnv,
                                               site: EchoSite) -> None:
    mine = client.responses.create(model=MODEL, input="secret", background=True)
    poll(client, mine.id)
    with OpenAI(base_url=env.v1, api_key=env.new_key("tenant-other"), max_retries=0) as other:
        for call in (lambda: other.responses.retrieve(mine.id),
                     lambda: other.responses.cancel(mine.id),
                     lambda: other.responses.delete(mine.id),
                     lambda: other.responses.input_items.list(mine.id),
                     lambda: other.responses.create(model=MODEL, input="x",
                                                    previous_response_id=mine.id)):
            with pytest.raises(openai.NotFoundError):
                call()
    assert client.responses.retrieve(mine.id).output_text == "echo secret"


BAD_BODIES: list[tuple[dict[str, Any], int, str]] = [
    ({"input": "x"}, 400, "model"),
    ({"model": MODEL}, 400, "input"),
    ({"model": MODEL, "input": 5}, 400, "input"),
    ({"model": MODEL, "input": []}, 400, "input"),
    ({"model": MODEL, "input": [{"type": "function_call_output", "call_id": "c",
                                 "output": "o"}]}, 400, "input"),
    ({"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://x/y.png"}]}]}, 400,
     "input[0].content[0].type"),
    ({"model": MODEL, "input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
    ({"model": MODEL, "input": "x", "text": {"format": {"type": "regex"}}}, 400,
     "text.format.type"),
    ({"model": MODEL, "input": "x", "tools": [{"type": "file_search"}]}, 400, "tools[0].type"),
    ({"model": MODEL, "input": "x", "background": True, "store": False}, 400, "store"),
    ({"model": MODEL, "input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"model": MODEL, "input": "x", "temperature": 2.5}, 400, "temperature"),
    ({"model": MODEL, "input": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, 400,
     "metadata"),
    ({"model": MODEL, "input": "x", "service_tier": "platinum"}, 400, "service_tier"),
    ({"model": MODEL, "input": "x", "conversation": "conv_1"}, 400, "conversation"),
    ({"model": MODEL, "input": "x", "stream": "yes"}, 400, "stream"),
    ({"model": "gpt-404", "input": "x"}, 404, "model"),
    ({"model": MODEL, "input": "x", "previous_response_id": "resp_" + "0" * 24}, 404,
     "previous_response_id"),
    ({"model": MODEL, "input": "x", "previous_response_id": "chatcmpl-1"}, 404,
     "previous_response_id"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_BODIES)
def test_bad_input_is_an_openai_error_naming_the_parameter(env: ApiEnv, body: dict[str, Any],
                                                           status: int, param: str) -> None:
    answer = httpx.post(env.v1 + "/responses", json=body,
                        headers={"Authorization": f"Bearer {env.key}"}, timeout=30)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["message"]
    assert error["type"] == "invalid_request_error"


def test_bad_queries_and_unfinished_previous_responses(client: OpenAI, env: ApiEnv) -> None:
    queued = client.responses.create(model=MODEL, input="wait", background=True)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="x", previous_response_id=queued.id)
    assert refused.value.param == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as bad_limit:
        client.responses.input_items.list(queued.id, limit=0)
    assert bad_limit.value.param == "limit"
    with pytest.raises(openai.BadRequestError) as bad_after:
        client.responses.retrieve(queued.id, stream=True, starting_after=-7)
    assert bad_after.value.param == "starting_after"
    with pytest.raises(openai.NotFoundError) as unknown_item:
        client.responses.input_items.list(queued.id, after="msg_nope")
    assert unknown_item.value.param == "after"
    client.responses.cancel(queued.id)


def test_batch_of_responses_lines(client: OpenAI, site: EchoSite) -> None:
    lines = [{"custom_id": "ok", "method": "POST", "url": "/v1/responses",
              "body": {"model": MODEL, "input": "batch hello", "instructions": "Short."}},
             {"custom_id": "chained", "method": "POST", "url": "/v1/responses",
              "body": {"model": MODEL, "input": "x", "previous_response_id": "resp_1"}}]
    data = "\n".join(json.dumps(line) for line in lines).encode()
    file_id = client.files.create(file=("r.jsonl", io.BytesIO(data)), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/responses",
                                  completion_window="24h")
    done = wait_for(lambda: (lambda b: b if b.status == "completed" else None)(
        client.batches.retrieve(batch.id)))
    assert done.output_file_id is not None and done.error_file_id is not None
    out = list(iter_lines(client.files.content(done.output_file_id).text))
    errors = list(iter_lines(client.files.content(done.error_file_id).text))
    body = out[0]["response"]["body"]
    assert out[0]["custom_id"] == "ok" and body["object"] == "response"
    assert body["output"][0]["content"][0]["text"] == "echo batch hello"
    assert body["status"] == "completed" and body["instructions"] == "Short."
    assert body["usage"]["output_tokens"] == 3
    assert errors[0]["custom_id"] == "chained"
    assert errors[0]["error"]["param"] == "body.previous_response_id"
    # Batch lines are read back through the batch, not as stored responses.
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(body["id"])
