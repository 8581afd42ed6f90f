"""Function tools and text formats on the Responses API, through the official openai client,
with a protocol site that writes tool calls as a model does (api_harness.EchoSite): calls as
output items, their outputs answered inline and through previous_response_id, streamed call
events resumed without gap or repeat, background responses with tools and their webhook,
`/v1/responses` and `/v1/chat/completions` batch lines with tools, and every refusal."""

from __future__ import annotations

import contextlib
import io
import json
import socket
from typing import Any

import httpx
import openai
import pytest
from api_harness import MODEL, ApiEnv, EchoSite, iter_lines, wait_for
from openai import OpenAI

from webhook_receiver import WebhookReceiver

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False},
           "strict": True}
ASK = 'Checking. CALL get_weather {"city": "Paris"}'


def request_id(response_id: str) -> str:
    return "req_" + response_id.removeprefix("resp_")


def lease_body(site: EchoSite, response_id: str) -> dict[str, Any]:
    return next(lease["body"] for lease in site.leases_seen
                if lease["request_id"] == request_id(response_id))


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def poll(client: OpenAI, response_id: str) -> Any:
    return wait_for(lambda: (lambda r: r if r.status not in ("queued", "in_progress")
                             else None)(client.responses.retrieve(response_id)))


def test_a_call_then_its_output_through_previous_response_id(client: OpenAI,
                                                            site: EchoSite) -> None:
    first = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False)
    assert [item.type for item in first.output] == ["message", "function_call"]
    assert first.output_text == "echo Checking."  # message items only
    call = first.output[1]
    assert call.type == "function_call" and call.status == "completed"
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert call.id is not None and call.id.startswith("fc_")
    assert call.call_id.startswith("call_")
    assert first.tool_choice == "required" and first.parallel_tool_calls is False
    assert first.tools[0].type == "function" and first.tools[0].name == "get_weather"
    # The worker ran a chat with the tools in the chat shape.
    body = lease_body(site, first.id)
    assert body["tools"] == [{"type": "function", "function": {
        k: WEATHER[k] for k in ("name", "description", "parameters", "strict")}}]
    assert (body["tool_choice"], body["parallel_tool_calls"]) == ("required", False)
    # Read back, the call is the same item.
    again = client.responses.retrieve(first.id)
    assert again.output[1].model_dump() == call.model_dump()

    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert second.output_text == "echo sunny" and second.status == "completed"
    assert lease_body(site, second.id)["messages"] == [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "echo Checking.", "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    items = client.responses.input_items.list(second.id).data
    assert [(i.type, getattr(i, "call_id", None)) for i in items] == [
        ("function_call_output", call.call_id)]

    # A turn that does not answer the call, or answers a call never made, is refused.
    with pytest.raises(openai.BadRequestError) as unanswered:
        client.responses.create(model=MODEL, previous_response_id=first.id, input="and?")
    assert unanswered.value.param == "input"
    assert f"No tool output found for function call {call.call_id}" in unanswered.value.message
    with pytest.raises(openai.BadRequestError) as orphan:
        client.responses.create(model=MODEL, previous_response_id=first.id, input=[
            {"type": "function_call_output", "call_id": "call_nope", "output": "x"}])
    assert orphan.value.param == "input"
    assert "No tool call found for function call output with call_id call_nope" \
        in orphan.value.message


def test_calls_and_outputs_inline(client: OpenAI, site: EchoSite) -> None:
    r = client.responses.create(model=MODEL, tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"type": "message", "role": "assistant", "content": "Looking."},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "sun"}]}])
    assert r.output_text == "echo sun"
    assert lease_body(site, r.id)["messages"][1:] == [
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "content": "sun"}]
    items = client.responses.input_items.list(r.id, order="asc").data
    assert [i.type for i in items] == ["message", "message", "function_call", "function_call",
                                       "function_call_output", "function_call_output"]
    assert items[2].id.startswith("fc_") and items[4].id.startswith("fco_")
    assert items[5].output[0].text == "sun"  # type: ignore[union-attr]


