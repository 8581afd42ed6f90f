"""Checkpoints stored as appended pieces: the SQL and the length checks.

A request's checkpoint is the rows of `checkpoint_chunks` in `seq` order: each accepted heartbeat
appends one row holding what is new per choice, with the lengths it extends, and a full
checkpoint (after a resync) replaces the rows. `requests.progress` holds only the lengths per
choice, so a delta is checked and appended without reading what it extends, and a stream reads
only the rows after the last one it sent. Leases get the assembled checkpoint (once per lease).
When a request ends, its rows are dropped; its result is kept with the row.

What a site sends (token ids, text, logprobs) is encoded to JSON before the write transaction
opens (`encode`); inside it, a chunk is only those pieces joined with the lengths they extend.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, bindparam, delete, insert, select, update

from minimill.control.records import RequestStatus
from minimill.control.store import JsonText
from minimill.control.tables import checkpoint_chunks, requests
from minimill.transport.protocol import (
    Checkpoint,
    CheckpointDelta,
    ChoiceDelta,
    ChoiceProgress,
    HeartbeatItem,
)

# Ids per IN (...) list: well under every backend's limit on bound parameters.
ID_GROUP = 500
# Without token ids (a text-only checkpoint from an HTTP engine) ~4 characters make a token.
_CHARS_PER_TOKEN = 4


@dataclass(slots=True)
class ChoiceLengths:
    """How much of one choice the stored checkpoint holds."""

    tokens: int = 0  # token ids
    chars: int = 0  # text, in Unicode code points
    logprobs: int = 0
    has_logprobs: bool = False  # a logprobs list was sent (possibly empty so far)
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        """Generated tokens: ids if any, else logprobs, else estimated from the text."""
        return self.tokens or self.logprobs or -(-self.chars // _CHARS_PER_TOKEN)


@dataclass(slots=True)
class Progress:
    """`requests.progress`: the stored checkpoint's lengths and its newest chunk's seq."""

    seq: int = 0
    num_prompt_tokens: int = 0
    choices: dict[int, ChoiceLengths] = field(default_factory=dict)

    @classmethod
    def of(cls, data: dict[str, Any] | None) -> Progress:
        if not data:
            return cls()
        return cls(seq=int(data.get("seq", 0)),
                   num_prompt_tokens=int(data.get("num_prompt_tokens", 0)),
                   choices={int(c["index"]): ChoiceLengths(
                       tokens=int(c["tokens"]), chars=int(c["chars"]),
                       logprobs=int(c["logprobs"]), has_logprobs=bool(c["has_logprobs"]),
                       finish_reason=c.get("finish_reason"))
                       for c in data.get("choices", [])})

    def as_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "num_prompt_tokens": self.num_prompt_tokens,
                "choices": [{"index": i, "tokens": c.tokens, "chars": c.chars,
                             "logprobs": c.logprobs, "has_logprobs": c.has_logprobs,
                             "finish_reason": c.finish_reason}
                            for i, c in sorted(self.choices.items())]}

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices.values())


def has_output(progress: dict[str, Any] | None) -> bool:
    """Whether a stored checkpoint holds any generated text or tokens."""
    return any(c.tokens or c.chars for c in Progress.of(progress).choices.values())


def payload(choice: ChoiceProgress | ChoiceDelta) -> str:
    """What a choice carries, as the JSON members of its chunk entry."""
    return (f'"token_ids": {json.dumps(choice.token_ids)}, "text": {json.dumps(choice.text)}, '
            f'"logprobs": {json.dumps(choice.logprobs)}')


def encode(items: Sequence[HeartbeatItem]) -> dict[int, list[str]]:
    """The payloads of the items' choices, by id() of the item, each in the order its
    checkpoint or delta lists its choices: made before the write transaction opens."""
    encoded = {}
    for item in items:
        if item.checkpoint is not None:
            encoded[id(item)] = [payload(c) for c in item.checkpoint.choices]
        elif item.delta is not None:
            encoded[id(item)] = [payload(d) for d in item.delta.choices]
    return encoded


def _entry(index: int, base: ChoiceLengths, encoded: str, finish_reason: str | None,
           tool_format: str | None = None) -> str:
    # A request with tools records the syntax its calls are written in.
    fmt = "" if tool_format is None else f', "tool_format": {json.dumps(tool_format)}'
    return (f'{{"index": {index}, "base_tokens": {base.tokens}, "base_chars": {base.chars}, '
            f'"base_logprobs": {base.logprobs}, {encoded}, '
            f'"finish_reason": {json.dumps(finish_reason)}{fmt}}}')


def _chunk(full: bool, num_prompt_tokens: int, entries: list[str]) -> JsonText:
    return JsonText(f'{{"full": {json.dumps(full)}, "num_prompt_tokens": {num_prompt_tokens}, '
                    f'"choices": [{", ".join(entries)}]}}')


def replaced(current: Progress, checkpoint: Checkpoint,
             encoded: Sequence[str] | None = None) -> tuple[Progress, JsonText]:
    """The progress and chunk of a full checkpoint that replaces what is stored (`encoded`:
    its choices' payloads, made ahead)."""
    new = Progress(seq=current.seq + 1, num_prompt_tokens=checkpoint.num_prompt_tokens)
    entries = []
    for i, c in enumerate(checkpoint.choices):
        new.choices[c.index] = ChoiceLengths(
            tokens=len(c.token_ids), chars=len(c.text), logprobs=len(c.logprobs or []),
            has_logprobs=c.logprobs is not None, finish_reason=c.finish_reason)
        entries.append(_entry(c.index, ChoiceLengths(),
                              encoded[i] if encoded is not None else payload(c),
                              c.finish_reason, c.tool_format))
    return new, _chunk(True, new.num_prompt_tokens, entries)


def extended(current: Progress, delta: CheckpointDelta, encoded: Sequence[str] | None = None
             ) -> tuple[Progress, JsonText | None] | None:
    """The progress after `delta` and its chunk (None when it adds nothing); None when a
    choice's base differs from what is stored (the worker must resend in full). `encoded`:
    its choices' payloads, made ahead."""
    new = Progress(seq=current.seq, num_prompt_tokens=current.num_prompt_tokens,
                   choices={i: ChoiceLengths(c.tokens, c.chars, c.logprobs, c.has_logprobs,
                                             c.finish_reason)
                            for i, c in current.choices.items()})
    entries = []
    for i, d in enumerate(delta.choices):
        base = current.choices.get(d.index, ChoiceLengths())
        if (d.base_tokens, d.base_chars, d.base_logprobs) != (base.tokens, base.chars,
                                                              base.logprobs):
            return None
        if not (d.token_ids or d.text or d.logprobs
                or (d.finish_reason and d.finish_reason != base.finish_reason)
                or (d.logprobs is not None and not base.has_logprobs)):
            continue
        c = new.choices[d.index] = ChoiceLengths(
            tokens=base.tokens + len(d.token_ids), chars=base.chars + len(d.text),
            logprobs=base.logprobs + len(d.logprobs or []),
            has_logprobs=base.has_logprobs or d.logprobs is not None,
            finish_reason=d.finish_reason or base.finish_reason)
        entries.append(_entry(d.index, base, encoded[i] if encoded is not None else payload(d),
                              c.finish_reason, d.tool_format))
    prompt_changed = delta.num_prompt_tokens not in (0, current.num_prompt_tokens)
    if not entries and not prompt_changed:
        return new, None
    new.seq += 1
    if prompt_changed:
        new.num_prompt_tokens = delta.num_prompt_tokens
    return new, _chunk(False, new.num_prompt_tokens, entries)


def replacement(conn: Connection, request_id: str, checkpoint: Checkpoint,
                encoded: Sequence[str] | None = None) -> tuple[dict[str, Any], JsonText]:
    """The row values and the chunk that replace the request's stored checkpoint with
    `checkpoint` (a release's; `encoded`: its choices' payloads, made ahead): set the values in
    the caller's conditional UPDATE, and `put` the chunk if it took."""
    row = conn.execute(select(requests.c.progress).where(requests.c.id == request_id)).first()
    new, chunk = replaced(Progress.of(row.progress if row else None), checkpoint, encoded)
    return {"progress": new.as_json(), "checkpoint_tokens": _tokens(new)}, chunk


def put(conn: Connection, request_id: str, values: dict[str, Any], chunk: JsonText) -> None:
    """Store a full checkpoint's chunk (from `replacement`) in place of the request's chunks."""
    drop(conn, [request_id])
    conn.execute(insert(checkpoint_chunks).values(request_id=request_id,
                                                  seq=values["progress"]["seq"], data=chunk))


def _tokens(progress: Progress) -> int:
    return min(progress.num_tokens, 2**31 - 1)


def save(conn: Connection, items: Sequence[HeartbeatItem],
         encoded: Mapping[int, list[str]] | None = None) -> list[str]:
    """Store the checkpoints of leases just extended (held, at their epochs, locked by the
    caller's transaction; `encoded`: their payloads from `encode`, made before it opened);
    returns the ids whose delta did not apply (resync)."""
    encoded = encoded or {}
    wanted = [i for i in items if i.checkpoint is not None or i.delta is not None]
    current: dict[str, Progress] = {}
    ids = list({i.request_id for i in wanted})
    for start in range(0, len(ids), ID_GROUP):
        current.update({r.id: Progress.of(r.progress) for r in conn.execute(
            _PROGRESS, {"b_ids": ids[start:start + ID_GROUP]})})
    resync: list[str] = []
    cleared: list[str] = []
    chunks: dict[tuple[str, int], JsonText] = {}
    stored: dict[str, tuple[int, Progress]] = {}
    for item in wanted:
        if item.request_id not in current:
            continue
        data: JsonText | None
        if item.checkpoint is not None:
            new, data = replaced(current[item.request_id], item.checkpoint,
                                 encoded.get(id(item)))
            cleared.append(item.request_id)
            chunks = {k: v for k, v in chunks.items() if k[0] != item.request_id}
        else:
            assert item.delta is not None
            applied = extended(current[item.request_id], item.delta, encoded.get(id(item)))
            if applied is None:
                resync.append(item.request_id)
                continue
            new, data = applied
        current[item.request_id] = new
        if data is not None:
            chunks[(item.request_id, new.seq)] = data
            stored[item.request_id] = (item.epoch, new)
    drop(conn, cleared)
    if chunks:
        conn.execute(_APPEND, [
            {"request_id": request_id, "seq": seq, "data": data}
            for (request_id, seq), data in chunks.items()])
    if stored:
        conn.execute(
            _STORE_PROGRESS,
            [{"b_id": request_id, "b_epoch": epoch, "b_progress": p.as_json(),
              "b_tokens": _tokens(p)}
             for request_id, (epoch, p) in stored.items()])
    return resync


# The statements of every heartbeat and completion, built once.
_PROGRESS = (select(requests.c.id, requests.c.progress)
             .where(requests.c.id.in_(bindparam("b_ids", expanding=True))))
_APPEND = insert(checkpoint_chunks)
_STORE_PROGRESS = (update(requests)
                   .where(requests.c.id == bindparam("b_id"),
                          requests.c.epoch == bindparam("b_epoch"),
                          requests.c.status == RequestStatus.LEASED.value)
                   .values(progress=bindparam("b_progress"),
                           checkpoint_tokens=bindparam("b_tokens"),
                           version=requests.c.version + 1))
_DROP = (delete(checkpoint_chunks)
         .where(checkpoint_chunks.c.request_id.in_(bindparam("b_ids", expanding=True))))
_LOAD = (select(checkpoint_chunks.c.request_id, checkpoint_chunks.c.data)
         .where(checkpoint_chunks.c.request_id.in_(bindparam("b_ids", expanding=True)))
         .order_by(checkpoint_chunks.c.request_id, checkpoint_chunks.c.seq))


def load(conn: Connection, request_ids: Iterable[str]) -> dict[str, Checkpoint]:
    """The assembled checkpoints of these requests (those that have one)."""
    ids = list(request_ids)
    out: dict[str, Checkpoint] = {}
    for start in range(0, len(ids), ID_GROUP):
        rows = conn.execute(_LOAD, {"b_ids": ids[start:start + ID_GROUP]})
        pieces: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            pieces.setdefault(row.request_id, []).append(row.data)
        out.update({request_id: assemble(data) for request_id, data in pieces.items()})
    return out


def assemble(chunks: Iterable[dict[str, Any]]) -> Checkpoint:
    """A checkpoint from its chunks in seq order."""
    token_ids: dict[int, list[int]] = {}
    texts: dict[int, list[str]] = {}
    logprobs: dict[int, list[dict[str, Any]]] = {}
    finish: dict[int, str | None] = {}
    formats: dict[int, Any] = {}
    num_prompt_tokens = 0
    for chunk in chunks:
        if chunk.get("full"):
            token_ids, texts, logprobs, finish = {}, {}, {}, {}
        num_prompt_tokens = int(chunk.get("num_prompt_tokens") or num_prompt_tokens)
        for c in chunk.get("choices", []):
            i = int(c["index"])
            token_ids.setdefault(i, []).extend(c.get("token_ids") or [])
            texts.setdefault(i, []).append(c.get("text") or "")
            if c.get("logprobs") is not None:
                logprobs.setdefault(i, []).extend(c["logprobs"])
            finish[i] = c.get("finish_reason") or finish.get(i)
            formats[i] = c.get("tool_format") or formats.get(i)
    return Checkpoint(num_prompt_tokens=num_prompt_tokens, choices=[
        ChoiceProgress(index=i, token_ids=token_ids[i], text="".join(texts[i]),
                       logprobs=logprobs.get(i), finish_reason=finish[i],
                       tool_format=formats.get(i))
        for i in sorted(texts)])


# Built once, as the streams' row read (requests.read_stream) that calls it at every poll.
_SINCE = (select(checkpoint_chunks.c.seq, checkpoint_chunks.c.data)
          .where(checkpoint_chunks.c.request_id == bindparam("request_id"),
                 checkpoint_chunks.c.seq > bindparam("after_seq"))
          .order_by(checkpoint_chunks.c.seq))


def since(conn: Connection, request_id: str, after_seq: int) -> list[tuple[int, dict[str, Any]]]:
    """(seq, chunk) of the request's chunks after `after_seq`, in order."""
    rows = conn.execute(_SINCE, {"request_id": request_id, "after_seq": after_seq})
    return [(int(r.seq), r.data) for r in rows]


def drop(conn: Connection, request_ids: Sequence[str]) -> None:
    """Delete the chunks of these requests (they ended, or a full checkpoint replaces them)."""
    ids = list(request_ids)
    for start in range(0, len(ids), ID_GROUP):
        conn.execute(_DROP, {"b_ids": ids[start:start + ID_GROUP]})


def drop_for_batches(conn: Connection, batch_ids: Sequence[str]) -> None:
    """Delete the chunks of every row of these batches (all of them just ended)."""
    if batch_ids:
        conn.execute(delete(checkpoint_chunks).where(checkpoint_chunks.c.request_id.in_(
            select(requests.c.id).where(requests.c.batch_id.in_(list(batch_ids))))))
