"""The store's schema: one SQLAlchemy Core table per kind of state, portable SQLite/PostgreSQL.

Times are Unix seconds (double precision) from the control plane's clock. JSON columns hold
OpenAI bodies, checkpoints and results as sent. Secrets (API keys, site tokens) are stored only
as SHA-256 hashes.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Dialect,
    Double,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Table,
    TypeDecorator,
    text,
)
from sqlalchemy import String as _String
from sqlalchemy import Text as _Text

metadata = MetaData()


class String(TypeDecorator[str]):
    """VARCHAR that only sends what both backends can store: no NUL (PostgreSQL text cannot
    hold one) and no lone surrogates (not UTF-8). An id or name carrying them (from a fuzzer,
    say) must be "not found", never a server error."""

    impl = _String
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        if not isinstance(value, str):
            return value
        if "\x00" in value:
            value = value.replace("\x00", "\ufffd")
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                value = value.encode("utf-8", "replace").decode("utf-8")
        return value


class Text(String):
    impl = _Text
    cache_ok = True

# SQLite only autoincrements an INTEGER PRIMARY KEY (the rowid); PostgreSQL wants a bigint.
SeqType = BigInteger().with_variant(Integer(), "sqlite")

tenants = Table(
    "tenants", metadata,
    Column("id", String(40), primary_key=True),
    Column("name", String(200), nullable=False, unique=True),
    Column("created_at", Double, nullable=False),
)

api_keys = Table(
    "api_keys", metadata,
    Column("id", String(40), primary_key=True),
    Column("tenant_id", String(40), nullable=False, index=True),
    Column("key_hash", String(64), nullable=False, unique=True),
    Column("created_at", Double, nullable=False),
)

files = Table(
    "files", metadata,
    Column("id", String(40), primary_key=True),
    Column("tenant_id", String(40), nullable=False),
    Column("purpose", String(40), nullable=False),
    Column("filename", String(500), nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("created_at", Double, nullable=False),
    # "writing" while its chunks are written, each in its own short transaction (invisible to
    # clients; the janitor removes one whose writer died); "processed" once complete.
    Column("status", String(20), nullable=False, server_default=text("'processed'")),
    # When the janitor deletes it (None: kept until deleted).
    Column("expires_at", Double),
    Index("ix_files_tenant_created", "tenant_id", "created_at"),
    Index("ix_files_expires", "expires_at"),
    Index("ix_files_status_created", "status", "created_at"),
)

# File contents in chunks, so that a 200 MB file is neither one huge value nor read at once.
# Every chunk but a file's last holds exactly files.CHUNK_BYTES (offsets map to chunks).
file_chunks = Table(
    "file_chunks", metadata,
    Column("file_id", String(40), primary_key=True),
    Column("seq", Integer, primary_key=True, autoincrement=False),
    Column("data", LargeBinary, nullable=False),
)

batches = Table(
    "batches", metadata,
    Column("id", String(40), primary_key=True),
    Column("tenant_id", String(40), nullable=False),
    Column("endpoint", String(100), nullable=False),
    Column("input_file_id", String(40), nullable=False),
    Column("completion_window", String(20), nullable=False),
    Column("status", String(20), nullable=False, index=True),
    Column("created_at", Double, nullable=False),
    Column("expires_at", Double, nullable=False),
    Column("in_progress_at", Double),
    Column("finalizing_at", Double),
    Column("completed_at", Double),
    Column("failed_at", Double),
    Column("expired_at", Double),
    Column("cancelling_at", Double),
    Column("cancelled_at", Double),
    # What finalizing turns into: completed, expired or cancelled.
    Column("end_status", String(20)),
    # When a janitor last started writing the output files (another may retry after a while).
    Column("finalize_claimed_at", Double),
    # Ingest of the input file (status validating), in short transactions: who holds it and
    # when it last committed, and how far it got (bytes of the input file, its last line).
    Column("ingest_claim", String(40)),
    Column("ingest_claimed_at", Double),
    Column("ingest_offset", BigInteger, nullable=False, server_default=text("0")),
    Column("ingest_line", Integer, nullable=False, server_default=text("0")),
    # Seconds the output and error files live (None: the server's default).
    Column("output_expires_after_s", Double),
    Column("output_file_id", String(40)),
    Column("error_file_id", String(40)),
    Column("errors", JSON),
    Column("metadata", JSON),
    Index("ix_batches_tenant_created", "tenant_id", "created_at"),
)

requests = Table(
    "requests", metadata,
    # Insertion order: FIFO within a tier.
    Column("seq", SeqType, primary_key=True, autoincrement=True),
    Column("id", String(40), nullable=False, unique=True),
    Column("tenant_id", String(40), nullable=False),
    Column("batch_id", String(40)),
    Column("custom_id", Text),
    Column("line_no", Integer),
    Column("kind", String(20)),
    Column("tier", String(20), nullable=False),
    Column("model", String(200)),
    Column("body", JSON),
    Column("seed", BigInteger, nullable=False),
    # Most tokens the request may generate (None: up to the context); placement estimates with it.
    Column("max_tokens", Integer),
    Column("stream", Boolean, nullable=False, default=False),
    Column("status", String(20), nullable=False),
    # Fencing epoch: bumped by every lease; heartbeats and completions must carry the current one.
    Column("epoch", Integer, nullable=False, default=0),
    Column("lease_id", String(40)),
    Column("site_id", String(40)),
    Column("lease_expires_at", Double),
    Column("attempts", Integer, nullable=False, default=0),
    # Bumped on every checkpoint and state change, so watchers notice progress cheaply.
    Column("version", Integer, nullable=False, default=0),
    # Lengths of the stored checkpoint per choice (its contents are in checkpoint_chunks), so
    # a delta is length-checked without reading what it extends; None once terminal.
    Column("progress", JSON),
    # Tokens the stored checkpoint holds, and what it held when the current lease was granted
    # (the work a successor kept of a stale lease's).
    Column("checkpoint_tokens", Integer, nullable=False, server_default=text("0")),
    Column("lease_base_tokens", Integer, nullable=False, server_default=text("0")),
    # The last epoch whose rejected result was counted as waste (a resend is not counted again).
    Column("wasted_epoch", Integer),
    Column("result", JSON),
    Column("error", JSON),
    Column("prompt_tokens", Integer, nullable=False, default=0),
    Column("completion_tokens", Integer, nullable=False, default=0),
    Column("cost_usd", Double, nullable=False, default=0.0),
    Column("created_at", Double, nullable=False),
    Column("leased_at", Double),
    Column("finished_at", Double),
    Column("deadline", Double, nullable=False),
    Index("ix_requests_queue", "status", "tier", "deadline", "seq"),
    Index("ix_requests_batch", "batch_id", "status"),
    # One row per input line, whatever happens to an ingest (output is written in this order).
    Index("ux_requests_batch_line", "batch_id", "line_no", unique=True),
    Index("ix_requests_lease_expiry", "status", "lease_expires_at"),
    Index("ix_requests_site", "site_id", "status"),
)

# A checkpoint as appended pieces: each accepted heartbeat adds one row holding what is new
# per choice (with the lengths it extends); a full checkpoint replaces the request's rows.
# Dropped when the request ends (its result is in requests.result).
checkpoint_chunks = Table(
    "checkpoint_chunks", metadata,
    Column("request_id", String(40), primary_key=True),
    Column("seq", Integer, primary_key=True, autoincrement=False),
    Column("data", JSON, nullable=False),
)

sites = Table(
    "sites", metadata,
    Column("id", String(40), primary_key=True),
    Column("name", String(200), nullable=False, unique=True),
    Column("token_hash", String(64), nullable=False, unique=True),
    Column("chip", String(100), nullable=False),
    Column("price_per_hour", Double, nullable=False),
    # Busy output tokens/s (see sites.touch_site), as its worker measured it.
    Column("tokens_per_s", Double),
    Column("created_at", Double, nullable=False),
    Column("first_seen_at", Double),
    Column("last_seen_at", Double),
    # Seconds the site was observed up (contact gaps shorter than the lease TTL count as up).
    Column("up_s", Double, nullable=False, default=0.0),
    # What its worker said in its last lease call (free capacity less what it was granted,
    # when, and the models it serves): placement's view of the peers of an asking site.
    Column("free_capacity", Integer, nullable=False, default=0),
    Column("capacity_at", Double),
    Column("models", JSON),
    Column("leases_granted", BigInteger, nullable=False, default=0),
    Column("leases_expired", BigInteger, nullable=False, default=0),
    Column("completions", BigInteger, nullable=False, default=0),
    Column("stale_completions", BigInteger, nullable=False, default=0),
    # Tokens generated and then discarded (stale completions, less what a checkpoint kept).
    Column("wasted_tokens", BigInteger, nullable=False, default=0),
    Column("tokens_generated", BigInteger, nullable=False, default=0),
)

outages = Table(
    "outages", metadata,
    Column("id", SeqType, primary_key=True, autoincrement=True),
    Column("site_id", String(40), nullable=False, index=True),
    Column("start_at", Double, nullable=False),
    Column("end_at", Double, nullable=False),
    Column("created_at", Double, nullable=False),
)
