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
    # Set for the key a runner gets with an agent's lease: it dies with that lease.
    Column("agent_id", String(40), index=True),
    # The key's first characters (keys.KEY_HINT_CHARS), so that an operator can name a key to
    # revoke by what its holder can read off it; None for keys made before it was kept.
    Column("hint", String(20), index=True),
    # When `minimill keys revoke` revoked it (None: live); a revoked key is refused at once.
    Column("revoked_at", Double),
)

# Operator keys reach the fleet (sites, outages, prices, keys); they belong to no tenant.
operator_keys = Table(
    "operator_keys", metadata,
    Column("id", String(40), primary_key=True),
    Column("key_hash", String(64), nullable=False, unique=True),
    Column("created_at", Double, nullable=False),
    Column("hint", String(20), index=True),  # as api_keys.hint
    Column("revoked_at", Double),  # as api_keys.revoked_at
)

# A tenant's own limits and settings, where they differ from the operator's defaults
# (tenant_limits.py): a JSON object whose keys are the TenantLimits fields it sets; a key set
# to null lifts that limit for the tenant, a key absent takes the default.
tenant_limits = Table(
    "tenant_limits", metadata,
    Column("tenant_id", String(40), primary_key=True),
    Column("overrides", JSON, nullable=False),
    Column("updated_at", Double, nullable=False),
)

# Per-tenant token buckets of the rate limits (rate_limits.py): how much of each limit was used,
# as of `updated_at`; use drains at the limit per minute, so a full bucket refills in a minute.
rate_buckets = Table(
    "rate_buckets", metadata,
    Column("tenant_id", String(40), primary_key=True),
    Column("requests_used", Double, nullable=False),
    Column("tokens_used", Double, nullable=False),
    Column("updated_at", Double, nullable=False),
)

