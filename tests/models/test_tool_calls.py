"""Tool-call syntaxes: the grammar a call is enforced with, parsing calls back out of text (whole
and streamed in pieces), and prompts that carry tools through a chat template."""

from __future__ import annotations

import json
import random
from pathlib import Path

import llguidance
import pytest

from minimill.models.gguf_loader import load_gguf
from minimill.models.grammar import (
    GrammarError,
    GuidedDecoding,
    check_grammar,
    parser_limits,
    to_grammar,
)
from minimill.models.prompt import render_chat_prompt, tool_format
from minimill.models.tokenizer import Tokenizer
from minimill.models.tool_calls import (
    HERMES,
    LLAMA3,
    MISTRAL,
    ArgumentsDelta,
    CallStarted,
    ContentDelta,
    ToolCallParser,
    ToolFormat,
    format_of_template,
    parse_message,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]


@pytest.fixture(scope="module")
def tokenizer(model_file: Path) -> Tokenizer:
    import torch

    return load_gguf(model_file, torch.float32).tokenizer


def _streamed(fmt: ToolFormat, text: str, seed: int) -> tuple[bool, str, dict[int, list[str]]]:
    """Feed `text` in random pieces; (malformed?, content, {call: [name, arguments]})."""
    rng = random.Random(seed)
    parser = ToolCallParser(fmt)
    events, i = [], 0
    while i < len(text):
        n = rng.randint(1, 5)
        events += parser.feed(text[i:i + n])
        i += n
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, CallStarted):
            calls[e.index] = [e.name, ""]
        elif isinstance(e, ArgumentsDelta):
            calls[e.index][1] += e.text
    return parser.malformed, content, calls


CASES = [
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Oslo", "unit": "c", "x": [1, {"a": "}\\""}]}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me check.", [("get_weather", '{"city": "Oslo", "unit": "c", "x": [1, {"a": "}\\""}]}'),
                       ("get_time", "{}")]),
    (HERMES, '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>', None,
     [("f", '{"x": 1}')]),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>', None,
     [("f", '{"x": 1}')]),
    (LLAMA3, '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', None,
     [("f", '{"x": 1}'), ("g", "{}")]),
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, '
              '{"name": "g", "arguments": {"y": "]"}}]', None,
     [("f", '{"x": 1}'), ("g", '{"y": "]"}')]),
    (HERMES, "plain text, with < and <tool but no call", "plain text, with < and <tool but no "
     "call", []),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_calls_parse_whole_and_in_any_pieces_alike(fmt: ToolFormat, text: str,
                                                   content: str | None,
                                                   calls: list[tuple[str, str]]) -> None:
    parsed = parse_message(fmt, text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    for call in parsed.calls:
        json.loads(call.arguments)
    for seed in range(8):
        malformed, streamed_content, streamed = _streamed(fmt, text, seed)
        assert not malformed
        assert streamed_content == (content or "")
        assert [tuple(streamed[i]) for i in sorted(streamed)] == calls


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',  # unbalanced
    '<tool_call>\n{"name": "f", "arguments": {"x": 1}}',  # never closed
    '<tool_call>\nnot json at all\n</tool_call>',
    '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
])
def test_a_malformed_call_is_returned_as_text(text: str) -> None:
    parsed = parse_message(HERMES, text)
    assert parsed.calls == []
    assert parsed.content == text


def test_formats_are_read_off_templates() -> None:
    assert format_of_template("{% for t in tools %}<tool_call>{% endfor %}") is HERMES
    assert format_of_template("[AVAILABLE_TOOLS] ... [TOOL_CALLS]") is MISTRAL
    assert format_of_template("<|python_tag|>{{ tools }}") is LLAMA3
    assert format_of_template("<|im_start|>{{ m.content }}") is None
    assert format_of_template(None) is None


def _matcher(tokenizer: Tokenizer, spec: GuidedDecoding) -> llguidance.LLMatcher:
    lltok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                   eos_token=tokenizer.eos_token_id)
    return llguidance.LLMatcher(lltok, to_grammar(spec), log_level=0, limits=parser_limits())


