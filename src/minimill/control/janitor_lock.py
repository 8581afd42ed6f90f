"""Which control-plane process runs the janitor's ticks: one at a time on a shared store.

Every janitor step is a conditional UPDATE, so two processes ticking at once lose nothing; but
K processes of `serve --workers K` (or K hosts behind a load balancer) would each scan the same
tables every fraction of a second for work one of them does. On PostgreSQL the process that
holds a session advisory lock ticks and the others skip their ticks: the lock is held by a
connection of its own, so a process that dies (SIGKILL included) lets it go the moment its
connection closes, and another process takes it at its next tick. On SQLite every process
ticks (one file, usually one process; its writers queue anyway).
"""

from __future__ import annotations

import logging
import os

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from minimill.control.store import Store

log = logging.getLogger("minimill.janitor")
# Any constant shared by every process, apart from the schema's (store.py).
JANITOR_LOCK_KEY = 0x6D6D6A616E69746F
# The lock's connection's application_name, followed by the process id.
JANITOR_APPLICATION = "minimill janitor"


class JanitorLock:
    """`held()` says whether this process runs the janitor's tick now, taking the lock if it
    is free. Not thread-safe: one janitor task owns it."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._conn: Connection | None = None

    def held(self) -> bool:
        if not self._store.is_postgres:
            return True
        try:
            if self._conn is not None:
                # The server may have closed the connection (restarted, or cut us off): then
                # the lock is gone with it, and another process may hold it now.
                self._conn.exec_driver_sql("SELECT 1")
                return True
            conn = self._store.engine.connect()
            # Autocommit: a session lock, not a transaction left open for hours.
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            taken = conn.exec_driver_sql(
                f"SELECT pg_try_advisory_lock({JANITOR_LOCK_KEY})").scalar()
            if not taken:
                conn.close()
                return False
            # Which process ticks shows in pg_stat_activity (an operator's, or a test's, look).
            conn.exec_driver_sql(f"SET application_name = '{JANITOR_APPLICATION} {os.getpid()}'")
            self._conn = conn
            log.info("this process runs the janitor now")
            return True
        except DBAPIError:
            self.release()
            return False

    def release(self) -> None:
        """Let another process take it: unlocked before the connection closes, so that it is
        free when this returns (a closed connection's backend drops its locks only once it has
        exited, a moment after the client has gone)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            conn.exec_driver_sql(f"SELECT pg_advisory_unlock({JANITOR_LOCK_KEY})")
        except SQLAlchemyError:
            pass  # the connection is gone (or broken), and the lock with it
        try:
            conn.invalidate()  # never back to the pool, whatever it still holds
            conn.close()
        except DBAPIError:
            pass
