"""Incremental checkpoints on a real store: deltas append, a mismatched base asks for a full
checkpoint, resume gets exactly what was accepted, streams read only what is new, and a
request's checkpoint is dropped once it ends (its result is kept)."""

from __future__ import annotations

import json
import time
from typing import Any

from control_factory import CONFIG, MODEL, ask, batch, chat_line, site, success, tenant
from sqlalchemy import func, select

from minimill.control.batches import cancel_batch
from minimill.control.bodies import ChatBody, prepare_body
from minimill.control.leases import complete, heartbeat, lease, reap_expired
from minimill.control.records import Kind, RequestStatus
from minimill.control.requests import (
    cancel_request,
    checkpoint_of,
    expire_overdue,
    get_request,
    read_stream,
    submit,
)
from minimill.control.store import Store
from minimill.control.tables import checkpoint_chunks
from minimill.transport.protocol import (
    Checkpoint,
    CheckpointDelta,
    ChoiceDelta,
    ChoiceProgress,
    HeartbeatItem,
    HeartbeatRequest,
    HeartbeatResponse,
)


def realtime(store: Store, owner_id: str, now: float, **body: Any) -> str:
    parsed = ChatBody.model_validate({"model": MODEL, "max_tokens": 400, **body,
                                      "messages": [{"role": "user", "content": "x"}]})
    return submit(store, owner_id, prepare_body(Kind.CHAT, parsed, [MODEL]), now, CONFIG)


def delta(base_tokens: int, base_chars: int, ids: list[int], text: str, index: int = 0,
          logprobs: list[dict[str, Any]] | None = None, base_logprobs: int = 0,
          finish: str | None = None) -> CheckpointDelta:
    return CheckpointDelta(num_prompt_tokens=7, choices=[ChoiceDelta(
        index=index, base_tokens=base_tokens, base_chars=base_chars,
        base_logprobs=base_logprobs, token_ids=ids, text=text, logprobs=logprobs,
        finish_reason=finish)])


def beat(store: Store, who: Any, rid: str, epoch: int, now: float, *,
         d: CheckpointDelta | None = None, full: Checkpoint | None = None) -> HeartbeatResponse:
    return heartbeat(store, who, HeartbeatRequest(leases=[
        HeartbeatItem(request_id=rid, epoch=epoch, delta=d, checkpoint=full)]), now, CONFIG)


def chunk_rows(store: Store, request_id: str | None = None) -> int:
    query = select(func.count()).select_from(checkpoint_chunks)
    if request_id is not None:
        query = query.where(checkpoint_chunks.c.request_id == request_id)
    with store.read() as conn:
        return int(conn.execute(query).scalar_one())


def stored_bytes(store: Store, request_id: str) -> int:
    with store.read() as conn:
        return sum(len(json.dumps(d)) for d in conn.execute(
            select(checkpoint_chunks.c.data)
            .where(checkpoint_chunks.c.request_id == request_id)).scalars())


def test_deltas_append_and_resume_gets_exactly_what_was_accepted(store: Store) -> None:
    owner, s, other = tenant(store), site(store), site(store, "s2")
    now = time.time()
    rid = realtime(store, owner.id, now, logprobs=True)
    (held,) = lease(store, s, ask(), now, CONFIG).leases
    lp = [{"token": "a", "logprob": -0.1, "top_logprobs": []}]
    first = beat(store, s, rid, held.epoch, now, d=delta(0, 0, [1, 2], "ab", logprobs=lp * 2))
    assert first.extended and first.resync == []
    second = beat(store, s, rid, held.epoch, now,
                  d=delta(2, 2, [3], "c", logprobs=lp, base_logprobs=2))
    assert second.resync == []
    # A delta from a base the store no longer has (its answer was lost, say) is not applied;
    # the lease is still extended and the worker is asked for its whole progress.
    lost = beat(store, s, rid, held.epoch, now, d=delta(2, 2, [3, 4], "cd"))
    assert lost.extended and lost.resync == [rid]
    assert checkpoint_of(store, owner.id, rid) == Checkpoint(num_prompt_tokens=7, choices=[
        ChoiceProgress(index=0, token_ids=[1, 2, 3], text="abc", logprobs=lp * 3)])
    full = Checkpoint(num_prompt_tokens=7, choices=[
        ChoiceProgress(index=0, token_ids=[1, 2, 3, 4], text="abcd", logprobs=lp * 4)])
    assert beat(store, s, rid, held.epoch, now, full=full).resync == []
    assert chunk_rows(store, rid) == 1  # the full checkpoint replaced the pieces
    # A stale epoch appends nothing, nor does a site that does not hold the lease.
    assert beat(store, s, rid, held.epoch - 1, now, d=delta(4, 4, [9], "z")).revoked == [rid]
    assert beat(store, other, rid, held.epoch, now, d=delta(4, 4, [9], "z")).revoked == [rid]
    assert beat(store, s, rid, held.epoch, now,
                d=delta(4, 4, [5], "e", base_logprobs=4, finish="length")).resync == []
    accepted = checkpoint_of(store, owner.id, rid)
    assert accepted is not None and accepted.choices[0].text == "abcde"
    assert accepted.choices[0].finish_reason == "length"

    assert reap_expired(store, now + CONFIG.lease_ttl_s + 1) == 1
    (again,) = lease(store, other, ask(), now + 20, CONFIG).leases
    assert again.checkpoint == accepted
    # The new holder continues from exactly those lengths.
    assert beat(store, other, rid, again.epoch, now + 21,
                d=delta(5, 5, [6], "f", base_logprobs=4)).resync == []
    resumed = checkpoint_of(store, owner.id, rid)
    assert resumed is not None and resumed.choices[0].token_ids == [1, 2, 3, 4, 5, 6]


