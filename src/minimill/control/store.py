"""The store: a SQLAlchemy engine on SQLite (embedded default) or PostgreSQL, and transactions.

Domain modules call `store.write()` for a transaction that changes state and `store.read()` for
a consistent read. On SQLite a write transaction starts with `BEGIN IMMEDIATE`, so it holds the
write lock from its first read and never fails half-way on a busy snapshot; the busy timeout
makes concurrent writers (several processes included) wait instead of failing. Within a
process, SQLite writers also queue, first come first served with heartbeats ahead: SQLite's
busy handler polls with growing sleeps, so a steady stream of writers (an ingest, completions)
could otherwise starve one (a heartbeat) for seconds. On PostgreSQL the
domain code takes row locks (`FOR UPDATE SKIP LOCKED`) and makes every state transition a
conditional UPDATE, so several control-plane processes can share one database.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from sqlalchemy import JSON, Connection, Engine, Table, create_engine, event, inspect
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.schema import ScalarElementColumnDefault

from minimill.control.tables import metadata
from minimill.models.registry import minimill_home

SQLITE_BUSY_TIMEOUT_S = 30.0
# Connections a process keeps to its store (on PostgreSQL, at most): one per thread of the
# API's thread pool (anyio's 40) that is in a transaction.
POOL_CONNECTIONS = 40
# A write transaction longer than this is logged (on SQLite it holds up every other writer).
SLOW_WRITE_S = 1.0
# Any constant shared by every process: serializes concurrent schema creation on PostgreSQL.
_SCHEMA_LOCK_KEY = 0x6D696E696D696C6C


log = logging.getLogger("minimill.store")
P = ParamSpec("P")
R = TypeVar("R")
# PostgreSQL's deadlock_detected and serialization_failure: the transaction may simply rerun.
_RETRYABLE_SQLSTATES = {"40P01", "40001"}
MAX_ATTEMPTS = 4


class JsonText(str):
    """A JSON document already encoded: a JSON column stores it as it is. Large values a site
    sends (a completion's results) are encoded before the write transaction opens, so that
    SQLite's one write lock is not held while Python encodes megabytes."""


def json_dumps(value: Any) -> str:
    """The store's JSON encoder (both backends): JsonText as it is, anything else encoded."""
    return str(value) if isinstance(value, JsonText) else json.dumps(value)


def retry_conflicts(fn: Callable[P, R]) -> Callable[P, R]:
    """Rerun a whole write operation that PostgreSQL aborted as a deadlock victim (two bulk
    UPDATEs, e.g. a cancel and a completion, can lock the same rows in opposite orders).
    The operation must be one transaction, so a rerun starts from a clean slate."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        for attempt in range(MAX_ATTEMPTS):
            try:
                return fn(*args, **kwargs)
            except DBAPIError as exc:
                state = getattr(exc.orig, "sqlstate", None)
                if state not in _RETRYABLE_SQLSTATES or attempt + 1 == MAX_ATTEMPTS:
                    raise
                time.sleep(0.01 * 2**attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    return wrapper


class StoreError(Exception):
    """The store URL is unusable (unknown scheme, unreachable server): the message says which."""


def default_url() -> str:
    """SQLite file under MINIMILL_HOME/data (the directory is created)."""
    data = minimill_home() / "data"
    data.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{data / 'minimill.db'}"


def normalize_url(url: str) -> str:
    """Accept `postgresql://` (and `postgres://`) and pick the psycopg 3 driver for it."""
    for prefix in ("postgresql://", "postgres://", "postgresql+psycopg2://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    if url.startswith(("postgresql+psycopg://", "sqlite://")):
        return url
    raise StoreError(f"unsupported store URL {url!r}: use sqlite:///PATH or postgresql://...")


def insert_many(conn: Connection, table: Table, rows: list[dict[str, Any]]) -> None:
    """Insert rows that all have the first row's keys, as one executemany of the driver.

    What `conn.execute(insert(table), rows)` does, without SQLAlchemy building and processing
    every row's parameters in Python: for a batch's ingest that was a fifth of its time
    (py-spy), as much as the database's own work. Values go to the driver as they are, but
    JSON columns' as text, encoded as SQLAlchemy encodes them (None as JSON null). A column
    absent from the rows takes its default, as with `insert`: a scalar Python-side one is
    added to every row here, a server-side one is the database's."""
    if not rows:
        return
    given = list(rows[0])
    dumps = json_dumps
    as_json = [isinstance(table.c[name].type, JSON) for name in given]
    defaults: dict[str, Any] = {}  # the same for every row: encoded once
    for column in table.c:
        if column.name not in rows[0] and isinstance(column.default,
                                                     ScalarElementColumnDefault):
            value = column.default.arg
            defaults[column.name] = dumps(value) if isinstance(column.type, JSON) else value
    columns = given + list(defaults)
    default_values = tuple(defaults.values())
    quote = conn.dialect.identifier_preparer.quote
    mark = "?" if conn.dialect.paramstyle == "qmark" else "%s"
    sql = (f"INSERT INTO {quote(table.name)} ({', '.join(quote(c) for c in columns)}) "
           f"VALUES ({', '.join([mark] * len(columns))})")
    conn.exec_driver_sql(sql, [tuple(dumps(row[name]) if encode else row[name]
                                     for name, encode in zip(given, as_json, strict=True))
                               + default_values for row in rows])


def _sqlite_engine(url: str) -> Engine:
    path = make_url(url).database
    if path and path != ":memory:":
        Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
    # As many kept connections as the API's thread pool has threads in transactions
    # (POOL_CONNECTIONS): with 8 kept, a thousand sites' calls opened and closed connections
    # beyond them all the time (each open runs the pragmas below), a tenth of serve's CPU.
    engine = create_engine(
        url, pool_size=POOL_CONNECTIONS, max_overflow=16, pool_timeout=60,
        json_serializer=json_dumps,
        connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Take over transaction control from the driver so BEGIN IMMEDIATE is possible.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        write = conn.get_execution_options().get("minimill_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def _add_missing(conn: Connection, name: str) -> None:
    """Add the columns and indexes `tables.py` has and an existing table lacks. New columns
    are nullable or carry a server default, so rows written before read as they should."""
    table = metadata.tables[name]
    found = inspect(conn)
    have = {c["name"] for c in found.get_columns(name)}
    preparer = conn.dialect.identifier_preparer
    for column in table.columns:
        if column.name in have:
            continue
        spec = f"{preparer.quote(column.name)} {column.type.compile(dialect=conn.dialect)}"
        default = getattr(column.server_default, "arg", None)
        if default is not None:
            spec += f" NOT NULL DEFAULT {getattr(default, 'text', default)}"
        conn.exec_driver_sql(f"ALTER TABLE {preparer.quote(name)} ADD COLUMN {spec}")
    indexes = {i["name"] for i in found.get_indexes(name)}
    for index in table.indexes:
        if index.name not in indexes:
            index.create(conn)


class _WriteQueue:
    """SQLite's one write lock, handed out in the order asked for, urgent askers first.

    The holder hands it straight to the next in line, waking that thread alone: a condition
    variable notified on every release woke every waiting thread (dozens under load) to find
    it was not its turn, and that cost more CPU than the transactions themselves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = False
        # A held lock per waiting thread, released to hand the write lock over.
        self._waiting: tuple[deque[threading.Lock], deque[threading.Lock]] = (deque(), deque())

    @contextmanager
    def hold(self, urgent: bool) -> Iterator[None]:
        gate: threading.Lock | None = None
        with self._lock:
            if self._busy:
                gate = threading.Lock()
                gate.acquire()
                self._waiting[0 if urgent else 1].append(gate)
            else:
                self._busy = True
        if gate is not None:
            gate.acquire()  # until the holder hands over (it stays busy meanwhile)
        try:
            yield
        finally:
            with self._lock:
                line = next((q for q in self._waiting if q), None)
                if line is None:
                    self._busy = False
                else:
                    line.popleft().release()


class Store:
    """Owns the engine; hands out transactions. Safe to share between threads."""

    def __init__(self, engine: Engine, url: str) -> None:
        self.engine = engine
        self.url = url
        # SQLite has one writer at a time anyway; PostgreSQL locks rows, not the database.
        self._writers = _WriteQueue() if engine.dialect.name == "sqlite" else None

    @property
    def dialect(self) -> str:
        """"sqlite" or "postgresql"."""
        return self.engine.dialect.name

    @property
    def is_postgres(self) -> bool:
        return self.dialect == "postgresql"

    @contextmanager
    def write(self, urgent: bool = False) -> Iterator[Connection]:
        """A transaction that may change state; commits on success, rolls back on error.
        `urgent` (heartbeats: a late one costs a lease) goes before other waiting writers."""
        with contextlib.ExitStack() as stack:
            if self._writers is not None:
                stack.enter_context(self._writers.hold(urgent))
            started = time.monotonic()
            conn = stack.enter_context(self.engine.connect())
            conn.execution_options(minimill_write=True)
            with conn.begin():
                yield conn
            held_s = time.monotonic() - started
            if held_s > SLOW_WRITE_S:
                # Every other writer waited this long (heartbeats included): say who it was.
                caller = [f"{f.name}:{f.lineno}" for f in traceback.extract_stack(limit=6)[:-2]]
                log.warning("a write transaction took %.2fs (%s)", held_s, " < ".join(
                    reversed(caller)))

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A read-only transaction (one consistent snapshot on both backends)."""
        with self.engine.connect() as conn, conn.begin():
            yield conn

    def create_schema(self) -> None:
        """Create missing tables, and the columns and indexes that a store made by an older
        version lacks; several processes may do this at once."""
        with self.write() as conn:
            if self.is_postgres:
                conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_SCHEMA_LOCK_KEY})")
            existing = set(inspect(conn).get_table_names())
            metadata.create_all(conn)
            for table in metadata.sorted_tables:
                if table.name in existing:
                    _add_missing(conn, table.name)

    def close(self) -> None:
        self.engine.dispose()


def open_store(url: str | None = None) -> Store:
    """Open (and create the tables of) the store at `url`; None: SQLite under MINIMILL_HOME."""
    url = normalize_url(url or default_url())
    if url.startswith("sqlite"):
        engine = _sqlite_engine(url)
    else:
        # Every connection the pool opens is kept (no overflow): an overflow connection is
        # closed when it comes back, and under a fleet's load (a transaction per call, in up
        # to 40 threads) the pool opened and closed one for most requests, each a new server
        # process forked by PostgreSQL (`bench control-plane`: ~800 sessions per 1,000
        # requests). Still at most POOL_CONNECTIONS per process, opened as they are needed.
        engine = create_engine(url, pool_size=POOL_CONNECTIONS, max_overflow=0,
                               pool_pre_ping=True, json_serializer=json_dumps)
    store = Store(engine, url)
    try:
        store.create_schema()
    except Exception as exc:
        store.close()
        raise StoreError(f"cannot open the store at {make_url(url).render_as_string()}: "
                         f"{exc}") from exc
    return store