# The operator's price list in $ per million tokens; model "*" is the default entry.
prices = Table(
    "prices", metadata,
    Column("model", String(200), primary_key=True),
    Column("tier", String(20), primary_key=True),
    Column("input_usd_per_mtok", Double, nullable=False),
    Column("cached_input_usd_per_mtok", Double, nullable=False),
    Column("output_usd_per_mtok", Double, nullable=False),
    Column("updated_at", Double, nullable=False),
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
    # When its rows' text (prompts, results, custom_ids) was cleared, once one of its files
    # was gone (retention.py); None: not yet.
    Column("rows_purged_at", Double),
    Column("output_file_id", String(40)),
    Column("error_file_id", String(40)),
    Column("errors", JSON),
    Column("metadata", JSON),
    Index("ix_batches_tenant_created", "tenant_id", "created_at"),
    # A file that goes finds the batches it belongs to (retention.py).
    Index("ix_batches_input_file", "input_file_id"),
    Index("ix_batches_output_file", "output_file_id"),
    Index("ix_batches_error_file", "error_file_id"),
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
    # Of the prompt tokens, those the engine served from its KV cache (None: none).
    Column("cached_tokens", Integer),
    # What the control plane counted when the request came in (prompt_count.py): the prompt's
    # tokens (an upper bound where the model has no tokenizer here: prompt_count_exact false)
    # and the choices a worker must return. Bills use these, never what a site reports.
    Column("counted_prompt_tokens", Integer),
    Column("prompt_count_exact", Boolean),
    Column("num_choices", Integer),
    # What the tenant is billed for it (the price list at completion; prices.billed_usd).
    Column("billed_usd", Double, nullable=False, default=0.0),
    Column("created_at", Double, nullable=False),
    Column("leased_at", Double),
    Column("finished_at", Double),
    Column("deadline", Double, nullable=False),
    # The conversation a request belongs to (a response chain's root id, or the client's
    # prompt_cache_key): what KV cache reuse and placement may group by. None: no session.
    Column("session_key", String(200)),
    # The client's Idempotency-Key (realtime calls): a retry with it waits for this request
    # instead of queueing another (a durable agent's new runner, say).
    Column("idempotency_key", String(500)),
    Index("ix_requests_queue", "status", "tier", "deadline", "seq"),
    # Each tenant's queue, for fair share between tenants (leases.py reads every tenant's head).
    Index("ix_requests_tenant_queue", "status", "tier", "tenant_id", "deadline", "seq"),
    Index("ix_requests_idempotency", "tenant_id", "idempotency_key"),
    Index("ix_requests_batch", "batch_id", "status"),
    # One row per input line, whatever happens to an ingest (output is written in this order).
    Index("ux_requests_batch_line", "batch_id", "line_no", unique=True),
    Index("ix_requests_lease_expiry", "status", "lease_expires_at"),
    Index("ix_requests_site", "site_id", "status"),
    # Batch lines whose prompt is not counted yet (prompt_count.count_uncounted).
    Index("ix_requests_uncounted", "counted_prompt_tokens", "num_choices"),
    # Realtime rows (no batch) by when they ended: what retention deletes.
    Index("ix_requests_batch_finished", "batch_id", "finished_at"),
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
    # The parts of the worker protocol its token reaches (records.SiteScope, comma-separated);
    # sites registered before scopes existed keep every part.
    Column("serves", String(40), nullable=False, server_default=text("'tokens,boxes,agents'")),
    Column("chip", String(100), nullable=False),
    Column("price_per_hour", Double, nullable=False),
    # Hourly $/h the site's price follows (price_schedule.PriceSchedule.to_json), or null.
    Column("price_schedule", JSON),
    # Busy output tokens/s as its worker reports it (see sites.touch_site): placement's prior.
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
    # session_tag()s of the sessions whose KV its worker said it holds (placement affinity).
    Column("held_sessions", JSON),
    Column("leases_granted", BigInteger, nullable=False, default=0),
    Column("leases_expired", BigInteger, nullable=False, default=0),
    Column("completions", BigInteger, nullable=False, default=0),
    Column("stale_completions", BigInteger, nullable=False, default=0),
    # Completions rejected because their usage report disagreed with what they returned
    # (usage_check.py): a site that tries to overbill, or a broken one.
    Column("usage_rejections", BigInteger, nullable=False, server_default=text("0")),
    # Tokens generated and then discarded (stale completions, less what a checkpoint kept).
    Column("wasted_tokens", BigInteger, nullable=False, default=0),
    Column("tokens_generated", BigInteger, nullable=False, default=0),
    # Measured by the control plane, never reported by the worker (sites.touch_site):
    # seconds it held at least one lease, and the cost of that time at its $/hour;
    Column("busy_s", Double, nullable=False, default=0.0),
    Column("cost_usd", Double, nullable=False, default=0.0),
    # accepted output tokens and held seconds over a window of recent held time (decayed);
    Column("window_tokens", Double, nullable=False, default=0.0),
    Column("window_busy_s", Double, nullable=False, default=0.0),
    # and what tenants were billed for the completions it delivered.
    Column("billed_usd", Double, nullable=False, default=0.0),
)

outages = Table(
    "outages", metadata,
    Column("id", SeqType, primary_key=True, autoincrement=True),
    Column("site_id", String(40), nullable=False, index=True),
    Column("start_at", Double, nullable=False),
    Column("end_at", Double, nullable=False),
    Column("created_at", Double, nullable=False),
)

# Webhook endpoints: a tenant's (tenant_id set) or fleet-wide ones (tenant_id None, registered
# by an operator) that receive the events of every tenant. The signing secret must be kept to
# sign deliveries, so it is stored as given (it is shown once, at creation).
webhook_endpoints = Table(
    "webhook_endpoints", metadata,
    Column("id", String(40), primary_key=True),
    Column("tenant_id", String(40), index=True),
    Column("name", String(200), nullable=False),
    Column("url", Text, nullable=False),
    Column("secret", String(100), nullable=False),
    Column("event_types", JSON, nullable=False),
    Column("created_at", Double, nullable=False),
)

# Objects whose end someone may want to hear of (background responses, batches): a row here
# until its terminal event is recorded. Claimed by deleting it, in the transaction that writes
# the event, so each object gets one event whatever number of control planes look.
webhook_watches = Table(
    "webhook_watches", metadata,
    Column("subject_id", String(40), primary_key=True),  # a request id or a batch id
    Column("subject_kind", String(20), nullable=False),  # "response" | "batch"
    Column("tenant_id", String(40), nullable=False),
    Column("created_at", Double, nullable=False),
)

