"""The uninterrupted reference for failure tests: requests a test's fleet finished are run
again here, offline and with nothing killed, through the worker's own path (a `Lease` built
from the stored body and seed, `HeldLease`, and the builtin engine adapter as `open_engine`
starts it for a worker, with a worker's default KV options). A request resumed from a
checkpoint, whatever the kill point, must end exactly as its reference run does: same text,
token ids, logprobs and finish reason.

Exactly, not approximately: the engine is batch-invariant (a row's numbers do not depend on
what else is in its batch, or on whether it is a prompt chunk or a decode step), so neither
the reference's batch nor the resumed tokens' prefill changes any token, and a sampled choice
draws the same random number for output position k (a hash of its seed and k) wherever it
runs.

`trust_line` makes batch lines of the kinds resuming can get wrong: seeded sampling beside
greedy, stop strings that never match (their prefixes are held back while a request runs),
stop strings that end choices early, n > 1, logprobs, multi-byte UTF-8 output split over
several tokens, and outputs a grammar constrains (a JSON schema, required tool calls), whose
grammar state a resumed request rebuilds from its tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from serve_process import MODEL, chat_line
from sqlalchemy import select

from minimill.control.records import Kind, RequestStatus
from minimill.control.render import render_choice
from minimill.control.store import open_store
from minimill.control.tables import requests
from minimill.fleet.engine_factory import open_engine
from minimill.fleet.held import HeldLease
from minimill.fleet.kv_options import KvOptions
from minimill.models.gguf_file import read_gguf_header
from minimill.models.gguf_tokenizer import tokenizer_from_gguf
from minimill.models.registry import resolve_model
from minimill.models.tokenizer import Tokenizer
from minimill.transport.protocol import ChoiceProgress, Lease

# Never in the output: while a request runs, its last len - 1 characters are held back.
NEVER = ["<|never|>", "zzzz"]
# Prompts this model answers in Japanese (three-byte characters split over byte tokens) and
# in accented French.
JAPANESE = "Say hello in Japanese to friend {i}."
FRENCH = "Écris une phrase en français sur le café numéro {i}."
# How many kinds of line trust_line makes (line i is of kind i % KINDS).
KINDS = 8
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}
LOOKUP = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]


def trust_line(custom_id: str, i: int, content: str, max_tokens: int) -> str:
    """Batch line `i`: `content` (or a prompt with UTF-8 output) under one of KINDS mixes of
    sampling options, chosen by `i`."""
    kind = i % KINDS
    if kind == 0:  # greedy, as the plainest client asks
        return chat_line(custom_id, content, max_tokens)
    if kind == 1:  # seeded sampling, with logprobs and alternatives
        return chat_line(custom_id, content, max_tokens, temperature=0.9, top_p=0.95,
                         seed=1000 + i, logprobs=True, top_logprobs=2)
    if kind == 2:  # greedy, its tail held back for a stop string that never comes
        return chat_line(custom_id, content, max_tokens, stop=NEVER, logprobs=True)
    if kind == 3:  # two choices sampled with the request's stored seed; "." ends some early
        return chat_line(custom_id, content, max_tokens, temperature=1.0, n=2, stop=["."],
                         logprobs=True)
    if kind == 4:  # split UTF-8 characters while a stop prefix is held back
        return chat_line(custom_id, JAPANESE.format(i=i), max_tokens, stop=NEVER)
    if kind == 5:
        return chat_line(custom_id, FRENCH.format(i=i), max_tokens, temperature=0.7, seed=i,
                         logprobs=True)
    if kind == 6:  # greedy JSON of a schema
        return chat_line(custom_id, content, max_tokens, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    # sampled tool calls, the grammar's lazy parts included
    return chat_line(custom_id, content, max_tokens, temperature=1.0, seed=i, tools=LOOKUP,
                     tool_choice="required")


@dataclass(frozen=True, slots=True)
class Finished:
    """A request the fleet finished, as the control plane stored it."""

    request_id: str
    custom_id: str | None
    lease: Lease  # as its first lease handed it out: body, seed, no checkpoint
    choices: list[ChoiceProgress]  # the accepted result
    interrupted: bool  # leased more than once: some lease of it was lost
    resumed: bool  # its accepted result came from a lease that continued a checkpoint


def finished_requests(db_url: str, *, batch_id: str | None = None,
                      request_ids: Collection[str] = ()) -> list[Finished]:
    """The succeeded requests of `batch_id` (or those in `request_ids`) in the store."""
    store = open_store(db_url)
    try:
        with store.read() as conn:
            query = select(requests).where(requests.c.status == RequestStatus.SUCCEEDED.value)
            query = query.where(requests.c.batch_id == batch_id) if batch_id is not None \
                else query.where(requests.c.id.in_(list(request_ids)))
            rows = conn.execute(query.order_by(requests.c.seq)).all()
    finally:
        store.close()
    return [Finished(
        request_id=r.id, custom_id=r.custom_id,
        lease=Lease(request_id=r.id, lease_id="reference", epoch=1, expires_at=0.0,
                    kind=Kind(r.kind).wire_kind, model=r.model, body=r.body, seed=r.seed),
        choices=[ChoiceProgress.model_validate(c) for c in r.result["choices"]],
        interrupted=r.attempts > 1, resumed=r.lease_base_tokens > 0) for r in rows]


def interrupted_and(finished: list[Finished], uninterrupted: int) -> list[Finished]:
    """Every interrupted request, and the first `uninterrupted` others: the reference run
    costs what the fleet's own runs cost, so a large batch compares the requests resuming can
    break, and a few that ran whole as a check on the reference itself."""
    whole = [f.request_id for f in finished if not f.interrupted]
    controls = set(whole[:uninterrupted])
    return [f for f in finished if f.interrupted or f.request_id in controls]


async def _reference_run(leases: list[Lease], dtype: str) -> dict[str, list[ChoiceProgress]]:
    # All at once: the engine batches them (as a worker's would), so a large batch is cheap.
    adapter = await open_engine("builtin", model=MODEL, dtype=dtype, capacity=len(leases),
                                engine_options=KvOptions().engine_overrides())
    try:
        held = [HeldLease(lease, adapter) for lease in leases]
        for h in held:
            h.start(lambda _: None)
        await asyncio.gather(*(h.task for h in held if h.task is not None))
    finally:
        await adapter.close()
    out = {}
    for h in held:
        assert h.result is not None and h.result.outcome == "succeeded", (h.request_id,
                                                                           h.result)
        out[h.request_id] = list(h.result.choices)
    return out


def reference_run(leases: list[Lease], dtype: str = "float32") -> dict[str, list[ChoiceProgress]]:
    """request_id -> its choices from one uninterrupted run of all `leases` at once."""
    assert {lease.model for lease in leases} <= {MODEL}
    return asyncio.run(_reference_run(leases, dtype))


def _difference(got: list[ChoiceProgress], want: list[ChoiceProgress]) -> str | None:
    """Where a stored result first differs from its reference, or None."""
    if len(got) != len(want):
        return f"{len(got)} choices, the reference {len(want)}"
    for g, w in zip(got, want, strict=True):
        for name in ("index", "text", "token_ids", "finish_reason", "logprobs", "tool_format"):
            if getattr(g, name) != getattr(w, name):
                return (f"choice {w.index} {name}: {getattr(g, name)!r} != the reference's "
                        f"{getattr(w, name)!r}")
    return None


@dataclass(frozen=True, slots=True)
class Compared:
    """What a reference comparison covered."""

    reference: dict[str, list[ChoiceProgress]]
    resumed: list[str]  # request ids whose accepted result continued a checkpoint


def assert_results_match_reference(finished: list[Finished],
                                   dtype: str = "float32") -> Compared:
    """Run `finished` uninterrupted and assert that every stored result equals its run."""
    assert finished
    reference = reference_run([f.lease for f in finished], dtype)
    wrong = [f"{f.request_id} ({f.custom_id}{', resumed' if f.resumed else ''}): {diff}"
             for f in finished
             if (diff := _difference(f.choices, reference[f.request_id])) is not None]
    assert not wrong, f"{len(wrong)} of {len(finished)} results differ from an " \
                      "uninterrupted run:\n" + "\n".join(wrong[:10])
    return Compared(reference, [f.request_id for f in finished if f.resumed])


def tokenizer() -> Tokenizer:
    """The test model's tokenizer, read from its file without loading its weights."""
    path = resolve_model(MODEL)
    return tokenizer_from_gguf(read_gguf_header(path).metadata, path)


def rendered(kind: Kind, choices: list[ChoiceProgress], request_id: str) -> list[dict[str, Any]]:
    """The choices of the response body a client gets for these results."""
    return [render_choice(kind, c.model_dump(mode="json"), request_id) for c in choices]
