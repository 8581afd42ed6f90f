"""The janitor's lock: on PostgreSQL one holder at a time, passed on when its holder lets go
or its connection dies; on SQLite every process ticks."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text

from minimill.control.janitor_lock import JanitorLock
from minimill.control.store import open_store


@pytest.mark.postgres
def test_one_holder_at_a_time_and_the_lock_moves_on(pg_url: str) -> None:
    stores = [open_store(pg_url) for _ in range(3)]
    locks = [JanitorLock(s) for s in stores]
    try:
        assert [lock.held() for lock in locks] == [True, False, False]
        assert locks[0].held()  # a holder keeps it, tick after tick
        assert not locks[1].held()
        locks[0].release()
        assert locks[1].held()
        assert not locks[0].held() and not locks[2].held()
        # The holder's connection cut by the server (a dead process's, as PostgreSQL sees it):
        # the lock is gone with it and the holder knows it has lost it. (The call waits up to
        # 10 s for the backend to exit: its locks go when it does, not when it is signalled.)
        with stores[2].read() as conn:
            assert conn.execute(text(
                "SELECT bool_and(pg_terminate_backend(pid, 10000)) FROM pg_stat_activity "
                "WHERE application_name LIKE 'minimill janitor %'")).scalar()
        assert not locks[1].held()
        assert locks[2].held()
    finally:
        for lock, store in zip(locks, stores, strict=True):
            lock.release()
            store.close()


def test_every_process_ticks_on_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'm.db'}"
    stores = [open_store(url) for _ in range(2)]
    try:
        assert all(JanitorLock(s).held() for s in stores)
    finally:
        for store in stores:
            store.close()
