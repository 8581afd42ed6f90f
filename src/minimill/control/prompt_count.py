"""The control plane's own token counts: what a tenant is billed for a prompt, and the counter a
completion's reported usage is checked with (usage_check.py).

A request's prompt is counted by the control plane with the served model's tokenizer and chat
template, exactly as a builtin worker renders it, so that no site can change what the prompt
costs: a realtime call or a response when it is admitted; a batch's lines by the batch jobs once
they are queued (`count_uncounted`: 200 us or so a line would make ingest several times
slower, and lines need not wait for it), or, for a line completed before that, at its
completion, before the write transaction opens. Each model's tokenizer is loaded once per
process from its files (a GGUF file's vocabulary, or tokenizer.json): no weights, no torch.

A model the control plane cannot tokenize (its files are not on this machine, say: workers
serve it through another engine) is still served, with bounds instead of counts: a prompt is
billed at most its text's UTF-8 bytes (no byte-level tokenizer makes more tokens than bytes)
plus a few tokens per message for the template, and a completion at most its text's bytes; the
site's report is taken within those bounds. The control plane logs a warning for such a model.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, bindparam, select, update

from minimill.control.body_rules import PreparedBody
from minimill.control.embeddings import embedding_inputs
from minimill.control.records import Kind
from minimill.control.store import Store
from minimill.control.tables import requests
from minimill.models.prompt import render_chat_prompt
from minimill.models.tokenizer import Tokenizer
from minimill.models.types import ModelError

log = logging.getLogger("minimill.usage")
# Without a tokenizer, what a chat template may add: per message (role markers) and in all (a
# default system prompt).
TEMPLATE_TOKENS_PER_MESSAGE = 8
TEMPLATE_TOKENS = 64


@dataclass(frozen=True, slots=True)
class ModelCounter:
    """Counts tokens of one model's texts; without a tokenizer, bounds them by bytes."""

    model: str
    tokenizer: Tokenizer | None
    context_len: int | None  # the model's context length (None: unknown)

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def count_texts(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[int]:
        """Tokens of each text (without a tokenizer: its UTF-8 bytes, an upper bound)."""
        if not texts:
            return []
        if self.tokenizer is None:
            return [len(t.encode("utf-8", "surrogatepass")) + int(add_special_tokens)
                    for t in texts]
        # One call for many texts: the tokenizers library spreads them over the cores.
        return [len(e) for e in self.tokenizer.backend.encode_batch(
            list(texts), add_special_tokens=add_special_tokens)]


@functools.lru_cache(maxsize=64)
def counter_for(model: str) -> ModelCounter:
    """The counter of a served model, its tokenizer loaded once per process."""
    from minimill.models.registry import resolve_model
    from minimill.models.tokenizer_files import load_tokenizer

    try:
        tokenizer, context_len = load_tokenizer(resolve_model(model))
    except (ModelError, OSError, ValueError) as exc:
        log.warning("model %s: no tokenizer here (%s): its prompts and completions are billed "
                    "within byte bounds, not counted", model, exc)
        return ModelCounter(model, None, None)
    return ModelCounter(model, tokenizer, context_len)


@dataclass(frozen=True, slots=True)
class PromptCount:
    """What the control plane counted of a request's prompt."""

    tokens: int | None  # prompt tokens, counted (exact) or bounded from above; None: not yet
    exact: bool | None
    choices: int  # choices a worker must return: n, times the prompts of a completion

    @classmethod
    def later(cls, choices: int) -> PromptCount:
        """A row whose prompt is counted after it is queued (a batch line)."""
        return cls(None, None, choices)

    def columns(self) -> dict[str, Any]:
        """The request row's values for it."""
        return {"counted_prompt_tokens": self.tokens, "prompt_count_exact": self.exact,
                "num_choices": self.choices}


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # text parts, as the worker flattens them
        return "".join(str(p.get("text", "")) for p in content
                       if isinstance(p, dict) and p.get("type", "text") == "text")
    return "" if content is None else str(content)


def chat_prompt_tokens(tokenizer: Tokenizer, body: dict[str, Any]) -> int:
    """The tokens of a chat body's prompt, rendered as the builtin worker renders it (its
    messages and tools through the model's chat template: models/prompt.py)."""
    return len(render_chat_prompt(tokenizer, body.get("messages") or [], body.get("tools")))


def _prompts(body: dict[str, Any]) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    if isinstance(prompt, list):
        return [p for p in prompt if isinstance(p, str | list)]
    return []


def num_choices(kind: Kind, body: dict[str, Any]) -> int:
    """Choices a worker must return for a body: n, times the prompts of a completion; one
    vector per input of an embedding request."""
    if kind == Kind.EMBEDDING:
        return max(len(embedding_inputs(body.get("input"))), 1)
    n = body.get("n")
    prompts = len(_prompts(body)) if kind == Kind.COMPLETION else 1
    return (n if isinstance(n, int) and n > 0 else 1) * max(prompts, 1)


# What a count needs of a request: its kind, its model and its (prepared) body.
Prompted = tuple[Kind, str, dict[str, Any]]


def of_prepared(prepared: PreparedBody) -> Prompted:
    return prepared.kind, prepared.model, prepared.body


def count_prompts(bodies: Sequence[Prompted]) -> list[PromptCount]:
    """The control plane's count of each body's prompt (the completion prompts of each model
    are encoded in one call)."""
    counts: list[PromptCount] = []
    texts: dict[str, list[tuple[int, str]]] = {}  # model -> (index, completion prompt)
    for i, (kind, model, body) in enumerate(bodies):
        counter = counter_for(model)
        choices = num_choices(kind, body)
        if kind in (Kind.COMPLETION, Kind.EMBEDDING):
            # Texts are tokenized as the engine tokenizes a completion's (special tokens
            # added: the EOS some embedding models pool at, say); token ids count as given.
            prompts = (_prompts(body) if kind == Kind.COMPLETION
                       else embedding_inputs(body.get("input")))
            texts.setdefault(model, []).extend((i, p) for p in prompts if isinstance(p, str))
            counts.append(PromptCount(sum(len(p) for p in prompts if isinstance(p, list)),
                                      counter.exact, choices))
            continue
        messages = body.get("messages") or []
        if counter.tokenizer is not None:
            try:
                counts.append(PromptCount(chat_prompt_tokens(counter.tokenizer, body),
                                          True, choices))
                continue
            except Exception as exc:  # the model's template refused it: the worker will too
                log.info("prompt of a %s request not rendered (%s): bounded", model, exc)
        bound = sum(len(_content(m).encode("utf-8", "surrogatepass"))
                    + len(str(m.get("role", ""))) + TEMPLATE_TOKENS_PER_MESSAGE
                    for m in messages) + TEMPLATE_TOKENS
        counts.append(PromptCount(bound, False, choices))
    for model, items in texts.items():
        tokens = counter_for(model).count_texts([t for _, t in items], add_special_tokens=True)
        for (i, _), n in zip(items, tokens, strict=True):
            counts[i] = PromptCount((counts[i].tokens or 0) + n, counts[i].exact,
                                    counts[i].choices)
    return counts


def count_rows(conn: Connection, request_ids: Sequence[str]) -> dict[str, PromptCount]:
    """Count the prompts of these requests from their stored bodies (rows a count has not
    reached yet)."""
    rows: list[Any] = []
    for start in range(0, len(request_ids), 500):
        rows += conn.execute(select(requests.c.id, requests.c.kind, requests.c.model,
                                    requests.c.body)
                             .where(requests.c.id.in_(request_ids[start:start + 500]),
                                    requests.c.kind.is_not(None))).all()
    counts = count_prompts([(Kind(r.kind), r.model or "", r.body or {}) for r in rows])
    return {r.id: c for r, c in zip(rows, counts, strict=True)}


def count_uncounted(store: Store, max_rows: int = 20_000, group: int = 500) -> int:
    """Count the prompts of queued batch lines not counted yet, a group per transaction (the
    batch jobs call it after each ingest); returns how many."""
    done = 0
    while done < max_rows:
        with store.read() as conn:
            ids = list(conn.execute(select(requests.c.id).where(
                requests.c.counted_prompt_tokens.is_(None), requests.c.num_choices.is_not(None))
                .limit(group)).scalars().all())
            counts = count_rows(conn, ids) if ids else {}
        if not counts:
            return done
        with store.write() as conn:  # counts never change: a race writes the same values
            conn.execute(update(requests).where(
                requests.c.id == bindparam("b_id"),
                requests.c.counted_prompt_tokens.is_(None)).values(
                counted_prompt_tokens=bindparam("b_tokens"),
                prompt_count_exact=bindparam("b_exact")),
                [{"b_id": i, "b_tokens": c.tokens, "b_exact": c.exact}
                 for i, c in counts.items()])
        done += len(counts)
    return done

