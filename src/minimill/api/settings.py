"""Settings of the control plane's HTTP surface (pydantic-settings; env prefix MINIMILL_)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from minimill.control.config import ControlConfig
from minimill.control.tenant_limits import TenantLimits
from minimill.models.info import context_length
from minimill.models.registry import DEFAULT_MODEL
from minimill.transport.box_protocol import DEFAULT_BOX_CAPS, BoxLimits


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MINIMILL_", extra="ignore")

    # Store URL; None: SQLite under MINIMILL_HOME/data.
    db: str | None = None
    # Model names served (workers register the same names when they lease).
    models: list[str] = Field(default_factory=lambda: [DEFAULT_MODEL])
    max_file_bytes: int = Field(default=200 * 1024 * 1024, ge=1)
    max_batch_lines: int = Field(default=50_000, ge=1)
    # Largest request body of every other route (and of one batch line), and of the worker
    # protocol's routes (a completion carries whole results); larger ones are refused with 413.
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    max_fleet_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    # Files without `expires_after` (uploads, batch outputs) expire this long after their
    # creation; 0 keeps them until deleted.
    file_expires_after_s: float = Field(default=30 * 24 * 3600.0, ge=0)
    # Realtime requests and responses (prompts and results) are deleted this long after they
    # ended; 0 keeps them. A batch's rows lose their text once one of its files is gone.
    request_retention_s: float = Field(default=30 * 24 * 3600.0, ge=0)
    # Batch ingest: lines per transaction, and how long a silent ingester keeps its batch.
    ingest_group_lines: int = Field(default=1000, ge=1)
    ingest_claim_ttl_s: float = Field(default=60.0, gt=0)
    lease_ttl_s: float = Field(default=30.0, gt=0)
    checkpoint_interval_s: float = Field(default=2.0, gt=0)
    stream_checkpoint_interval_s: float = Field(default=0.1, gt=0)
    site_checkpoints_per_s: float = Field(default=32.0, gt=0)
    background_price_factor: float = Field(default=0.5, ge=0)
    realtime_timeout_s: float = Field(default=600.0, gt=0)
    # Lease calls read the other sites as this process last read them, up to this old
    # (control/site_view.py's PeerView; 0: read them all at every call). 0 by default: a
    # view even half a second old can miss a site that just came online, and the first site
    # to ask then takes work the two would share; fleets of hundreds of sites set it (bench
    # control-plane runs with 0.5).
    peer_view_max_age_s: float = Field(default=0.0, ge=0)
    # Answer the token sites' lease, heartbeat, complete and release calls on the lean path
    # in front of FastAPI (api/lean_fleet.py; the same answers for a fraction of the CPU).
    lean_fleet_path: bool = True
    # How often the janitor reaps leases and finalizes batches.
    janitor_interval_s: float = Field(default=0.5, gt=0)
    run_janitor: bool = True
    # Run batch ingest and finalization in a thread of this process rather than in a worker
    # process (where they cannot slow the event loop and the heartbeats it serves).
    batch_jobs_in_process: bool = False
    # How often waiting realtime requests poll the store for progress made elsewhere.
    poll_interval_s: float = Field(default=0.025, gt=0)
    background_response_window_s: float = Field(default=24 * 3600.0, gt=0)
    # Webhooks: how often the sender looks for events and due deliveries, how long a receiver
    # may take to answer, and the retry schedule (control/webhook_events.py).
    run_webhooks: bool = True
    webhook_interval_s: float = Field(default=0.5, gt=0)
    webhook_timeout_s: float = Field(default=10.0, gt=0)
    webhook_retry_base_s: float = Field(default=5.0, gt=0)
    webhook_retry_cap_s: float = Field(default=300.0, gt=0)
    webhook_max_age_s: float = Field(default=72 * 3600.0, gt=0)
    # Webhooks to loopback, link-local and private addresses (refused otherwise, at creation
    # and at each delivery): MINIMILL_WEBHOOK_ALLOW_PRIVATE=1 or `serve --webhook-allow-private`.
    webhook_allow_private: bool = False
    # Boxes created without `idle_timeout_s` are paused after this long without an operation;
    # 0: they never are.
    box_idle_timeout_s: float = Field(default=0.0, ge=0)
    # The operator's caps on box limits (`minimill serve --box-max-*`): a tenant asking for
    # more gets a 400 naming the limit.
    box_max_memory_mb: int = Field(default=DEFAULT_BOX_CAPS.memory_mb, ge=16)
    box_max_processes: int = Field(default=DEFAULT_BOX_CAPS.max_processes, ge=1)
    box_max_cpu_s: int = Field(default=DEFAULT_BOX_CAPS.cpu_s, ge=1)
    box_max_exec_s: float = Field(default=DEFAULT_BOX_CAPS.timeout_s, gt=0)
    box_max_disk_mb: int = Field(default=DEFAULT_BOX_CAPS.disk_mb, ge=1)
    # Seconds before an announced outage that a site gives back what it would not finish;
    # unset: the placement policy's 5 s.
    handback_lead_s: float | None = Field(default=None, gt=0)
    # Every tenant's limits unless `minimill tenants set` gives it its own (unset: unlimited):
    # `minimill serve --tenant-*` or MINIMILL_TENANT_*.
    tenant_requests_per_minute: int | None = Field(default=None, ge=0)
    tenant_tokens_per_minute: int | None = Field(default=None, ge=0)
    tenant_max_concurrent_realtime: int | None = Field(default=None, ge=0)
    tenant_max_boxes: int | None = Field(default=None, ge=0)
    tenant_max_agents: int | None = Field(default=None, ge=0)
    tenant_max_stored_bytes: int | None = Field(default=None, ge=0)
    # Every tenant's prompts share cached KV prefixes with other tenants' (off, the default:
    # a tenant's cached prefixes are its own unless `minimill tenants set NAME
    # --share-prefix-cache` opts it in).
    tenant_share_prefix_cache: bool = False

    def tenant_limits(self) -> TenantLimits:
        return TenantLimits(
            requests_per_minute=self.tenant_requests_per_minute,
            tokens_per_minute=self.tenant_tokens_per_minute,
            max_concurrent_realtime=self.tenant_max_concurrent_realtime,
            max_boxes=self.tenant_max_boxes, max_agents=self.tenant_max_agents,
            max_stored_bytes=self.tenant_max_stored_bytes,
            share_prefix_cache=self.tenant_share_prefix_cache)

    def box_caps(self) -> BoxLimits:
        return BoxLimits.model_construct(
            memory_mb=self.box_max_memory_mb, max_processes=self.box_max_processes,
            cpu_s=self.box_max_cpu_s, timeout_s=self.box_max_exec_s,
            disk_mb=self.box_max_disk_mb)

    def control_config(self) -> ControlConfig:
        return ControlConfig(
            served_models=tuple(self.models), lease_ttl_s=self.lease_ttl_s,
            context_lengths=tuple((m, n) for m in self.models
                                  if (n := context_length(m)) is not None),
            checkpoint_interval_s=self.checkpoint_interval_s,
            stream_checkpoint_interval_s=self.stream_checkpoint_interval_s,
            site_checkpoints_per_s=self.site_checkpoints_per_s,
            max_batch_lines=self.max_batch_lines, max_file_bytes=self.max_file_bytes,
            max_line_bytes=self.max_body_bytes, ingest_group_lines=self.ingest_group_lines,
            ingest_claim_ttl_s=self.ingest_claim_ttl_s,
            file_expires_after_s=self.file_expires_after_s or None,
            request_retention_s=self.request_retention_s or None,
            background_price_factor=self.background_price_factor,
            realtime_timeout_s=self.realtime_timeout_s,
            background_response_window_s=self.background_response_window_s,
            webhook_retry_base_s=self.webhook_retry_base_s,
            webhook_retry_cap_s=self.webhook_retry_cap_s,
            webhook_max_age_s=self.webhook_max_age_s,
            webhook_allow_private=self.webhook_allow_private,
            box_idle_timeout_s=self.box_idle_timeout_s or None,
            box_caps=self.box_caps(),
            handback_lead_s=self.handback_lead_s,
            tenant_limits=self.tenant_limits())
