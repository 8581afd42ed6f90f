"""The OpenAI Agents SDK (`OpenAIResponsesModel`) running whole tool loops against the control
plane, with a protocol site that calls tools as a model does (api_harness.EchoSite): the model
calls the tool, the SDK runs it and sends the call and its output back as input items, and the
model answers from the output; streamed and not."""

from __future__ import annotations

import asyncio
from typing import Any

from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from api_harness import MODEL, ApiEnv, EchoSite
from openai import AsyncOpenAI

set_tracing_disabled(True)  # nothing leaves this machine


def test_a_tool_loop_plain_and_streamed(env: ApiEnv, site: EchoSite) -> None:
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"Sunny in {city}."

    async def run() -> tuple[Any, Any, list[str]]:
        async with AsyncOpenAI(base_url=env.v1, api_key=env.key, max_retries=0) as client:
            agent = Agent(name="weather", instructions="Use the tool.", tools=[get_weather],
                          model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                          model_settings=ModelSettings(tool_choice="required"))
            plain = await Runner.run(agent, 'CALL get_weather {"city": "Paris"}')
            streamed = Runner.run_streamed(agent, 'CALL get_weather {"city": "Lima"}')
            kinds = [event.type async for event in streamed.stream_events()]
            return plain, streamed, kinds

    plain, streamed, kinds = asyncio.run(run())
    assert asked == ["Paris", "Lima"]  # each run called the tool once, then answered
    assert plain.final_output == "echo Sunny in Paris."
    assert streamed.final_output == "echo Sunny in Lima."
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    # The second turn sent the call and its output back; the site answered the output.
    second = site.leases_seen[1]["body"]["messages"]
    assert [m["role"] for m in second[-3:]] == ["user", "assistant", "tool"]
    assert second[-1]["content"] == "Sunny in Paris."