def _types(events: list[Any]) -> list[str]:
    return [e.type for e in events]


def test_streamed_calls_in_order_and_resumed_without_gap_or_repeat(client: OpenAI,
                                                                  env: ApiEnv) -> None:
    ask = 'Two. CALL get_weather {"city": "Paris"} CALL get_weather {"city": "Lima"}'
    with EchoSite(env.base_url, env.site_token, token_delay_s=0.02):
        with client.responses.stream(model=MODEL, input=ask, tools=[WEATHER]) as stream:
            events = list(stream)
            final = stream.get_final_response()
        assert [e.sequence_number for e in events] == list(range(len(events)))
        call_events = ["response.output_item.added", "response.function_call_arguments.delta",
                       "response.function_call_arguments.done", "response.output_item.done"]
        squeezed = [t for i, t in enumerate(_types(events))
                    if i == 0 or t != _types(events)[i - 1]]
        assert squeezed == ["response.created", "response.in_progress",
                            "response.output_item.added", "response.content_part.added",
                            "response.output_text.delta", *call_events, *call_events,
                            "response.output_text.done", "response.content_part.done",
                            "response.output_item.done", "response.completed"]
        calls = [item for item in final.output if item.type == "function_call"]
        for call in calls:
            deltas = [e for e in events if e.type == "response.function_call_arguments.delta"
                      and e.item_id == call.id]
            assert len(deltas) >= 2  # arguments arrive in pieces
            assert "".join(e.delta for e in deltas) == call.arguments
            assert {e.output_index for e in deltas} == {final.output.index(call)}
        assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Lima"]
        assert final.output_text == "echo Two."

        # Background and streamed: the client drops its connection inside the calls and
        # resumes after its last sequence number.
        stream_b = client.responses.create(model=MODEL, input=ask, tools=[WEATHER],
                                           background=True, stream=True)
        first = []
        for event in stream_b:
            first.append(event)
            if event.type == "response.function_call_arguments.delta":
                break
        stream_b.close()
        response_id = first[0].response.id
        rest = list(client.responses.retrieve(response_id, stream=True,
                                              starting_after=first[-1].sequence_number))
    resumed = first + rest
    assert [e.sequence_number for e in resumed] == list(range(len(resumed)))
    assert _types(resumed) == _types(events)
    done = [e.item for e in resumed if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["function_call", "function_call", "message"]
    assert resumed[-1].response.output[1].model_dump() == done[0].model_dump()


def test_a_call_cut_by_max_output_tokens_is_incomplete(client: OpenAI, site: EchoSite) -> None:
    r = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], max_output_tokens=18)
    assert r.status == "incomplete"
    assert [(i.type, i.status) for i in r.output] == [("message", "incomplete"),
                                                      ("function_call", "incomplete")]
    with pytest.raises(openai.BadRequestError):  # a cut call cannot be answered
        client.responses.create(model=MODEL, previous_response_id=r.id, input=[
            {"type": "function_call_output", "call_id": r.output[1].call_id,  # type: ignore
             "output": "x"}])


def test_background_response_with_tools_and_its_webhook(client: OpenAI, env: ApiEnv,
                                                        site: EchoSite) -> None:
    port = free_port()
    endpoint = client.webhooks.create(name="tools", url=f"http://127.0.0.1:{port}/hook",
                                      event_types=["response.completed"])
    receiver = WebhookReceiver(port, {"/hook": endpoint.signing_secret}).start()
    try:
        created = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          background=True)
        assert created.status in ("queued", "in_progress") and created.output == []
        done = poll(client, created.id)
        assert done.status == "completed" and done.service_tier == "flex"
        assert [i.type for i in done.output] == ["message", "function_call"]
        assert lease_body(site, created.id)["tool_choice"] == {
            "type": "function", "function": {"name": "get_weather"}}
        wait_for(lambda: ("response.completed", created.id) in receiver.events("/hook"))
    finally:
        receiver.stop()
        client.webhooks.delete(endpoint.id)


