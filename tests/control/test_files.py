"""Files on a real store: written and deleted in short transactions, expired by the janitor,
and nothing left behind by a writer that dies or an upload that is refused."""

from __future__ import annotations

import os
import time

import pytest
from control_factory import CONFIG, tenant
from sqlalchemy import func, select, update

from minimill.control.errors import NotFoundError, PayloadTooLargeError
from minimill.control.files import (
    CHUNK_BYTES,
    DELETING,
    FileWriter,
    chunks_from,
    create_file,
    delete_file,
    get_file,
    list_files,
    read_content,
    sweep,
)
from minimill.control.janitor import tick
from minimill.control.store import Store
from minimill.control.tables import file_chunks, files


def chunk_count(store: Store, file_id: str | None = None) -> int:
    query = select(func.count()).select_from(file_chunks)
    if file_id is not None:
        query = query.where(file_chunks.c.file_id == file_id)
    with store.read() as conn:
        return int(conn.execute(query).scalar_one())


def row_count(store: Store) -> int:
    with store.read() as conn:
        return int(conn.execute(select(func.count()).select_from(files)).scalar_one())


def test_large_file_round_trips_from_any_offset(store: Store) -> None:
    owner = tenant(store)
    data = os.urandom(2 * CHUNK_BYTES + 12345)
    pieces = [data[i:i + 1_000_003] for i in range(0, len(data), 1_000_003)]
    record = create_file(store, owner.id, "batch", "big.jsonl", pieces)
    assert record.bytes == len(data) and chunk_count(store, record.id) == 3
    assert read_content(store, owner.id, record.id) == data
    for offset in (0, 1, CHUNK_BYTES - 1, CHUNK_BYTES, 2 * CHUNK_BYTES + 5, len(data)):
        assert b"".join(chunks_from(store, record.id, offset)) == data[offset:]


def test_files_expire_and_the_janitor_deletes_them(store: Store) -> None:
    owner = tenant(store)
    keep = create_file(store, owner.id, "batch", "keep.jsonl", [b"k"])
    short = create_file(store, owner.id, "batch", "short.jsonl", [b"s" * 100],
                        expires_after_s=3600)
    assert keep.expires_at is None
    assert short.expires_at == pytest.approx(short.created_at + 3600)
    assert sweep(store, short.created_at + 3599, CONFIG.file_writing_ttl_s) == 0
    later = short.created_at + 3601
    # Past its expiry it is gone for clients at once, and the janitor deletes it.
    with pytest.raises(NotFoundError):
        get_file(store, owner.id, short.id, now=later)
    assert tick(store, later, CONFIG).deleted_files == 1
    assert chunk_count(store, short.id) == 0 and row_count(store) == 1
    assert [f.id for f in list_files(store, owner.id)[0]] == [keep.id]


def test_a_dead_writer_leaves_nothing_visible_and_is_cleaned_up(store: Store) -> None:
    owner = tenant(store)
    writer = FileWriter(store, owner.id, "batch_output", "half.jsonl", None)
    writer.write(b"x" * (CHUNK_BYTES + 10))  # one chunk written, the rest buffered
    assert chunk_count(store, writer.id) == 1
    with pytest.raises(NotFoundError):
        get_file(store, owner.id, writer.id)
    assert list_files(store, owner.id) == ([], False)
    # The writer's process died here. Within the TTL its file is left alone...
    assert sweep(store, time.time(), CONFIG.file_writing_ttl_s) == 0
    assert sweep(store, time.time() + CONFIG.file_writing_ttl_s + 1,
                 CONFIG.file_writing_ttl_s) == 1
    assert chunk_count(store) == 0 and row_count(store) == 0


def test_deletion_is_finished_by_the_janitor_after_a_crash(store: Store) -> None:
    owner = tenant(store)
    record = create_file(store, owner.id, "batch", "gone.jsonl", [b"g" * (CHUNK_BYTES + 1)])
    # A delete marks the file first; the process died before removing its chunks.
    with store.write() as conn:
        conn.execute(update(files).where(files.c.id == record.id).values(status=DELETING))
    with pytest.raises(NotFoundError):
        delete_file(store, owner.id, record.id)
    assert chunk_count(store, record.id) == 2
    assert sweep(store, time.time(), CONFIG.file_writing_ttl_s) == 1
    assert chunk_count(store) == 0 and row_count(store) == 0


def test_a_refused_upload_leaves_nothing(store: Store) -> None:
    owner = tenant(store)
    with pytest.raises(PayloadTooLargeError):
        create_file(store, owner.id, "batch", "big.jsonl",
                    [b"z" * CHUNK_BYTES, b"z" * CHUNK_BYTES], max_bytes=CHUNK_BYTES + 1)
    assert chunk_count(store) == 0 and row_count(store) == 0
    ok = create_file(store, owner.id, "batch", "ok.jsonl", [b"fine"])
    delete_file(store, owner.id, ok.id)
    assert chunk_count(store) == 0 and row_count(store) == 0