def _accepts(tokenizer: Tokenizer, spec: GuidedDecoding, text: str) -> bool:
    m = _matcher(tokenizer, spec)
    return all(m.consume_token(t) for t in tokenizer.encode(text)) and m.is_accepting()


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL])
def test_each_syntax_grammar_accepts_its_own_calls_and_they_parse_back(
        tokenizer: Tokenizer, fmt: ToolFormat) -> None:
    tags = (fmt.tag("get_weather", json.dumps(WEATHER)), fmt.tag("get_time", None))
    one = tags[0].begin + '{"city": "Oslo", "unit": "c"}' + tags[0].end
    two = tags[1].begin + "{}" + tags[1].end
    required = GuidedDecoding(tags=tags, separator=fmt.separator)
    assert _accepts(tokenizer, required, one + fmt.separator + two)
    assert not _accepts(tokenizer, required, "Sure! " + one)
    assert not _accepts(tokenizer, required, one.replace('"c"', '"k"'))  # enum
    single = GuidedDecoding(tags=tags, parallel_calls=False, separator=fmt.separator)
    assert not _accepts(tokenizer, single, one + fmt.separator + two)
    parsed = parse_message(fmt, one + fmt.separator + two)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"}), ("get_time", {})]


def test_auto_allows_text_and_makes_an_opened_call_well_formed(tokenizer: Tokenizer) -> None:
    tags = (HERMES.tag("get_weather", json.dumps(WEATHER)),)
    call = tags[0].begin + '{"city": "Oslo", "unit": "f"}' + tags[0].end
    auto = GuidedDecoding(tags=tags, trigger=HERMES.trigger)
    assert _accepts(tokenizer, auto, "No call needed, it is sunny.")
    assert _accepts(tokenizer, auto, "Checking. " + call + " One moment.")
    assert not _accepts(tokenizer, auto, 'Checking. <tool_call>\n{"name": "nope"}')
    once = GuidedDecoding(tags=tags, trigger=HERMES.trigger, parallel_calls=False)
    assert not _accepts(tokenizer, once, call + call)


def test_answer_or_calls(tokenizer: Tokenizer) -> None:
    tags = (HERMES.tag("get_time", None),)
    either = GuidedDecoding(json_schema=json.dumps(WEATHER), tags=tags)
    assert _accepts(tokenizer, either, '{"city": "Oslo", "unit": "c"}')
    assert _accepts(tokenizer, either, tags[0].begin + "{}" + tags[0].end)
    assert not _accepts(tokenizer, either, "prose")


@pytest.mark.parametrize("schema", [
    '{"type": "strin"}', '{"type": "string", "pattern": "(a"}', "[1, 2]", "not json"])
def test_schemas_the_grammar_engine_cannot_compile_are_refused(schema: str) -> None:
    with pytest.raises(GrammarError):
        check_grammar(GuidedDecoding(json_schema=schema))


def test_smollm2_gets_the_hermes_tool_prompt_and_plain_chats_are_unchanged(
        tokenizer: Tokenizer) -> None:
    assert tool_format(tokenizer) is HERMES
    user = [{"role": "user", "content": "Weather in Oslo?"}]
    plain = tokenizer.decode(render_chat_prompt(tokenizer, user), skip_special_tokens=False)
    assert plain == tokenizer.apply_chat_template(user)
    assert "<tools>" not in plain
    turn = [*user,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"}]
    text = tokenizer.decode(render_chat_prompt(tokenizer, turn, TOOLS),
                            skip_special_tokens=False)
    signatures = text[text.index("<tools>\n"):text.index("\n</tools>")]
    assert [json.loads(line)["function"]["name"] for line in signatures.splitlines()[1:]] == [
        "get_weather", "get_time"]
    # The earlier call as the model writes one, its result in a user turn, then the answer.
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n-3 C, snow\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_with_its_own_tool_syntax_receives_the_tools(tokenizer: Tokenizer) -> None:
    template = ("{% for t in tools %}TOOL {{ t.function.name }};{% endfor %}"
                "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments.city }}"
                "{% endfor %}{% endfor %}")
    own = Tokenizer(tokenizer.backend, eos_token=tokenizer.eos_token, chat_template=template)
    assert tool_format(own) is HERMES
    turn = [{"role": "user", "content": "Oslo?"},
            {"role": "assistant", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "cold"}]
    text = own.decode(render_chat_prompt(own, turn, TOOLS))
    # Tools reach the template; arguments arrive as an object, as HF templates expect.
    assert text == ("TOOL get_weather;TOOL get_time;[user]Oslo?[assistant]<tool_call>Oslo"
                    "[tool]cold")
