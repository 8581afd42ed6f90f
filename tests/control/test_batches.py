"""Batch lifecycle on a real store: ingest, finalize, cancel, expire, exactly-once files."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from control_factory import (
    CONFIG,
    ask,
    batch,
    chat_line,
    chat_prompt_tokens,
    site,
    success,
    tenant,
)

from minimill.control.batch_finalize import finalize, finishable
from minimill.control.batches import cancel_batch, get_batch, list_batches, parse_window
from minimill.control.errors import ConflictError, InvalidRequestError, NotFoundError
from minimill.control.files import read_content
from minimill.control.janitor import tick
from minimill.control.leases import complete, lease
from minimill.control.records import BatchStatus
from minimill.control.store import Store


def lines_of(store: Store, tenant_id: str, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(x) for x in read_content(store, tenant_id, file_id).splitlines()]


def test_ingest_finalize_output_and_error_files(store: Store) -> None:
    owner, s = tenant(store), site(store)
    b = batch(store, owner, [chat_line("a", "one"), "oops", chat_line("b", "two"),
                             chat_line("a", "dup")])
    assert b.status == BatchStatus.IN_PROGRESS and b.in_progress_at is not None
    assert (b.counts.total, b.counts.completed, b.counts.failed) == (4, 0, 2)
    now = time.time()
    for held in lease(store, s, ask(), now, CONFIG).leases:
        assert complete(store, s, success(held.request_id, held.epoch,
                                          held.body["messages"][0]["content"]), now,
                        CONFIG).accepted
    report = tick(store, now, CONFIG)
    assert report.finalized_batches == 1
    done = get_batch(store, owner.id, b.id)
    assert done.status == BatchStatus.COMPLETED and done.completed_at is not None
    assert (done.counts.completed, done.counts.failed) == (2, 2)
    assert done.usage.completion_tokens == 4
    prompt = chat_prompt_tokens("one") + chat_prompt_tokens("two")
    assert done.usage.prompt_tokens == prompt
    assert done.usage.billed_usd == pytest.approx((prompt * 0.10 + 4 * 0.40) / 1e6 * 0.5)
    out = lines_of(store, owner.id, done.output_file_id)
    err = lines_of(store, owner.id, done.error_file_id)
    assert [(o["custom_id"], o["response"]["body"]["choices"][0]["message"]["content"])
            for o in out] == [("a", "one"), ("b", "two")]
    assert [(e["custom_id"], e["error"]["code"]) for e in err] == [
        (None, "invalid_json"), ("a", "duplicate_custom_id")]
    assert tick(store, now, CONFIG).finalized_batches == 0


def test_finalize_is_claimed_once(store: Store) -> None:
    owner = tenant(store)
    b = batch(store, owner, ["not json"] * 2 + [chat_line("x", model="unknown-model")])
    now = time.time()
    assert finishable(store, now, 300) == [b.id]
    assert finalize(store, b.id, now, 300)
    assert not finalize(store, b.id, now, 300)
    done = get_batch(store, owner.id, b.id)
    assert done.status == BatchStatus.COMPLETED and done.output_file_id is None
    assert len(lines_of(store, owner.id, done.error_file_id)) == 3


def test_cancel_keeps_finished_results(store: Store) -> None:
    owner, s = tenant(store), site(store)
    b = batch(store, owner, [chat_line(f"c{i}") for i in range(6)])
    now = time.time()
    held = lease(store, s, ask(capacity=3), now, CONFIG).leases
    complete(store, s, success(held[0].request_id, held[0].epoch), now, CONFIG)
    cancelling = cancel_batch(store, owner.id, b.id, now=now)
    assert cancelling.status == BatchStatus.CANCELLING and cancelling.cancelling_at == now
    late = complete(store, s, success(held[1].request_id, held[1].epoch), now, CONFIG)
    assert late.rejected[0].reason == "already_completed"
    tick(store, now, CONFIG)
    done = get_batch(store, owner.id, b.id)
    assert done.status == BatchStatus.CANCELLED and done.finalizing_at is None
    assert [o["custom_id"] for o in lines_of(store, owner.id, done.output_file_id)] == ["c0"]
    errors = lines_of(store, owner.id, done.error_file_id)
    assert len(errors) == 5 and {e["error"]["code"] for e in errors} == {
        "batch_cancelled"}
    assert cancel_batch(store, owner.id, b.id).status == BatchStatus.CANCELLED
    with pytest.raises(NotFoundError):
        cancel_batch(store, tenant(store, "other").id, b.id)


def test_finished_batches_cannot_be_cancelled(store: Store) -> None:
    owner = tenant(store)
    b = batch(store, owner, ["bad line"])
    tick(store, time.time(), CONFIG)
    with pytest.raises(ConflictError):
        cancel_batch(store, owner.id, b.id)


def test_window_expiry_expires_unfinished_lines(store: Store) -> None:
    owner, s = tenant(store), site(store)
    start = time.time()
    b = batch(store, owner, [chat_line(f"e{i}") for i in range(3)], now=start)
    held = lease(store, s, ask(capacity=2), start, CONFIG).leases
    complete(store, s, success(held[0].request_id, held[0].epoch), start, CONFIG)
    later = start + 24 * 3600 + 1
    report = tick(store, later, CONFIG)
    assert report.expired_batches == 1 and report.finalized_batches == 1
    done = get_batch(store, owner.id, b.id)
    assert done.status == BatchStatus.EXPIRED and done.expired_at == later
    assert len(lines_of(store, owner.id, done.output_file_id)) == 1
    errors = lines_of(store, owner.id, done.error_file_id)
    assert [e["error"]["code"] for e in errors] == ["batch_expired"] * 2
    assert complete(store, s, success(held[1].request_id, held[1].epoch), later,
                    CONFIG).rejected


def test_lines_past_the_window_are_not_leased_but_expire(store: Store) -> None:
    """A site asking after the window ended, before the janitor's next round, gets nothing:
    the batch expires, it does not complete late."""
    owner, s = tenant(store), site(store)
    start = time.time()
    b = batch(store, owner, [chat_line(f"late{i}") for i in range(2)], now=start)
    later = start + 24 * 3600 + 1
    assert lease(store, s, ask(capacity=4), later, CONFIG).leases == []
    tick(store, later, CONFIG)
    done = get_batch(store, owner.id, b.id)
    assert done.status == BatchStatus.EXPIRED and done.output_file_id is None
    errors = lines_of(store, owner.id, done.error_file_id)
    assert [e["error"]["code"] for e in errors] == ["batch_expired"] * 2


def test_list_pagination_and_isolation(store: Store) -> None:
    owner, other = tenant(store), tenant(store, "other")
    made = [batch(store, owner, ["x"], now=1000.0 + i).id for i in range(5)]
    page, more = list_batches(store, owner.id, limit=2)
    assert [b.id for b in page] == made[::-1][:2] and more
    page2, _ = list_batches(store, owner.id, after=page[-1].id, limit=10)
    assert [b.id for b in page2] == made[::-1][2:]
    assert list_batches(store, other.id) == ([], False)
    with pytest.raises(NotFoundError):
        get_batch(store, other.id, made[0])


def test_completion_windows() -> None:
    assert parse_window("24h") == 86400 and parse_window("7d") == 7 * 86400
    for bad in ("1h", "23h", "24", "forever", "400d"):
        with pytest.raises(InvalidRequestError):
            parse_window(bad)
