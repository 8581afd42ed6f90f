"""Opening the store: URLs, the default SQLite file under MINIMILL_HOME, WAL, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import inspect

from minimill.control.store import StoreError, default_url, normalize_url, open_store


def test_url_normalization() -> None:
    assert normalize_url("postgresql://u@h/db") == "postgresql+psycopg://u@h/db"
    assert normalize_url("postgres://u@h/db") == "postgresql+psycopg://u@h/db"
    assert normalize_url("postgresql+psycopg://u@h/db") == "postgresql+psycopg://u@h/db"
    assert normalize_url("sqlite:///x.db") == "sqlite:///x.db"
    with pytest.raises(StoreError):
        normalize_url("mysql://u@h/db")


def test_default_store_lives_under_minimill_home(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIMILL_HOME", str(tmp_path / "home"))
    assert default_url() == f"sqlite:///{tmp_path / 'home' / 'data' / 'minimill.db'}"
    store = open_store(None)
    try:
        with store.read() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
    finally:
        store.close()
    assert (tmp_path / "home" / "data" / "minimill.db").exists()


def test_schema_creation_is_idempotent(store_url: str) -> None:
    first, second = open_store(store_url), open_store(store_url)
    try:
        tables = set(inspect(first.engine).get_table_names())
        assert {"tenants", "api_keys", "files", "file_chunks", "batches", "requests", "sites",
                "outages"} <= tables
    finally:
        first.close()
        second.close()


def test_unreachable_server_is_a_clear_error() -> None:
    with pytest.raises(StoreError) as info:
        open_store("postgresql://nobody:secret@127.0.0.1:1/none?connect_timeout=2")
    assert "cannot open the store" in str(info.value) and "secret" not in str(info.value)


@pytest.mark.postgres
def test_deadlock_victims_are_rerun(pg_url: str) -> None:
    """A real PostgreSQL deadlock: the decorated operation is the victim and runs again."""
    import threading

    import psycopg

    from minimill.control.store import retry_conflicts
    from minimill.control.tables import tenants

    store = open_store(pg_url)
    try:
        with store.write() as conn:
            conn.execute(tenants.insert(), [{"id": "x", "name": "x", "created_at": 0.0},
                                            {"id": "y", "name": "y", "created_at": 0.0}])
        attempts: list[int] = []
        other = psycopg.connect(pg_url)
        other.execute("SET deadlock_timeout = '20s'")  # so the operation detects it first
        other.execute("UPDATE tenants SET created_at = 1 WHERE id = 'x'")
        locked_y = threading.Event()

        @retry_conflicts
        def operation() -> None:
            attempts.append(1)
            with store.write() as conn:
                conn.execute(tenants.update().where(tenants.c.id == "y").values(created_at=2.0))
                locked_y.set()
                conn.execute(tenants.update().where(tenants.c.id == "x").values(created_at=2.0))

        worker = threading.Thread(target=operation)
        worker.start()
        assert locked_y.wait(10)
        other.execute("UPDATE tenants SET created_at = 1 WHERE id = 'y'")  # closes the cycle
        other.commit()
        other.close()
        worker.join(30)
        assert len(attempts) == 2
        with store.read() as conn:
            assert set(conn.execute(tenants.select()).scalars()) == {"x", "y"}
            values = conn.execute(tenants.select().with_only_columns(tenants.c.created_at))
            assert set(values.scalars()) == {2.0}
    finally:
        store.close()
