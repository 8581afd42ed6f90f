"""What a completion is billed, from the control plane's own counts, and whether the site's
report of it is believable. Pure: no store, no clock (leases.complete reads the counts made at
admission and applies the verdicts).

- Prompt tokens are the count made at admission (prompt_count.py); the site's report never
  changes them. For a model without a tokenizer here that count is an upper bound, and the
  report is taken up to it.
- Completion tokens are counted from what the site returns: each choice's token ids, or, for a
  choice that carries only text (a site whose engine hands out text), the tokens of that text.
  Each choice is capped by `max_tokens` (or, without one, by the context left after the prompt).
- Cached tokens are the site's report, never more than the prompt.
- An embedding request generates nothing: its result holds one vector per input, all of one
  size, finite (embeddings.check_vectors), and no tokens, so its completion count is 0.

The report is checked against those counts: more choices than the request asked for, or more
completion tokens than the choices could hold, is a report that disagrees; the completion is
rejected (the caller requeues the request and counts the rejection against the site). A
choice known only by its text is allowed some difference (an engine counts tokens it does not
hand out as text, an end-of-sequence token or a stop string; a retokenized text need not have
the engine's segmentation), which only decides rejection: the bill is the count.
"""

from __future__ import annotations

from dataclasses import dataclass

from minimill.control.embeddings import check_vectors
from minimill.control.prompt_count import ModelCounter
from minimill.transport.protocol import ChoiceProgress, CompletionItem

# A choice counted from its text may be reported this many tokens over the count, plus a
# quarter of it, before the report is taken for inflated.
TEXT_SLACK_TOKENS = 8
MAX_COUNT = 2**31 - 1


@dataclass(frozen=True, slots=True)
class Admitted:
    """What the control plane recorded of a request when it came in."""

    prompt_tokens: int | None  # counted (or bounded) at admission; None: before counts existed
    prompt_exact: bool
    num_choices: int | None  # choices a worker must return; None: before counts existed
    max_tokens: int | None  # per choice; None: up to the context
    embedding: bool = False  # an embedding request: one vector per choice, nothing generated


@dataclass(frozen=True, slots=True)
class Verdict:
    """The usage to bill, or why the report is refused."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    refused: str | None = None  # a protocol error's message: the completion is rejected


def _clamp(value: int) -> int:
    return min(max(value, 0), MAX_COUNT)


def _choice_counts(choices: list[ChoiceProgress], counter: ModelCounter,
                   by_text: bool) -> list[tuple[int, int]]:
    """(count, slack) per choice: its token ids, or (with `by_text`, or when it has none) the
    tokens of its text where that is more: the ids may cover only the part generated here,
    after a resume from a checkpoint another engine wrote as text."""
    need_text = [c.text for c in choices if by_text or not c.token_ids]
    counted = iter(counter.count_texts(need_text))
    out = []
    for choice in choices:
        ids = len(choice.token_ids)
        if not (by_text or not choice.token_ids):
            out.append((ids, 0))
            continue
        text = next(counted)
        out.append((ids, 0) if text <= ids
                   else (text, TEXT_SLACK_TOKENS + text // 4))
    return out


def check(item: CompletionItem, admitted: Admitted, counter: ModelCounter) -> Verdict:
    """The usage to bill for a succeeded completion, or a refusal (see the module doc)."""
    choices = item.choices
    indexes = [c.index for c in choices]
    if admitted.num_choices is not None and sorted(indexes) != list(
            range(admitted.num_choices)):
        return Verdict(refused=f"the result has choices {sorted(indexes)[:8]}; the request "
                              f"asked for {admitted.num_choices}")
    unusable = (check_vectors(choices) if admitted.embedding
                else "the result carries embeddings" if any(c.embedding is not None
                                                            for c in choices) else None)
    if unusable is not None:
        return Verdict(refused=unusable)
    prompt = admitted.prompt_tokens
    cap = admitted.max_tokens
    if cap is None and counter.context_len is not None and prompt is not None \
            and admitted.prompt_exact:
        cap = max(counter.context_len - prompt, 1)
    reported_prompt = _clamp(item.usage.prompt_tokens) if item.usage else 0
    if prompt is None:  # admitted before counts were kept: the report, as before
        prompt = reported_prompt
    elif not admitted.prompt_exact:
        prompt = min(reported_prompt, prompt)

    def capped(n: int) -> int:
        return n if cap is None else min(n, cap)

    counts = _choice_counts(choices, counter, by_text=False)
    reported = _clamp(item.usage.completion_tokens) if item.usage else \
        sum(capped(n) for n, _ in counts)
    if reported > sum(capped(n + slack) for n, slack in counts):
        # Perhaps ids that do not cover the whole text (a resume across engines).
        counts = _choice_counts(choices, counter, by_text=True)
        allowed = sum(capped(n + slack) for n, slack in counts)
        if reported > allowed:
            return Verdict(refused=f"the usage reports {reported} completion tokens; the "
                                   f"{len(choices)} choices returned hold at most {allowed}")
    completion = sum(capped(n) for n, _ in counts)
    if not counter.exact:  # text bytes bound the tokens: within them, the report
        completion = min(reported, completion)
    cached = min(_clamp(item.usage.cached_tokens) if item.usage else 0, prompt)
    return Verdict(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)
