"""Leases with fencing on a real store: lease, heartbeat, complete exactly once, reap."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from control_factory import (
    CONFIG,
    MODEL,
    ask,
    batch,
    chat_line,
    chat_prompt_tokens,
    site,
    success,
    tenant,
)
from pydantic import ValidationError
from sqlalchemy import select

from minimill.control import lease_queue
from minimill.control.bodies import ChatBody, prepare_body
from minimill.control.leases import (
    checkpoint_interval_s,
    complete,
    heartbeat,
    lease,
    reap_expired,
)
from minimill.control.records import Kind, RequestStatus
from minimill.control.requests import cancel_request, checkpoint_of, get_request, submit
from minimill.control.site_view import list_sites
from minimill.control.store import Store, open_store
from minimill.control.tables import requests
from minimill.transport.protocol import (
    Checkpoint,
    ChoiceProgress,
    CompleteRequest,
    CompletionItem,
    ErrorInfo,
    HeartbeatItem,
    HeartbeatRequest,
    LeaseRequest,
    Usage,
)


def realtime(store: Store, owner_id: str, content: str, now: float, **body: object) -> str:
    parsed = ChatBody.model_validate({"model": MODEL, "max_tokens": 16, **body,
                                      "messages": [{"role": "user", "content": content}]})
    return submit(store, owner_id, prepare_body(Kind.CHAT, parsed, [MODEL]), now, CONFIG)


def test_realtime_first_then_background_by_deadline(store: Store) -> None:
    owner, s = tenant(store), site(store)
    now = time.time()
    late = batch(store, owner, [chat_line("late")], now=now, window="48h")
    early = batch(store, owner, [chat_line("early")], now=now + 1)
    rt = realtime(store, owner.id, "urgent", now + 2)
    got = lease(store, s, ask(capacity=2), now + 3, CONFIG).leases
    assert got[0].request_id == rt
    assert got[1].body["messages"][0]["content"] == "hi" and got[1].epoch == 1
    rest = lease(store, s, ask(capacity=5), now + 3, CONFIG).leases
    assert len(rest) == 1
    with store.read() as conn:
        batch_of = dict(conn.execute(select(requests.c.id, requests.c.batch_id)).all())
    assert batch_of[got[1].request_id] == early.id and batch_of[rest[0].request_id] == late.id


def test_lease_carries_seed_model_and_stream(store: Store) -> None:
    owner, s = tenant(store), site(store)
    now = time.time()
    seeded = realtime(store, owner.id, "a", now, seed=42)
    streamed = realtime(store, owner.id, "b", now, stream=True)
    got = {g.request_id: g for g in lease(store, s, ask(), now, CONFIG).leases}
    assert got[seeded].seed == 42 and got[seeded].model == MODEL
    assert got[seeded].checkpoint_interval_s == CONFIG.checkpoint_interval_s
    assert got[streamed].stream and got[streamed].checkpoint_interval_s == \
        CONFIG.stream_checkpoint_interval_s
    assert 0 <= got[streamed].seed < 2**63  # assigned at creation, the same on every lease


def test_a_site_holding_many_leases_checkpoints_each_less_often(store: Store) -> None:
    """The rows a site's checkpoints write per second stay near site_checkpoints_per_s: the
    interval of each new lease grows with what the site holds once it is granted."""
    config = dataclasses.replace(CONFIG, checkpoint_interval_s=2.0, site_checkpoints_per_s=4.0)
    owner, s = tenant(store), site(store)
    now = time.time()
    batch(store, owner, [chat_line(f"line {i}") for i in range(20)], now=now)
    first = lease(store, s, ask(capacity=6), now, config).leases
    assert [g.checkpoint_interval_s for g in first] == [2.0] * 6  # 6 leases / 4 per s < 2 s
    more = lease(store, s, ask(capacity=10), now, config).leases
    assert [g.checkpoint_interval_s for g in more] == [4.0] * 10  # 16 held / 4 per s
    stream = realtime(store, owner.id, "live", now, stream=True)
    (live,) = lease(store, s, ask(capacity=1), now + 1, config).leases
    assert live.request_id == stream and live.checkpoint_interval_s == 0.1  # streams excepted
    assert checkpoint_interval_s(config, 400) == 100.0


def test_heartbeat_extends_stores_checkpoints_and_revokes(store: Store) -> None:
    owner, s, other = tenant(store), site(store), site(store, "s2")
    now = time.time()
    rid = realtime(store, owner.id, "x", now)
    (held,) = lease(store, s, ask(), now, CONFIG).leases
    cp = Checkpoint(choices=[ChoiceProgress(index=0, token_ids=[5, 6], text="ab")],
                    num_prompt_tokens=4)
    beat = heartbeat(store, s, HeartbeatRequest(leases=[
        HeartbeatItem(request_id=rid, epoch=held.epoch, checkpoint=cp)]), now + 5, CONFIG)
    assert beat.extended == {rid: now + 5 + CONFIG.lease_ttl_s} and beat.revoked == []
    assert checkpoint_of(store, owner.id, rid) == cp
    for who, epoch in ((s, held.epoch + 1), (other, held.epoch), (s, 2**40)):
        answer = heartbeat(store, who, HeartbeatRequest(leases=[
            HeartbeatItem(request_id=rid, epoch=epoch)]), now + 6, CONFIG)
        assert answer.revoked == [rid] and answer.extended == {}


def test_a_lease_call_made_again_under_its_ask_id_gets_back_what_its_lost_answer_carried(
        store: Store) -> None:
    owner, s, other = tenant(store), site(store), site(store, "s2")
    now = time.time()
    first, second = (realtime(store, owner.id, w, now) for w in ("a", "b"))
    retried = ask(capacity=1).model_copy(update={"ask_id": "ask-0001"})
    (lost,) = lease(store, s, retried, now, CONFIG).leases  # the worker never read this
    assert lost.request_id == first
    # Another site naming the same ask reaches nothing of this one's: it is granted new work.
    (theirs,) = lease(store, other, retried, now + 1, CONFIG).leases
    assert theirs.request_id == second
    # The retry: the same lease at the same epoch, its TTL running from now, and it fills the
    # capacity (nothing new is granted beside it).
    again = lease(store, s, retried, now + 5, CONFIG).leases
    assert [(g.request_id, g.epoch, g.lease_id) for g in again] == \
        [(first, lost.epoch, lost.lease_id)]
    assert again[0].expires_at == now + 5 + CONFIG.lease_ttl_s
    with store.read() as conn:
        expiry = conn.execute(select(requests.c.lease_expires_at)
                              .where(requests.c.id == first)).scalar_one()
    assert expiry == now + 5 + CONFIG.lease_ttl_s
    # A call of that name whose worker left before its transaction began hands nothing out,
    # but what the name holds waits for the next call (its expiry runs from this one).
    assert lease(store, s, retried, now + 20, CONFIG, gone=lambda: True).leases == []
    with store.read() as conn:
        expiry = conn.execute(select(requests.c.lease_expires_at)
                              .where(requests.c.id == first)).scalar_one()
    assert expiry == now + 20 + CONFIG.lease_ttl_s
    granted = {x.name: x.leases_granted for x in list_sites(store, now + 5)}
    assert granted == {"s1": 1, "s2": 1}  # a delivery again is not a new grant
    # Once the request is done, the ask id brings nothing back; a fresh ask is new work only.
    assert complete(store, s, success(first, lost.epoch), now + 6, CONFIG).accepted == [first]
    assert lease(store, s, retried, now + 7, CONFIG).leases == []
    assert lease(store, s, ask(), now + 7, CONFIG).leases == []
    for hostile in ("short", "x" * 33, "../etc/pa", "a b c d e", "lse_%00000"):
        with pytest.raises(ValidationError):
            LeaseRequest.model_validate({"capacity": 1, "models": [MODEL], "ask_id": hostile})


def test_completion_is_accepted_once_at_the_current_epoch(store: Store) -> None:
    owner, s = tenant(store), site(store, price_per_hour=0.36)
    now = time.time()
    rid = realtime(store, owner.id, "x", now)
    (held,) = lease(store, s, ask(tokens_per_s=100.0), now, CONFIG).leases
    stale = complete(store, s, success(rid, held.epoch - 1), now, CONFIG)
    assert [r.reason for r in stale.rejected] == ["stale_epoch"]
    first = complete(store, s, success(rid, held.epoch, "first", tokens=4), now, CONFIG)
    assert first.accepted == [rid]
    # A resend (its answer was lost) is accepted again, and changes nothing.
    again = complete(store, s, success(rid, held.epoch, "second"), now, CONFIG)
    assert again.accepted == [rid] and again.rejected == []
    unknown = complete(store, s, success("req_missing", 1), now, CONFIG)
    assert [r.reason for r in unknown.rejected] == ["unknown_request"]
    done = get_request(store, owner.id, rid)
    assert done.status == RequestStatus.SUCCEEDED
    assert done.result is not None and done.result["choices"][0]["text"] == "first"
    # The prompt as the control plane counted it (the site reported 3), the tokens returned.
    prompt = chat_prompt_tokens("x")
    assert (done.prompt_tokens, done.completion_tokens) == (prompt, 4)
    # The built-in price (0.10 $/Mtok in, 0.40 out), realtime: the site's price plays no part.
    assert done.billed_usd == pytest.approx((prompt * 0.10 + 4 * 0.40) / 1e6)
    (stats,) = list_sites(store, now)
    assert (stats.completions, stats.stale_completions, stats.wasted_tokens) == (1, 1, 2)
    assert stats.tokens_generated == 4


def test_failed_completion_keeps_the_worker_error(store: Store) -> None:
    owner, s = tenant(store), site(store)
    now = time.time()
    rid = realtime(store, owner.id, "x", now)
    (held,) = lease(store, s, ask(), now, CONFIG).leases
    answer = complete(store, s, CompleteRequest(results=[CompletionItem(
        request_id=rid, epoch=held.epoch, outcome="failed", error=ErrorInfo(
            code="context_length_exceeded", message="too long", param="messages"))]),
        now, CONFIG)
    assert answer.accepted == [rid]
    failed = get_request(store, owner.id, rid)
    assert failed.status == RequestStatus.FAILED and failed.error is not None
    assert failed.error["code"] == "context_length_exceeded"


def test_reap_requeues_with_checkpoint_and_fences_the_old_holder(store: Store) -> None:
    owner, zombie, fresh = tenant(store), site(store, "zombie"), site(store, "fresh")
    now = time.time()
    rid = realtime(store, owner.id, "x", now)
    (first,) = lease(store, zombie, ask(), now, CONFIG).leases
    cp = Checkpoint(choices=[ChoiceProgress(index=0, token_ids=[9], text="z")])
    heartbeat(store, zombie, HeartbeatRequest(leases=[
        HeartbeatItem(request_id=rid, epoch=first.epoch, checkpoint=cp)]), now, CONFIG)
    assert reap_expired(store, now + CONFIG.lease_ttl_s - 1) == 0
    assert reap_expired(store, now + CONFIG.lease_ttl_s + 1) == 1
    assert get_request(store, owner.id, rid).status == RequestStatus.QUEUED
    (second,) = lease(store, fresh, ask(), now + 20, CONFIG).leases
    assert second.epoch == first.epoch + 1
    assert second.checkpoint == cp
    late = complete(store, zombie, success(rid, first.epoch, "zombie", tokens=7), now + 21,
                    CONFIG)
    assert [r.reason for r in late.rejected] == ["stale_epoch"]
    assert complete(store, fresh, success(rid, second.epoch), now + 22, CONFIG).accepted
    stats = {st.name: st for st in list_sites(store, now + 23)}
    # Of the zombie's 7 tokens, the one its checkpoint held went on in the fresh lease.
    assert (stats["zombie"].leases_expired, stats["zombie"].stale_completions,
            stats["zombie"].wasted_tokens) == (1, 1, 6)
    assert stats["fresh"].completions == 1


def test_a_result_from_an_expired_lease_nobody_took_is_accepted(store: Store) -> None:
    owner, s = tenant(store), site(store)
    now = time.time()
    rid = realtime(store, owner.id, "x", now)
    (held,) = lease(store, s, ask(), now, CONFIG).leases
    assert reap_expired(store, now + CONFIG.lease_ttl_s + 1) == 1
    revoked = heartbeat(store, s, HeartbeatRequest(leases=[
        HeartbeatItem(request_id=rid, epoch=held.epoch)]), now + 12, CONFIG)
    assert revoked.revoked == [rid]
    # Its epoch is still the row's: the finished result is not thrown away.
    late = complete(store, s, success(rid, held.epoch, "late but fine", tokens=5), now + 13,
                    CONFIG)
    assert late.accepted == [rid]
    done = get_request(store, owner.id, rid)
    assert done.status == RequestStatus.SUCCEEDED and done.completion_tokens == 5
    assert lease(store, s, ask(), now + 14, CONFIG).leases == []
    (stats,) = list_sites(store, now + 14)
    assert (stats.completions, stats.stale_completions, stats.wasted_tokens) == (1, 0, 0)


def test_waste_counts_only_work_thrown_away(store: Store) -> None:
    owner, s = tenant(store), site(store)
    now = time.time()
    rid = realtime(store, owner.id, "x", now)
    (held,) = lease(store, s, ask(), now, CONFIG).leases
    heartbeat(store, s, HeartbeatRequest(leases=[HeartbeatItem(
        request_id=rid, epoch=held.epoch,
        checkpoint=Checkpoint(choices=[ChoiceProgress(index=0, token_ids=[1, 2, 3])]))]),
        now, CONFIG)
    assert cancel_request(store, rid, now, "client left")
    # The request was cancelled: all of its tokens were generated for nothing, once (a resend
    # after a lost answer is the same work).
    answer = complete(store, s, success(rid, held.epoch, tokens=9), now, CONFIG)
    assert [r.reason for r in answer.rejected] == ["already_completed"]
    again = complete(store, s, success(rid, held.epoch, tokens=9), now, CONFIG)
    assert [r.reason for r in again.rejected] == ["already_completed"]
    (stats,) = list_sites(store, now)
    assert (stats.completions, stats.stale_completions, stats.wasted_tokens) == (0, 1, 9)


def test_concurrent_leasing_from_two_control_planes_never_double_leases(
        store: Store, store_url: str) -> None:
    """Two stores on one database stand for two control-plane processes."""
    owner = tenant(store)
    sites = [site(store, f"s{i}") for i in range(4)]
    batch(store, owner, [chat_line(f"c{i}") for i in range(200)])
    other = open_store(store_url)
    granted: list[str] = []
    lock = threading.Lock()

    def drain(i: int) -> None:
        handle = store if i % 2 else other
        while True:
            got = lease(handle, sites[i], ask(capacity=7), time.time(), CONFIG).leases
            if not got:
                return
            with lock:
                granted.extend(g.request_id for g in got)

    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(drain, range(4)))
    finally:
        other.close()
    assert len(granted) == 200 and len(set(granted)) == 200
    with store.read() as conn:
        epochs = conn.execute(select(requests.c.epoch)).scalars().all()
    assert set(epochs) == {1}


def test_absurd_worker_numbers_do_not_break_the_store(store: Store) -> None:
    owner, s = tenant(store), site(store)
    now = time.time()
    rid = realtime(store, owner.id, "x", now)
    (held,) = lease(store, s, ask(capacity=2**62, tokens_per_s=float("inf")), now,
                    CONFIG).leases
    huge = CompleteRequest(results=[CompletionItem(
        request_id=rid, epoch=held.epoch, outcome="succeeded",
        choices=[ChoiceProgress(index=0, text="x")],
        usage={"prompt_tokens": 2**70, "completion_tokens": 2**70})])
    refused = complete(store, s, huge, now, CONFIG)
    assert [r.reason for r in refused.rejected] == ["usage_mismatch"]
    assert complete(store, s, success(rid, 2**70), now, CONFIG).rejected
    (stats,) = list_sites(store, now)
    assert stats.usage_rejections == 1


def test_a_sessions_turn_goes_to_the_site_that_reported_it_and_cached_tokens_bill_less(
        store: Store) -> None:
    from minimill.control.prices import set_price
    from minimill.transport.protocol import session_tag

    owner = tenant(store)
    a, b = site(store, "a"), site(store, "b")
    now = time.time()
    # b's worker ran conv-1 before: it says so with its lease call (nothing queued yet).
    reported = ask(capacity=4).model_copy(update={"held_sessions": [session_tag("conv-1")]})
    assert lease(store, b, reported, now, CONFIG).leases == []
    # Long enough that 64 cached tokens are fewer than its prompt.
    turn = realtime(store, owner.id, "next turn " * 40, now + 0.1, prompt_cache_key="conv-1")
    plain = realtime(store, owner.id, "no session", now + 0.2)
    assert [g.request_id for g in lease(store, a, ask(), now + 0.3, CONFIG).leases] == [plain]
    (held,) = lease(store, b, ask(), now + 0.4, CONFIG).leases
    assert held.request_id == turn and held.session_key == "conv-1"
    set_price(store, MODEL, "realtime", 10.0, 20.0, cached_input_usd_per_mtok=1.0)
    done = success(turn, held.epoch, tokens=2)
    done.results[0].usage = Usage(prompt_tokens=100, completion_tokens=2, cached_tokens=64)
    assert complete(store, b, done, now + 0.5, CONFIG).accepted == [turn]
    record = get_request(store, owner.id, turn)
    assert record.cached_tokens == 64
    prompt = chat_prompt_tokens("next turn " * 40)
    assert record.prompt_tokens == prompt > 64
    assert record.billed_usd == pytest.approx(((prompt - 64) * 10.0 + 64 * 1.0 + 2 * 20.0) / 1e6)


def test_work_queued_after_the_queue_looked_empty_waits_for_a_call_that_sees_the_peers(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """On PostgreSQL each statement sees what committed before it: a batch's lines can commit
    between a lease call's "anything queued?" (no: only the asking site is read) and its read
    of the queue. Placing them then would place them without the peers, and a dear site would
    take what a cheaper one with room should get; they wait for the next call instead."""
    owner = tenant(store)
    cheap, dear = site(store, "cheap", 0.05), site(store, "dear", 0.50)
    now = time.time()
    assert lease(store, cheap, ask(), now, CONFIG).leases == []  # cheap has room, and said so
    batch(store, owner, [chat_line("a"), chat_line("b")], now=now)
    monkeypatch.setattr(lease_queue, "any_queued", lambda conn: False)  # committed just after
    assert lease(store, dear, ask(), now + 0.1, CONFIG).leases == []
    monkeypatch.undo()
    assert lease(store, dear, ask(), now + 0.2, CONFIG).leases == []  # the cheap site's work
    assert len(lease(store, cheap, ask(), now + 0.3, CONFIG).leases) == 2


def test_with_a_long_queue_a_site_beside_an_equal_peer_fills_its_room(store: Store) -> None:
    """A lease call reads the queue only as far as the asking site's own room (no peer goes
    before it); the equal peer's room is counted past it, so its fair share of a long queue
    is all it has room for, not half of what it read."""
    owner = tenant(store)
    left, right = site(store, "left"), site(store, "right")
    now = time.time()
    assert lease(store, right, ask(capacity=4), now, CONFIG).leases == []  # room, said so
    batch(store, owner, [chat_line(f"l{i}") for i in range(20)], now=now)
    assert len(lease(store, left, ask(capacity=4), now + 0.1, CONFIG).leases) == 4
    assert len(lease(store, right, ask(capacity=4), now + 0.2, CONFIG).leases) == 4


def test_a_short_queue_is_shared_with_an_equal_peer(store: Store) -> None:
    owner = tenant(store)
    left, right = site(store, "left"), site(store, "right")
    now = time.time()
    assert lease(store, right, ask(capacity=4), now, CONFIG).leases == []
    batch(store, owner, [chat_line(f"l{i}") for i in range(6)], now=now)
    # Its share of the six, in proportion to the room of each: three; the rest is the peer's.
    assert len(lease(store, left, ask(capacity=4), now + 0.1, CONFIG).leases) == 3
    assert len(lease(store, right, ask(capacity=4), now + 0.2, CONFIG).leases) == 3
