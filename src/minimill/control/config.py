"""Tunables of the control plane's domain logic (the API's Settings produce one of these)."""

from __future__ import annotations

from dataclasses import dataclass, field

from minimill.box_protocol import DEFAULT_BOX_CAPS, BoxLimits
from minimill.control.tenant_limits import UNLIMITED, TenantLimits

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True, slots=True)
class ControlConfig:
    # Model names workers serve under; requests for any other model are 404 model_not_found.
    served_models: tuple[str, ...] = (DEFAULT_MODEL,)
    # (model, context length in tokens) where known: longer completions are refused (400).
    context_lengths: tuple[tuple[str, int], ...] = ()
    # Seconds a lease lives without a heartbeat.
    lease_ttl_s: float = 30.0
    # How often workers checkpoint ordinary leases, and streaming ones (streams read them).
    checkpoint_interval_s: float = 2.0
    stream_checkpoint_interval_s: float = 0.1
    # Each checkpoint is a row written here: a site holding many leases checkpoints each less
    # often, so that one site writes at most about this many per second (streams excepted).
    site_checkpoints_per_s: float = 32.0
    # Batch input limits; a longer line is a bad line (as a larger realtime body is refused).
    max_batch_lines: int = 50_000
    max_file_bytes: int = 200 * 1024 * 1024
    max_line_bytes: int = 16 * 1024 * 1024
    # Batch ingest: lines per transaction, and how long an ingester that stopped committing
    # keeps its claim before another process resumes its batch.
    ingest_group_lines: int = 1000
    ingest_claim_ttl_s: float = 60.0
    # Files (uploads without `expires_after`, batch outputs) expire this long after their
    # creation, as OpenAI's batch files do (None: kept until deleted).
    file_expires_after_s: float | None = 30 * 24 * 3600.0
    # A file still being written this long after it was started lost its writer: deleted.
    file_writing_ttl_s: float = 3600.0
    # Background work (batches, service_tier "flex") is billed this fraction of the realtime
    # price, where the price list sets no background price of its own (prices.py).
    background_price_factor: float = 0.5
    # A realtime request not finished this long after it arrived expires.
    realtime_timeout_s: float = 600.0
    # A janitor that started writing a batch's output files is presumed dead after this long.
    finalize_claim_ttl_s: float = 300.0
    # A background response not finished this long after it arrived expires (as a batch line
    # does at the end of its window).
    background_response_window_s: float = 24 * 3600.0
    # Webhook deliveries: the first retry after this long, doubling up to the cap, until the
    # event is max_age old (then the delivery is marked failed).
    webhook_retry_base_s: float = 5.0
    webhook_retry_cap_s: float = 300.0
    webhook_max_age_s: float = 72 * 3600.0
    # Realtime requests and responses are deleted this long after they ended (retention.py;
    # None: kept). A batch's rows lose their text once one of its files is gone.
    request_retention_s: float | None = 30 * 24 * 3600.0
    # Webhook URLs may reach loopback, link-local and private addresses (url_guard.py): the
    # operator's own network, on purpose.
    webhook_allow_private: bool = False
    # The idle timeout of a box created without one (None: boxes never idle out).
    box_idle_timeout_s: float | None = None
    # The most a tenant may ask of each box limit (a 400 past it, never a silent clamp).
    box_caps: BoxLimits = field(default_factory=lambda: DEFAULT_BOX_CAPS)
    # How long before an announced outage a site gives back the work it would not finish
    # (None: the placement policy's own); never less than a heartbeat's delay (leases.py).
    handback_lead_s: float | None = None
    # Every tenant's limits and settings unless it has its own (tenant_limits.py).
    tenant_limits: TenantLimits = UNLIMITED

    @property
    def context_length_of(self) -> dict[str, int]:
        return dict(self.context_lengths)