def test_each_checkpoint_stores_only_what_is_new(store: Store) -> None:
    owner, s = tenant(store), site(store)
    now = time.time()
    rid = realtime(store, owner.id, now)
    (held,) = lease(store, s, ask(), now, CONFIG).leases
    word = "token "
    for i in range(300):
        assert beat(store, s, rid, held.epoch, now,
                    d=delta(i, i * len(word), [i], word)).resync == []
    assert chunk_rows(store, rid) == 300
    # Linear in the output: the whole text again in every row would be ~150x this.
    assert stored_bytes(store, rid) < 300 * 250
    record, chunks = read_stream(store, owner.id, rid, after_seq=295)
    assert [seq for seq, _ in chunks] == [296, 297, 298, 299, 300]
    assert record.body is None and record.progress is not None
    assert "".join(c["choices"][0]["text"] for _, c in chunks) == word * 5


def test_several_choices_move_independently(store: Store) -> None:
    owner, s = tenant(store), site(store)
    now = time.time()
    rid = realtime(store, owner.id, now, n=2)
    (held,) = lease(store, s, ask(), now, CONFIG).leases
    both = CheckpointDelta(choices=[ChoiceDelta(index=0, token_ids=[1], text="a"),
                                    ChoiceDelta(index=1, token_ids=[7, 8], text="xy")])
    assert beat(store, s, rid, held.epoch, now, d=both).resync == []
    one = CheckpointDelta(choices=[ChoiceDelta(index=1, base_tokens=2, base_chars=2,
                                               token_ids=[9], text="z")])
    assert beat(store, s, rid, held.epoch, now, d=one).resync == []
    cp = checkpoint_of(store, owner.id, rid)
    assert cp is not None
    assert [(c.index, c.text, c.token_ids) for c in cp.choices] == [
        (0, "a", [1]), (1, "xyz", [7, 8, 9])]
    # An empty delta is a plain heartbeat: nothing stored.
    before = chunk_rows(store, rid)
    assert beat(store, s, rid, held.epoch, now, d=CheckpointDelta()).resync == []
    assert chunk_rows(store, rid) == before


def test_checkpoints_are_dropped_when_requests_end(store: Store) -> None:
    owner, s = tenant(store), site(store)
    now = time.time()
    done, cancelled, expired = (realtime(store, owner.id, now) for _ in range(3))
    b = batch(store, owner, [chat_line("b1"), chat_line("b2")])
    held = {h.request_id: h for h in lease(store, s, ask(capacity=10), now, CONFIG).leases}
    assert len(held) == 5
    for rid, h in held.items():
        beat(store, s, rid, h.epoch, now, d=delta(0, 0, [1, 2], "hi"))
    assert chunk_rows(store) == 5
    assert complete(store, s, success(done, held[done].epoch, "hi there"), now,
                    CONFIG).accepted == [done]
    assert cancel_request(store, cancelled, now, "client left")
    assert expire_overdue(store, now + CONFIG.realtime_timeout_s + 1) == 1
    cancel_batch(store, owner.id, b.id, now=now)
    assert chunk_rows(store) == 0
    for rid in (done, cancelled, expired):
        record = get_request(store, owner.id, rid)
        assert record.terminal and record.progress is None
        assert checkpoint_of(store, owner.id, rid) is None
    finished = get_request(store, owner.id, done)
    assert finished.status == RequestStatus.SUCCEEDED and finished.result is not None
    assert finished.result["choices"][0]["text"] == "hi there"
