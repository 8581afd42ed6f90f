"""The usage check's rules on their own (pure functions): what a completion is billed from the
control plane's counts, and which reports are refused. The model's real tokenizer counts."""

from __future__ import annotations

from typing import Any

import pytest

from minimill.control.prompt_count import ModelCounter, count_prompts, counter_for
from minimill.control.records import Kind
from minimill.control.usage_check import TEXT_SLACK_TOKENS, Admitted, check
from minimill.transport.protocol import ChoiceProgress, CompletionItem, Usage

MODEL = "smollm2-135m"


def item(*choices: ChoiceProgress, **usage: int) -> CompletionItem:
    return CompletionItem(request_id="r", epoch=1, outcome="succeeded", choices=list(choices),
                          usage=Usage(**usage) if usage else None)


def ids(n: int, index: int = 0, text: str = "") -> ChoiceProgress:
    return ChoiceProgress(index=index, token_ids=list(range(n)), text=text,
                          finish_reason="length")


ADMITTED = Admitted(prompt_tokens=40, prompt_exact=True, num_choices=1, max_tokens=16)


def test_the_bill_is_the_counts_whatever_the_report_says() -> None:
    counter = counter_for(MODEL)
    verdict = check(item(ids(5), prompt_tokens=9999, completion_tokens=5, cached_tokens=9999),
                    ADMITTED, counter)
    assert (verdict.refused, verdict.prompt_tokens, verdict.completion_tokens,
            verdict.cached_tokens) == (None, 40, 5, 40)
    # Fewer reported than returned: billed what was returned.
    assert check(item(ids(5), prompt_tokens=1, completion_tokens=1), ADMITTED,
                 counter).completion_tokens == 5


@pytest.mark.parametrize(("choices", "usage"), [
    ([ids(5)], {"prompt_tokens": 1, "completion_tokens": 6}),  # more than the ids
    ([ids(40)], {"prompt_tokens": 1, "completion_tokens": 40}),  # past max_tokens
    ([ids(2), ids(2, 1)], {"prompt_tokens": 1, "completion_tokens": 4}),  # n is 1
    ([ids(2, 3)], {"prompt_tokens": 1, "completion_tokens": 2}),  # no such choice
])
def test_a_report_that_disagrees_is_refused(choices: list[ChoiceProgress],
                                            usage: dict[str, Any]) -> None:
    verdict = check(item(*choices, **usage), ADMITTED, counter_for(MODEL))
    assert verdict.refused


def test_text_only_choices_are_counted_from_their_text_with_some_slack() -> None:
    counter = counter_for(MODEL)
    text = "The quick brown fox jumps over the lazy dog."
    tokens = counter.count_texts([text])[0]
    roomy = Admitted(prompt_tokens=40, prompt_exact=True, num_choices=1, max_tokens=None)
    # An engine that hands out text counts its end token, a stop string: a little over is
    # fine, and billed as counted.
    near = check(item(ChoiceProgress(index=0, text=text), prompt_tokens=1,
                      completion_tokens=tokens + 2), roomy, counter)
    assert near.refused is None and near.completion_tokens == tokens
    far = check(item(ChoiceProgress(index=0, text=text), prompt_tokens=1,
                     completion_tokens=tokens + TEXT_SLACK_TOKENS + tokens), roomy, counter)
    assert far.refused


def test_ids_that_cover_part_of_the_text_are_not_refused() -> None:
    """A builtin site resumed a checkpoint another engine wrote as text: its ids cover only
    what it generated, its report counts the whole choice."""
    counter = counter_for(MODEL)
    resumed = "Once upon a time there was a little mill by a river."
    tokens = counter.count_texts([resumed + " and"])[0]
    roomy = Admitted(prompt_tokens=40, prompt_exact=True, num_choices=1, max_tokens=None)
    verdict = check(item(ids(1, text=resumed + " and"), prompt_tokens=1,
                         completion_tokens=tokens), roomy, counter)
    assert verdict.refused is None and verdict.completion_tokens == tokens


def test_a_model_without_a_tokenizer_is_billed_within_bounds() -> None:
    bounded = counter_for("no-such-model-anywhere")
    assert bounded == ModelCounter("no-such-model-anywhere", None, None)
    (count,) = count_prompts([(Kind.CHAT, "no-such-model-anywhere",
                               {"messages": [{"role": "user", "content": "héllo"}]})])
    assert not count.exact and count.tokens == len("héllo".encode()) + len("user") + 8 + 64
    admitted = Admitted(prompt_tokens=count.tokens, prompt_exact=False, num_choices=1,
                        max_tokens=None)
    verdict = check(item(ChoiceProgress(index=0, text="abc"), prompt_tokens=10**6,
                         completion_tokens=2), admitted, bounded)
    # The report, within the bounds: the prompt's bytes, the text's bytes.
    assert (verdict.refused, verdict.prompt_tokens, verdict.completion_tokens) == (
        None, count.tokens, 2)
    assert check(item(ChoiceProgress(index=0, text="abc"), prompt_tokens=1,
                      completion_tokens=10**6), admitted, bounded).refused
