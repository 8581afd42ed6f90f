"""Response stream events are a pure function of the row: the events of an earlier state are a
prefix of those of any later one, so a stream resumed at any sequence number has no gap and no
repeat; and the deltas add up to the answer."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from minimill.control.records import Kind, RequestRecord, RequestStatus, Tier
from minimill.control.response_bodies import ResponseBody, prepare_response
from minimill.control.response_render import render_response, response_events

MODEL = "smollm2-135m"


def row(text: str, status: RequestStatus, finish: str = "stop",
        background: bool = True) -> RequestRecord:
    prepared = prepare_response(ResponseBody(model=MODEL, input="hi", background=background),
                                [MODEL])
    choice = {"index": 0, "text": text, "token_ids": [], "finish_reason": None}
    done = status == RequestStatus.SUCCEEDED
    return RequestRecord(
        id="req_" + "ab" * 12, tenant_id="t", batch_id=None, kind=Kind.RESPONSE,
        tier=Tier.BACKGROUND, model=MODEL, body=prepared.body, status=status, epoch=1,
        version=1, progress=None, checkpoint={"choices": [choice]} if text else None,
        result={"choices": [{**choice, "finish_reason": finish}]} if done else None,
        error={"code": "server_error", "message": "x"} if status == RequestStatus.FAILED
        else None, prompt_tokens=3, completion_tokens=5, billed_usd=0.0, created_at=100.0,
        finished_at=101.0 if done else None)


def deltas(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


texts = st.text(alphabet=st.sampled_from("ab é\n\t" + "x" * 3), max_size=120)


@settings(max_examples=200, deadline=None)
@given(text=texts, cuts=st.lists(st.integers(0, 120), max_size=6),
       end=st.sampled_from([RequestStatus.SUCCEEDED, RequestStatus.FAILED,
                            RequestStatus.CANCELLED]))
def test_earlier_events_are_a_prefix_of_later_ones(text: str, cuts: list[int],
                                                   end: RequestStatus) -> None:
    states = [row(text[:cut], RequestStatus.LEASED) for cut in sorted(c for c in cuts
                                                                       if c <= len(text))]
    states.append(row(text, end))
    lists = [response_events(s) for s in states]
    for earlier, later in itertools.pairwise(lists):
        assert later[:len(earlier)] == earlier
    final = lists[-1]
    assert [e["sequence_number"] for e in final] == list(range(len(final)))
    for start in {0, *cuts}:  # a stream resumed after start - 1 gets the rest, built alike
        assert response_events(states[-1], start) == final[start:]
    if end == RequestStatus.SUCCEEDED or text:
        assert deltas(final) == text
        done = next(e for e in final if e["type"] == "response.output_text.done")
        assert done["text"] == text


def test_event_sequence_of_a_completed_response() -> None:
    events = response_events(row("echo hello world", RequestStatus.SUCCEEDED))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e["delta"] for e in events if "delta" in e] == ["echo", " hello", " world"]
    assert events[0]["response"]["status"] == "queued"  # a background response starts queued
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "echo hello world"


def test_a_growing_piece_is_held_back_until_it_is_whole() -> None:
    assert deltas(response_events(row("echo hel", RequestStatus.LEASED))) == "echo"
    assert deltas(response_events(row("echo hello ", RequestStatus.LEASED))) == "echo hello"
    long_word = "y" * 40
    assert deltas(response_events(row(long_word, RequestStatus.LEASED))) == "y" * 32


def test_status_and_usage_follow_the_row() -> None:
    cut = render_response(row("echo a", RequestStatus.SUCCEEDED, finish="length"))
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["usage"]["total_tokens"] == 8
    failed = render_response(row("", RequestStatus.FAILED))
    assert (failed["status"], failed["error"]["code"], failed["usage"]) == ("failed",
                                                                            "server_error", None)
    running = render_response(row("partial", RequestStatus.LEASED))
    assert running["status"] == "in_progress" and running["output"][0]["status"] == "in_progress"
    queued = render_response(replace(row("", RequestStatus.QUEUED)))
    assert (queued["status"], queued["output"]) == ("queued", [])
    assert response_events(row("", RequestStatus.CANCELLED))[-1]["response"]["status"] \
        == "cancelled"


# ------------------------------------------------------------------------------------------
# Responses with tools: the answer's text in a model's tool syntax becomes a message and calls.

WEATHER = {"type": "function", "name": "get_weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def call_text(city: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n' \
           '</tool_call>'


def tool_row(text: str, status: RequestStatus, finish: str = "stop") -> RequestRecord:
    base = row(text, status, finish)
    body = prepare_response(ResponseBody.model_validate(
        {"model": MODEL, "input": "hi", "tools": [WEATHER], "background": True}), [MODEL]).body

    def with_format(source: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if source is None else {
            "choices": [{**c, "tool_format": "hermes"} for c in source["choices"]]}

    return replace(base, body=body, checkpoint=with_format(base.checkpoint),
                   result=with_format(base.result))


def arguments(events: list[dict[str, Any]], item_id: str) -> str:
    return "".join(e["delta"] for e in events
                   if e["type"] == "response.function_call_arguments.delta"
                   and e["item_id"] == item_id)


TOOL_TEXT = "Let me look.\n" + call_text("Paris") + "\n" + call_text("São Paulo") + "\nDone."


@settings(max_examples=150, deadline=None)
@given(cuts=st.lists(st.integers(0, len(TOOL_TEXT)), max_size=6),
       end=st.sampled_from([RequestStatus.SUCCEEDED, RequestStatus.FAILED]))
def test_tool_call_events_only_grow_and_add_up(cuts: list[int], end: RequestStatus) -> None:
    states = [tool_row(TOOL_TEXT[:cut], RequestStatus.LEASED) for cut in sorted(cuts)]
    states.append(tool_row(TOOL_TEXT, end))
    lists = [response_events(s) for s in states]
    for earlier, later in itertools.pairwise(lists):
        assert later[:len(earlier)] == earlier
    final = lists[-1]
    assert [e["sequence_number"] for e in final] == list(range(len(final)))
    for start in {0, *cuts}:
        assert response_events(states[-1], start) == final[start:]
    output = final[-1]["response"]["output"]
    assert [i["type"] for i in output] == ["message", "function_call", "function_call"]
    assert deltas(final) == output[0]["content"][0]["text"] == "Let me look.\nDone."
    for item in output[1:]:
        assert arguments(final, item["id"]) == item["arguments"]
        assert item["status"] == "completed" and item["call_id"].startswith("call_")
    assert [json.loads(i["arguments"])["city"] for i in output[1:]] == ["Paris", "São Paulo"]


def test_tool_call_event_sequence() -> None:
    text = call_text("Paris")
    events = response_events(tool_row(text, RequestStatus.SUCCEEDED))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    added, done = events[2], events[6]
    assert added["item"] | {"arguments": '{"city": "Paris"}', "status": "completed"} \
        == done["item"]
    assert added["item"]["arguments"] == "" and added["item"]["status"] == "in_progress"
    assert events[5]["arguments"] == '{"city": "Paris"}' and events[5]["name"] == "get_weather"
    assert {e.get("output_index") for e in events[2:7]} == {0}
    response = events[-1]["response"]
    assert response["output"] == [done["item"]]
    assert response["tools"][0]["name"] == "get_weather" and response["tool_choice"] == "auto"
    # A call is done as soon as its JSON is whole, before the response ends.
    running = response_events(tool_row(text[:-len("\n</tool_call>")], RequestStatus.LEASED))
    assert running[-1]["type"] == "response.output_item.done"


def test_a_call_cut_short_is_an_incomplete_item() -> None:
    cut = ("Hi " + call_text("Paris"))[:60]
    final = response_events(tool_row(cut, RequestStatus.SUCCEEDED, finish="length"))
    response = final[-1]["response"]
    assert (final[-1]["type"], response["status"]) == ("response.incomplete", "incomplete")
    assert [(i["type"], i["status"]) for i in response["output"]] == [
        ("message", "incomplete"), ("function_call", "incomplete")]
    assert "response.function_call_arguments.done" not in [e["type"] for e in final]
