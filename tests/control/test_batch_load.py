"""Batch ingest and finalize on a real store, in short transactions: progress shows while a
batch validates, competing ingesters never queue a line twice, a cancel or a deleted input
file stops an ingest cleanly, and finalize streams its files (a losing finalizer leaves none)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import Counter
from typing import Any

import pytest
from control_factory import CONFIG, ask, chat_line, site, tenant
from sqlalchemy import func, insert, select

from minimill.control.batch_finalize import finalize
from minimill.control.batch_load import ingest_pending
from minimill.control.batches import cancel_batch, create_batch, get_batch
from minimill.control.files import CHUNK_BYTES, create_file, delete_file, read_content
from minimill.control.janitor import tick
from minimill.control.leases import complete, lease
from minimill.control.records import BatchRecord, BatchStatus, Tenant
from minimill.control.store import Store, insert_many, open_store
from minimill.control.tables import batches, files, requests
from minimill.transport.protocol import ChoiceProgress, CompleteRequest, CompletionItem, Usage

CHAT = "/v1/chat/completions"
SMALL_GROUPS = dataclasses.replace(CONFIG, ingest_group_lines=25)


def create(store: Store, owner: Tenant, text: str) -> BatchRecord:
    f = create_file(store, owner.id, "batch", "in.jsonl", [text.encode()])
    return create_batch(store, owner.id, f.id, CHAT, "24h", None, CONFIG)


def line_numbers(store: Store, batch_id: str) -> list[int]:
    with store.read() as conn:
        return list(conn.execute(select(requests.c.line_no)
                                 .where(requests.c.batch_id == batch_id)).scalars())


def test_progress_shows_while_a_batch_validates(store: Store) -> None:
    owner = tenant(store)
    b = create(store, owner, "\n".join(chat_line(f"p{i}") for i in range(600)))
    assert b.status == BatchStatus.VALIDATING and b.counts.total == 0
    seen: list[tuple[BatchStatus, int]] = []
    worker = threading.Thread(target=ingest_pending, args=(store, time.time(), SMALL_GROUPS))
    worker.start()
    while worker.is_alive():
        now = get_batch(store, owner.id, b.id)
        seen.append((now.status, now.counts.total))
    worker.join()
    done = get_batch(store, owner.id, b.id)
    assert done.status == BatchStatus.IN_PROGRESS and done.counts.total == 600
    partial = {total for status, total in seen if status == BatchStatus.VALIDATING}
    assert any(0 < total < 600 for total in partial), seen[:20]
    assert all(total % 25 == 0 for total in partial)  # whole groups, never half of one


def test_competing_ingesters_queue_every_line_once(store: Store, store_url: str) -> None:
    """Claims that go stale at once: two processes keep taking the batch from each other."""
    owner = tenant(store)
    lines = [chat_line(f"c{i}") if i % 7 else "not json" for i in range(1, 801)]
    lines[100] = chat_line("c5")  # a duplicate custom_id, found across groups
    b = create(store, owner, "\n".join(lines))
    racy = dataclasses.replace(SMALL_GROUPS, ingest_claim_ttl_s=0.0001)
    other = open_store(store_url)
    try:
        threads = [threading.Thread(target=ingest_pending, args=(s, time.time(), racy))
                   for s in (store, other, store)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        other.close()
    done = get_batch(store, owner.id, b.id)
    assert done.status == BatchStatus.IN_PROGRESS
    numbers = line_numbers(store, b.id)
    assert sorted(numbers) == list(range(1, 801))  # each line once
    with store.read() as conn:
        errors = Counter(e["code"] for e in conn.execute(
            select(requests.c.error).where(requests.c.batch_id == b.id,
                                           requests.c.error.is_not(None))).scalars())
    assert errors == {"invalid_json": 114, "duplicate_custom_id": 1}


def test_bad_lines_blank_lines_and_line_limit(store: Store) -> None:
    owner = tenant(store)
    limited = dataclasses.replace(CONFIG, max_line_bytes=300)
    text = "\r\n".join([chat_line("a"), "", "  ", chat_line("big", "x" * 400),
                        chat_line("b"), "{oops"]) + "\r\n"
    b = create(store, owner, text)
    ingest_pending(store, time.time(), limited)
    with store.read() as conn:
        rows = {r.line_no: (r.custom_id, r.status, (r.error or {}).get("code")) for r in
                conn.execute(select(requests).where(requests.c.batch_id == b.id))}
    assert rows == {1: ("a", "queued", None), 4: (None, "failed", "line_too_large"),
                    5: ("b", "queued", None), 6: (None, "failed", "invalid_json")}


def test_cancel_while_validating_stops_the_ingest(store: Store) -> None:
    owner = tenant(store)
    b = create(store, owner, "\n".join(chat_line(f"x{i}") for i in range(50)))
    assert cancel_batch(store, owner.id, b.id).status == BatchStatus.CANCELLING
    ingest_pending(store, time.time(), SMALL_GROUPS)
    assert line_numbers(store, b.id) == []
    tick(store, time.time(), CONFIG)
    assert get_batch(store, owner.id, b.id).status == BatchStatus.CANCELLED


def test_a_deleted_input_file_fails_the_batch(store: Store) -> None:
    owner = tenant(store)
    b = create(store, owner, chat_line("only"))
    delete_file(store, owner.id, b.input_file_id)
    ingest_pending(store, time.time(), CONFIG)
    failed = get_batch(store, owner.id, b.id)
    assert failed.status == BatchStatus.FAILED and failed.errors is not None
    assert failed.errors[0]["code"] == "file_not_found" and failed.counts.total == 0


def answer(held: Any, text: str) -> CompleteRequest:
    return CompleteRequest(results=[CompletionItem(
        request_id=held.request_id, epoch=held.epoch, outcome="succeeded",
        choices=[ChoiceProgress(index=0, text=text, finish_reason="stop")],
        usage=Usage(prompt_tokens=1, completion_tokens=1))])


def test_finalize_streams_pages_and_chunks(store: Store) -> None:
    """1,100 lines (three pages) whose output (~5.5 MB) spans two file chunks."""
    owner, s = tenant(store), site(store)
    n = 1100
    text = "\n".join(chat_line(f"f{i:04d}", str(i)) if i % 10 else "bad" for i in range(n))
    b = create(store, owner, text)
    ingest_pending(store, time.time(), CONFIG)
    now = time.time()
    while held := lease(store, s, ask(capacity=256), now, CONFIG).leases:
        for h in held:
            complete(store, s, answer(h, h.body["messages"][0]["content"] * 5000), now, CONFIG)
    assert tick(store, now, CONFIG).finalized_batches == 1
    done = get_batch(store, owner.id, b.id)
    assert done.status == BatchStatus.COMPLETED
    assert done.output_file_id is not None and done.error_file_id is not None
    output = read_content(store, owner.id, done.output_file_id)
    assert len(output) > CHUNK_BYTES
    out = [json.loads(x) for x in output.splitlines()]
    assert [o["custom_id"] for o in out] == [f"f{i:04d}" for i in range(n) if i % 10]
    assert all(o["response"]["body"]["choices"][0]["message"]["content"] ==
               str(int(o["custom_id"][1:])) * 5000 for o in out)
    errors = read_content(store, owner.id, done.error_file_id).splitlines()
    assert len(errors) == n // 10
    with store.read() as conn:
        statuses = Counter(conn.execute(select(files.c.status)).scalars())
        expiry = conn.execute(select(files.c.expires_at, files.c.created_at)
                              .where(files.c.id == done.output_file_id)).one()
    assert statuses == {"processed": 3}
    assert expiry.expires_at == pytest.approx(expiry.created_at + CONFIG.file_expires_after_s)


def test_a_losing_finalizer_leaves_no_files(store: Store) -> None:
    owner = tenant(store)
    # Lines that fail alone (no custom_id): the batch only has an error file to write.
    b = create(store, owner, "\n".join('{"body": {}}' for _ in range(1200)))
    ingest_pending(store, time.time(), CONFIG)
    start = time.time()
    results: list[bool] = []
    # Claims go stale after 0.05 s: the second may take the batch while the first writes.
    threads = [threading.Thread(target=lambda d=d: results.append(
        finalize(store, b.id, start + d, 0.05))) for d in (0.0, 0.1, 0.2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == 1
    done = get_batch(store, owner.id, b.id)
    assert done.status == BatchStatus.COMPLETED and done.error_file_id is not None
    with store.read() as conn:
        kept = conn.execute(select(func.count()).select_from(files)).scalar_one()
        linked = conn.execute(select(batches.c.error_file_id)).scalar_one()
    assert kept == 2 and linked == done.error_file_id  # the input and one error file
    assert len(read_content(store, owner.id, done.error_file_id).splitlines()) == 1200



def test_insert_many_stores_what_sqlalchemy_would(store: Store) -> None:
    """The driver-level bulk insert of ingest: JSON columns encoded as SQLAlchemy encodes them
    (None as JSON null, not SQL NULL), absent columns given their defaults, other values as
    given, on both backends."""
    def row(n: int, body: Any) -> dict[str, Any]:
        # No epoch, attempts, version, token counts or price: their Python-side defaults.
        return {"id": f"req_bulk{n}", "tenant_id": "t", "tier": "background", "body": body,
                "seed": 2**40 + n, "stream": n % 2 == 0, "status": "queued",
                "created_at": 1.25, "deadline": 9.5, "error": None, "custom_id": f"é-{n}"}

    body = {"messages": [{"role": "user", "content": "x\u00e9\U0001f600"}], "n": 2}
    with store.write() as conn:
        insert_many(conn, requests, [row(0, body), row(1, None)])
        conn.execute(insert(requests), [row(2, body), row(3, None)])
    with store.read() as conn:
        got = {r.id: r._asdict() for r in conn.execute(select(requests))}
        null_bodies = set(conn.execute(select(requests.c.id).where(
            requests.c.body.is_(None))).scalars())
    differ = {"seq", "id", "seed", "stream", "custom_id"}  # by construction
    for mine, theirs in (("req_bulk0", "req_bulk2"), ("req_bulk1", "req_bulk3")):
        assert ({k: v for k, v in got[mine].items() if k not in differ}
                == {k: v for k, v in got[theirs].items() if k not in differ})
    assert got["req_bulk0"]["body"] == body and got["req_bulk0"]["seed"] == 2**40
    assert got["req_bulk0"]["stream"] is True and got["req_bulk1"]["stream"] is False
    assert got["req_bulk0"]["epoch"] == 0 and got["req_bulk0"]["billed_usd"] == 0.0
    assert null_bodies == set()  # JSON null on both paths