webhook_events = Table(
    "webhook_events", metadata,
    Column("id", String(40), primary_key=True),  # evt_...: the webhook-id of every delivery
    Column("tenant_id", String(40), nullable=False),
    Column("type", String(40), nullable=False),
    Column("subject_id", String(40), nullable=False, unique=True),
    # The JSON body exactly as delivered (every attempt signs the same bytes).
    Column("payload", Text, nullable=False),
    Column("created_at", Double, nullable=False),
)

# One event to one endpoint. `next_attempt_at` doubles as the claim: a sender pushes it a
# claim's length ahead before it posts, so a sender that dies leaves it due again later.
webhook_deliveries = Table(
    "webhook_deliveries", metadata,
    Column("id", String(40), primary_key=True),
    Column("event_id", String(40), nullable=False),
    Column("endpoint_id", String(40), nullable=False, index=True),
    Column("status", String(20), nullable=False),  # pending | delivered | failed
    Column("attempts", Integer, nullable=False, default=0),
    Column("next_attempt_at", Double, nullable=False),
    Column("last_error", Text),
    Column("created_at", Double, nullable=False),
    Column("delivered_at", Double),
    Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
)

# Boxes (sandboxes): a tenant's workspace that a box host (a site) holds under a lease with a
# fencing epoch, as requests are; a lapsed lease sends it back to `pending`, to come back on
# another host from `snapshot_id` (else `image_id`).
boxes = Table(
    "boxes", metadata,
    Column("id", String(40), primary_key=True),
    Column("tenant_id", String(40), nullable=False),
    Column("status", String(20), nullable=False),  # control/boxes.BoxStatus
    Column("epoch", Integer, nullable=False, default=0),
    Column("site_id", String(40)),
    Column("lease_expires_at", Double),
    Column("image_id", String(40)),  # the archive it was created from (an image or snapshot)
    Column("snapshot_id", String(40)),  # its latest snapshot
    Column("network", Boolean, nullable=False, default=False),
    Column("limits", JSON, nullable=False),
    Column("metadata", JSON),
    Column("created_at", Double, nullable=False),
    Column("leased_at", Double),
    Column("restarts", Integer, nullable=False, default=0),  # leases after the first
    Index("ix_boxes_tenant_created", "tenant_id", "created_at"),
    Index("ix_boxes_status", "status", "lease_expires_at"),
    Index("ix_boxes_site", "site_id", "status"),
)

# When each box was last used, for its idle policy (the `idle` entry of `boxes.limits`; see
# control/box_idle.py): `idle_at` is when the policy is due if nothing happens before (None:
# never, or paused already), and `idle_paused` says the janitor paused it, not its tenant, so
# that its next operation resumes it. A table of its own because the store creates missing
# tables but never adds columns to existing ones.
box_activity = Table(
    "box_activity", metadata,
    Column("box_id", String(40), primary_key=True),
    Column("last_active_at", Double, nullable=False),
    Column("idle_at", Double),
    Column("idle_paused", Boolean, nullable=False, default=False),
    Index("ix_box_activity_idle", "idle_at"),
)

# Operations on a box (exec, file reads and writes, snapshot, pause), run by its host in order.
box_ops = Table(
    "box_ops", metadata,
    Column("seq", SeqType, primary_key=True, autoincrement=True),
    Column("id", String(40), nullable=False, unique=True),
    Column("box_id", String(40), nullable=False),
    Column("tenant_id", String(40), nullable=False),
    Column("kind", String(20), nullable=False),
    Column("args", JSON, nullable=False),
    Column("status", String(20), nullable=False),  # control/boxes.OpStatus
    Column("epoch", Integer),  # the box's epoch when its host took it
    Column("result", JSON),
    Column("error", JSON),
    Column("created_at", Double, nullable=False),
    Column("started_at", Double),
    Column("finished_at", Double),
    # The caller's Idempotency-Key: a retried call (a durable agent's new runner) gets the
    # first call's operation, never a second run. Such rows are kept after they finish.
    Column("idempotency_key", String(500)),
    Index("ix_box_ops_box", "box_id", "status", "seq"),
    Index("ix_box_ops_idempotency", "tenant_id", "idempotency_key"),
)

# An exec's output while it runs, as its host sends it: chunks numbered per run of the
# operation (a run is the op's epoch). Readers follow it by (epoch, seq). Dropped when the
# operation ends (its result holds the whole output) or goes back to the queue.
box_op_output = Table(
    "box_op_output", metadata,
    Column("op_id", String(40), primary_key=True),
    Column("epoch", Integer, primary_key=True, autoincrement=False),
    Column("seq", Integer, primary_key=True, autoincrement=False),
    Column("stream", String(10), nullable=False),  # stdout | stderr
    Column("data", Text, nullable=False),
)

