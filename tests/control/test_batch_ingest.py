"""Batch input parsing: unusable files fail whole, bad lines fail alone; ingest speed."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from control_factory import CONFIG, MODEL, chat_line, tenant

from minimill.control.batch_ingest import UnusableFileError, parse_batch_file
from minimill.control.batch_load import ingest_pending
from minimill.control.batches import create_batch, get_batch
from minimill.control.files import create_file
from minimill.control.records import BatchStatus
from minimill.control.store import open_store

CHAT = "/v1/chat/completions"


def parse(text: str | bytes, max_lines: int = 100) -> list[tuple[str | None, str | None]]:
    data = text.encode() if isinstance(text, str) else text
    return [(p.custom_id, p.error.code if p.error else None)
            for p in parse_batch_file(data, CHAT, (MODEL,), max_lines)]


def test_bad_lines_fail_alone() -> None:
    lines = [chat_line("ok"), "{", json.dumps([1]), json.dumps({"method": "POST"}),
             chat_line("ok", "again"),
             json.dumps({"custom_id": "get", "method": "GET", "url": CHAT, "body": {}}),
             json.dumps({"custom_id": "url", "method": "POST", "url": "/v1/completions",
                         "body": {}}),
             chat_line("model", model="nope"), chat_line("params", n=0),
             json.dumps({"custom_id": "nobody", "method": "POST", "url": CHAT}),
             chat_line("stream", stream=True), "", "   ", chat_line("fine\r")]
    assert parse("\r\n".join(lines)) == [
        ("ok", None), (None, "invalid_json"), (None, "invalid_json"),
        (None, "missing_custom_id"), ("ok", "duplicate_custom_id"), ("get", "invalid_method"),
        ("url", "invalid_url"), ("model", "model_not_found"), ("params", "invalid_request"),
        ("nobody", "invalid_request"), ("stream", "invalid_request"), ("fine\r", None)]


@pytest.mark.parametrize(("data", "code", "line"), [
    (b"", "empty_file", None),
    (b"\n  \n", "empty_file", None),
    (b"plain text\nnot json\n", "invalid_file", None),
    (b'{"custom_id": "a"}\n\xc3\x28\n', "invalid_encoding", 2),
    ("\n".join(chat_line(f"c{i}") for i in range(101)).encode(), "too_many_lines", 101),
])
def test_unusable_files(data: bytes, code: str, line: int | None) -> None:
    with pytest.raises(UnusableFileError) as info:
        parse(data)
    assert info.value.errors[0].code == code and info.value.errors[0].line == line


def test_not_jsonl_lists_the_bad_lines() -> None:
    with pytest.raises(UnusableFileError) as info:
        parse("a\nb\nc")
    assert [e.line for e in info.value.errors[1:]] == [1, 2, 3]


def test_ingest_of_20000_lines_on_sqlite_queues_them_all(tmp_path: Path) -> None:
    # Its speed is a benchmark figure (`bench batch` prints ingest lines/s beside its target),
    # not a timed test: a loaded machine must not fail the suite.
    store = open_store(f"sqlite:///{tmp_path / 'ingest.db'}")
    try:
        owner = tenant(store)
        n = 20_000
        text = "\n".join(chat_line(f"c{i}", f"Tell me about the number {i}, briefly.",
                                   temperature=0.7) for i in range(n))
        f = create_file(store, owner.id, "batch", "big.jsonl", [text.encode()])
        created = create_batch(store, owner.id, f.id, CHAT, "24h", None, CONFIG)
        assert created.status == BatchStatus.VALIDATING
        assert ingest_pending(store, time.time(), CONFIG) == 1
        b = get_batch(store, owner.id, created.id)
    finally:
        store.close()
    assert b.status == BatchStatus.IN_PROGRESS and b.counts.total == n
