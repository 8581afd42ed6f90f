"""Tools and structured output through `minimill serve`, driven the way agents drive it: the
official openai client (create, stream helpers, parse), LangChain's ChatOpenAI and pydantic-ai,
against the default model. A 135M model may not pick a tool on its own, so `auto` is only held
to what any model must give: a valid answer or a valid call."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serve_process import MODEL, Serve

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                      "parameters": {"type": "object", "properties": {
                                          "zone": {"type": "string", "maxLength": 30}},
                                          "required": ["zone"],
                                          "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Oslo right now?"}]


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int = Field(ge=0)


def _check_call(call: Any) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    schema = next(t["function"]["parameters"] for t in TOOLS
                  if t["function"]["name"] == call.function.name)
    jsonschema.validate(args, schema)
    return args


def test_required_tool_choice_answers_with_a_valid_call(serve: Serve) -> None:
    resp = serve.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=120, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0])
    # The tool definitions are in the prompt.
    bare = serve.client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    assert resp.usage is not None and bare.usage is not None
    assert resp.usage.prompt_tokens > bare.usage.prompt_tokens + 50


def test_a_named_tool_is_called_and_its_result_continues_the_conversation(
        serve: Serve) -> None:
    client = serve.client()
    resp = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    message = resp.choices[0].message
    assert message.tool_calls is not None
    assert [c.function.name for c in message.tool_calls] == ["get_time"]
    _check_call(message.tool_calls[0])
    answered = client.chat.completions.create(
        model=MODEL, tools=TOOLS, max_tokens=24, temperature=0,
        messages=[*ASK, message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                   "content": "14:05 CET"}])
    assert answered.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answered.usage is not None
    assert answered.usage.prompt_tokens > resp.usage.prompt_tokens  # type: ignore[union-attr]


def test_streamed_calls_accumulate_into_the_same_call(serve: Serve) -> None:
    client = serve.client()
    kwargs: dict[str, Any] = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120,
                                  temperature=0, tool_choice="required",
                                  parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs).choices[0].message
    pieces = 0
    with client.chat.completions.stream(**kwargs) as stream:
        for event in stream:
            pieces += event.type == "tool_calls.function.arguments.delta"
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert pieces > 1  # the arguments arrived in pieces
    assert final.message.tool_calls is not None and whole.tool_calls is not None
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls]


def test_auto_gives_a_valid_answer_or_a_valid_call(serve: Serve) -> None:
    for seed in range(3):
        resp = serve.client().chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, seed=seed)
        choice = resp.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                _check_call(call)
        else:
            assert choice.finish_reason in ("stop", "length")
            assert "<tool_call>" not in (choice.message.content or "")


def test_parse_gives_a_pydantic_object_and_json_object_gives_an_object(serve: Serve) -> None:
    client = serve.client()
    parsed = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe a city as JSON."}],
        response_format=City, max_tokens=120, seed=1)
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and city.population >= 0
    loose = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object."}],
        response_format={"type": "json_object"}, max_tokens=150, seed=2)
    assert loose.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(loose.choices[0].message.content or ""), dict)


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"max_tokens": 10**7}, "max_tokens", "too large"),
    ({"max_completion_tokens": 10**7}, "max_completion_tokens", "too large"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "Missing"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", ""),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "Supported values"),
    ({"response_format": {"type": "json_object"}}, "messages", "must contain the word 'json'"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "Unrecognized"),
    ({"store": True}, "store", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema", "Invalid schema"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string", "pattern": "(unclosed"}}}]},
     "tools[0].function.parameters", "Invalid schema"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "hi"}]},
     "messages", "must answer"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(serve: Serve, body: dict[str, Any],
                                                     param: str, says: str) -> None:
    request = {"model": MODEL, "messages": ASK, "max_tokens": 4, **body}
    with pytest.raises(openai.BadRequestError) as info:
        serve.client().chat.completions.create(**request)
    error = info.value.body
    assert isinstance(error, dict)
    assert error.get("param") == param, error
    assert says in str(error.get("message")), error
    assert "JSON object" not in str(error.get("message"))


def test_langchain_binds_tools_and_gets_structured_output(serve: Serve) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(model=MODEL, base_url=serve.base_url, api_key=serve.key,  # type: ignore[arg-type]
                     max_tokens=120, temperature=0, max_retries=0)
    answer = llm.bind_tools([get_weather], tool_choice="required").invoke(
        "What is the weather in Paris?")
    assert answer.tool_calls and answer.tool_calls[0]["name"] == "get_weather"
    assert isinstance(answer.tool_calls[0]["args"]["city"], str)
    assert get_weather.invoke(answer.tool_calls[0]["args"]).startswith("sunny in ")
    city = llm.with_structured_output(City).invoke("Describe a city.")
    assert isinstance(city, City)


def test_pydantic_ai_runs_a_tool_and_returns_a_typed_output(serve: Serve) -> None:
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.tools import ToolDefinition

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=serve.base_url,
                                                           api_key=serve.key))
    calls: list[str] = []
    # The output comes through a tool call (pydantic-ai's default for a typed output), so
    # every step must call a tool: the lookup or the final result.
    agent = Agent(model, output_type=City, retries=3,
                  model_settings={"max_tokens": 150, "temperature": 0,
                                  "parallel_tool_calls": False})

    async def until_used(_ctx: RunContext[None], tool: ToolDefinition) -> ToolDefinition | None:
        return None if calls else tool  # offered until called once: the run then ends

    @agent.tool_plain(prepare=until_used)
    def lookup_country(city: str) -> str:
        """The country a city is in."""
        calls.append(city)
        return "Norway"

    result = agent.run_sync("Describe the city of Oslo.")
    assert isinstance(result.output, City)
    assert len(calls) <= 1 and all(isinstance(c, str) for c in calls)
    assert result.usage().requests <= 1 + len(calls) + 3  # at most the retries' extra steps