def test_text_format_becomes_the_chat_response_format(client: OpenAI, site: EchoSite) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="x", text={"format": {
        "type": "json_schema", "name": "count", "schema": schema, "strict": True}})
    assert lease_body(site, r.id)["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "count", "strict": True,
                                               "schema": schema}}
    assert r.text.format.type == "json_schema"
    assert r.text.format.schema_ == schema  # type: ignore[union-attr]
    plain = client.responses.create(model=MODEL, input="y as JSON",
                                    text={"format": {"type": "json_object"}})
    assert lease_body(site, plain.id)["response_format"] == {"type": "json_object"}
    # As OpenAI: json_object output only for a conversation that asks for JSON in words.
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="y", text={"format": {"type": "json_object"}})
    assert info.value.body["param"] == "input"  # type: ignore[index]
    assert "tools" not in lease_body(site, plain.id)


def test_batch_lines_with_tools(client: OpenAI, site: EchoSite) -> None:
    def run(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        line = {"custom_id": "t", "method": "POST", "url": endpoint, "body": body}
        file_id = client.files.create(file=("t.jsonl", io.BytesIO(json.dumps(line).encode())),
                                      purpose="batch").id
        batch = client.batches.create(input_file_id=file_id, endpoint=endpoint,  # type: ignore
                                      completion_window="24h")
        done = wait_for(lambda: (lambda b: b if b.status == "completed" else None)(
            client.batches.retrieve(batch.id)))
        assert done.output_file_id is not None, done
        return next(iter_lines(client.files.content(done.output_file_id).text))

    response = run("/v1/responses", {"model": MODEL, "input": ASK, "tools": [WEATHER],
                                     "instructions": "Answer in JSON.",
                                     "tool_choice": "required",
                                     "text": {"format": {"type": "json_object"}}})["response"]
    body = response["body"]
    assert [i["type"] for i in body["output"]] == ["message", "function_call"]
    assert body["text"]["format"] == {"type": "json_object"}
    chat_tool = {"type": "function", "function": {
        k: WEATHER[k] for k in ("name", "description", "parameters", "strict")}}
    chat = run("/v1/chat/completions", {"model": MODEL, "tools": [chat_tool],
                                        "tool_choice": "required",
                                        "messages": [{"role": "user", "content": ASK}]})
    choice = chat["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris"}


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
TOOL_USE = [{"role": "user", "content": "x"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]
BAD_BODIES: list[tuple[dict[str, Any], str]] = [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER, {"type": "code_interpreter", "container": {"type": "auto"}}]},
     "tools[1].type"),
    ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0].type"),
    ({"tools": [{"type": "custom", "name": "x"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"tools": [{**WEATHER, "parameters": BAD_SCHEMA}]}, "tools[0].parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "mcp", "server_label": "x"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                          "tools": []}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}},
     "text.format.schema"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_tool_calls": 1}, "max_tool_calls"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    ({"context_management": [{"type": "compaction"}]}, "context_management"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [*TOOL_USE, {"type": "function_call_output", "call_id": "c1",
                            "output": [{"type": "input_image", "image_url": "x"}]}]},
     "input[2].output[0].type"),
    ({"input": TOOL_USE}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "o"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f"}]},
     "input[0].arguments"),
]


@pytest.mark.parametrize(("extra", "param"), BAD_BODIES)
def test_what_is_not_honoured_is_refused_naming_it(env: ApiEnv, extra: dict[str, Any],
                                                   param: str) -> None:
    body = {"model": MODEL, "input": "x", **extra}
    answer = httpx.post(env.v1 + "/responses", json=body,
                        headers={"Authorization": f"Bearer {env.key}"}, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["message"], error
    assert error["type"] == "invalid_request_error"