# Workspace archives: tenants' images, and snapshots of boxes. Content lives in file_chunks
# under the snapshot's id.
box_snapshots = Table(
    "box_snapshots", metadata,
    Column("id", String(40), primary_key=True),
    Column("tenant_id", String(40), nullable=False),
    Column("box_id", String(40), index=True),  # None for an image
    Column("kind", String(20), nullable=False),  # image | manual | auto
    Column("bytes", BigInteger, nullable=False),
    Column("created_at", Double, nullable=False),
    # The snapshot an incremental one is a delta of (boxes/snapshots.py); None: a full archive.
    # Nullable, so the store adds it to a table made by an older version (store.py).
    Column("parent_id", String(40)),
)

# Snapshot uploads in progress: a host sends an archive in parts (file_chunks under the
# upload's id), then commits it, and the upload's id becomes the snapshot's. An upload not
# committed within box_hosts.UPLOAD_TTL_S is dropped with its parts.
box_snapshot_uploads = Table(
    "box_snapshot_uploads", metadata,
    Column("id", String(40), primary_key=True),
    Column("box_id", String(40), nullable=False),
    Column("started_at", Double, nullable=False, index=True),
)

# Durable agents: a tenant's harness (its code and task), run by runners (sites) under leases
# with fencing epochs; a lapsed lease sends it back to `queued`, and the next runner replays
# its journal.
agents = Table(
    "agents", metadata,
    Column("id", String(40), primary_key=True),
    Column("tenant_id", String(40), nullable=False),
    Column("status", String(20), nullable=False),  # control/agents.AgentStatus
    Column("code", Text, nullable=False),
    Column("filename", String(500), nullable=False),
    Column("task", JSON),
    Column("model", String(200), nullable=False),
    Column("budget_tokens", BigInteger),
    # The image (an archive id) the agent's box starts from; None: an empty box.
    Column("box_image", String(40)),
    Column("epoch", Integer, nullable=False, default=0),
    Column("site_id", String(40)),
    Column("lease_expires_at", Double),
    # Not leased before this time (ctx.sleep_until).
    Column("wake_at", Double),
    Column("result", JSON),
    Column("error", JSON),
    Column("restarts", Integer, nullable=False, default=0),
    # Effects a runner tried to journal a second time (must stay 0: none was redone).
    Column("repeated_effects", Integer, nullable=False, default=0),
    # Effects runners answered from the journal instead of running them again.
    Column("replayed_effects", Integer, nullable=False, default=0),
    Column("created_at", Double, nullable=False),
    Column("finished_at", Double),
    Index("ix_agents_tenant_created", "tenant_id", "created_at"),
    Index("ix_agents_queue", "status", "wake_at"),
)

# The credential a runner gets with an agent's lease for the harness's calls to the public API
# (harness_keys.py): it reaches only the routes a harness needs, only for that agent, and only
# while the agent is running at `epoch` under an unexpired lease.
harness_keys = Table(
    "harness_keys", metadata,
    Column("id", String(40), primary_key=True),
    Column("key_hash", String(64), nullable=False, unique=True),
    Column("agent_id", String(40), nullable=False, index=True),
    Column("tenant_id", String(40), nullable=False),
    Column("epoch", Integer, nullable=False),
    Column("created_at", Double, nullable=False),
)

# Boxes a harness created with its credential: the only boxes that credential reaches.
agent_boxes = Table(
    "agent_boxes", metadata,
    Column("box_id", String(40), primary_key=True),
    Column("agent_id", String(40), nullable=False, index=True),
    Column("created_at", Double, nullable=False),
)

# Every effect of an agent (model call, exec, file write, subagent result, log line, sleep),
# keyed by its deterministic place in the harness's run.
agent_journal = Table(
    "agent_journal", metadata,
    Column("agent_id", String(40), primary_key=True),
    Column("key", String(400), primary_key=True),
    Column("kind", String(20), nullable=False),
    Column("value", JSON),
    Column("epoch", Integer, nullable=False),
    Column("created_at", Double, nullable=False),
)
