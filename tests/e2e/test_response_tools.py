"""Agents' interface on a real `minimill serve` (the default model, its engine enforcing the
grammar): Responses function calls (answered through previous_response_id, streamed, in the
background), `responses.parse` with a pydantic model, the OpenAI Agents SDK running a tool turn
and a structured-output turn, a batch line with tools, and a harness's ctx.chat with tools."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel, Field
from serve_process import MODEL, Serve, Worker, free_port, read_jsonl

from minimill.client.agents import Agents
from webhook_receiver import WebhookReceiver

pytestmark = pytest.mark.slow

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
        "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": CITY, "strict": True}
ASK = "What is the weather in Paris? Call the get_weather tool."
SHORT: dict[str, Any] = {"max_output_tokens": 48, "temperature": 0}


def calls_of(response: Any) -> list[Any]:
    return [item for item in response.output if item.type == "function_call"]


def finished(serve: Serve, response_id: str, timeout: float = 300.0) -> Any:
    client = serve.client()
    deadline = time.time() + timeout
    while time.time() < deadline:
        current = client.responses.retrieve(response_id)
        if current.status not in ("queued", "in_progress"):
            return current
        time.sleep(0.2)
    raise TimeoutError(f"{response_id} did not finish in {timeout}s")


def test_a_required_call_answered_through_previous_response_id(serve: Serve) -> None:
    client = serve.client()
    first = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False, **SHORT)
    assert first.status == "completed", first
    [call] = calls_of(first)
    jsonschema.validate(json.loads(call.arguments), CITY)
    assert call.name == "get_weather" and call.status == "completed"
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "Sunny, 21 degrees."}], max_output_tokens=12, temperature=0)
    assert second.status in ("completed", "incomplete") and second.output_text
    assert calls_of(second) == []  # tool_choice none: the model answers in text


def test_auto_gives_an_answer_or_valid_calls(serve: Serve) -> None:
    r = serve.client().responses.create(model=MODEL, input=ASK, tools=[WEATHER],
                                        max_output_tokens=32, temperature=0)
    assert r.status in ("completed", "incomplete"), r
    for call in calls_of(r):
        assert call.name == "get_weather"
        if call.status == "completed":
            jsonschema.validate(json.loads(call.arguments), CITY)
    assert calls_of(r) or [item.type for item in r.output] == ["message"]


def test_streamed_named_call_matches_the_final_response(serve: Serve) -> None:
    client = serve.client()
    with client.responses.stream(model=MODEL, input=ASK, tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 **SHORT) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    [call] = calls_of(final)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments
    jsonschema.validate(json.loads(call.arguments), CITY)
    types = [e.type for e in events]
    assert types.index("response.function_call_arguments.done") \
        < types.index("response.output_item.done") < types.index("response.completed")
    # The helper parsed the strict tool's arguments; read back, the call is the same item.
    assert call.parsed_arguments == json.loads(call.arguments)
    stored = client.responses.retrieve(final.id).output[0].model_dump()
    assert stored == call.model_dump(exclude={"parsed_arguments"})


def test_background_response_with_tools_and_its_webhook(serve: Serve) -> None:
    client = serve.client()
    port = free_port()
    endpoint = client.webhooks.create(name="tools", url=f"http://127.0.0.1:{port}/hook",
                                      event_types=["response.completed"])
    receiver = WebhookReceiver(port, {"/hook": endpoint.signing_secret}).start()
    try:
        created = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER],
                                          tool_choice="required", parallel_tool_calls=False,
                                          background=True, **SHORT)
        done = finished(serve, created.id)
        assert done.status == "completed" and done.service_tier == "flex"
        [call] = calls_of(done)
        jsonschema.validate(json.loads(call.arguments), CITY)
        deadline = time.time() + 60
        while ("response.completed", created.id) not in receiver.events("/hook"):
            assert time.time() < deadline, receiver.deliveries
            time.sleep(0.2)
    finally:
        receiver.stop()
        client.webhooks.delete(endpoint.id)


class City(BaseModel):
    name: str = Field(max_length=24)
    population: int = Field(ge=0, le=100_000_000)
    capital: bool


def test_parse_with_a_pydantic_text_format(serve: Serve) -> None:
    parsed = serve.client().responses.parse(model=MODEL, input="Describe Paris as JSON.",
                                            text_format=City, max_output_tokens=64,
                                            temperature=0)
    assert parsed.status == "completed", parsed
    assert isinstance(parsed.output_parsed, City)
    assert parsed.text.format.type == "json_schema"


def test_openai_agents_sdk_tool_turn_and_structured_turn(serve: Serve) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"Sunny in {city}."

    async def run() -> tuple[Any, Any]:
        async with AsyncOpenAI(base_url=serve.base_url, api_key=serve.key,
                               max_retries=0) as client:
            model = OpenAIResponsesModel(model=MODEL, openai_client=client)
            caller = Agent(name="weather", instructions="Answer with the tool.",
                           tools=[get_weather], model=model,
                           tool_use_behavior="stop_on_first_tool",
                           model_settings=ModelSettings(tool_choice="required",
                                                        parallel_tool_calls=False,
                                                        max_tokens=48, temperature=0))
            tool_turn = await Runner.run(caller, "What is the weather in Paris?")
            describer = Agent(name="city", instructions="Describe the city.", model=model,
                              output_type=City,
                              model_settings=ModelSettings(max_tokens=64, temperature=0))
            return tool_turn, await Runner.run(describer, "Paris")

    tool_turn, structured = asyncio.run(run())
    assert len(asked) == 1  # the tool ran, once
    assert tool_turn.final_output == f"Sunny in {asked[0]}."
    assert isinstance(structured.final_output, City)


def test_batch_line_with_a_tool_call(serve: Serve, tmp_path: Path) -> None:
    tool = {"type": "function", "function": {k: WEATHER[k] for k in (
        "name", "description", "parameters", "strict")}}
    line = {"custom_id": "call", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": ASK}],
                     "tools": [tool], "tool_choice": "required", "parallel_tool_calls": False,
                     "max_tokens": 48, "temperature": 0}}
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(line) + "\n")
    client = serve.client()
    file_id = client.files.create(file=path.open("rb"), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    deadline = time.time() + 300
    while (done := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.time() < deadline, done
        time.sleep(0.5)
    assert done.status == "completed" and done.output_file_id, done
    [out] = read_jsonl(client.files.content(done.output_file_id).read())
    choice = out["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)


HARNESS = '''
async def main(ctx, task):
    answer = await ctx.chat(task["ask"], tools=task["tools"], tool_choice="required",
                            parallel_tool_calls=False, max_tokens=48)
    return {"text": str(answer), "calls": answer.tool_calls,
            "finish_reason": answer.finish_reason}
'''


def test_harness_chat_with_tools(serve: Serve, tmp_path: Path) -> None:
    harness = tmp_path / "tools_harness.py"
    harness.write_text(HARNESS)
    token = serve.cli("sites", "create", "runner-tools",
                      "--serves", "agents").stdout.strip().split()[-1]
    runner = Worker(serve.home, serve.base_url.removesuffix("/v1"), "runner-tools", token,
                    engine="none", extra_args=("--agents", "1")).start_and_wait()
    tool = {"type": "function", "function": {k: WEATHER[k] for k in (
        "name", "description", "parameters", "strict")}}
    try:
        with Agents(serve.base_url, serve.key) as agents:
            agent_id = agents.run(harness, {"ask": ASK, "tools": [tool]})
            agent = agents.wait(agent_id, timeout_s=300)
            assert agent["status"] == "succeeded", agent
            result = agent["result"]
            assert result["finish_reason"] == "tool_calls"
            [call] = result["calls"]
            assert call["function"]["name"] == "get_weather"
            jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)
            [entry] = [e for e in agents.journal(agent_id) if e["kind"] == "chat"]
            assert entry["value"]["tool_calls"] == result["calls"]  # journaled as answered
    finally:
        runner.stop()
