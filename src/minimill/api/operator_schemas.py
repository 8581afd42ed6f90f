"""Wire schemas of the operator routes (sites, prices, keys, tenants' limits): what only
operator keys see."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from minimill.api.schemas import OutageWindow
from minimill.control.prices import QuotedPrice
from minimill.control.tenant_limits import TenantLimitsView, as_dict


class SiteObject(BaseModel):
    """A site of the fleet as operators see it (`minimill sites list`)."""

    name: str
    object: Literal["site"] = "site"
    status: str = Field(description="new | online | draining | outage | offline")
    chip: str
    serves: str = Field(description="What its token reaches: tokens, boxes, agents "
                        "(comma-separated).")
    price_per_hour: float = Field(description="What the site costs per hour, in US dollars.")
    price_now: float = Field(description="$/h now: its price schedule's, else price_per_hour.")
    tokens_per_s: float | None = Field(
        description="Busy output tokens/s as its worker reports it: placement's prior only.")
    measured_tokens_per_s: float | None = Field(
        description="Output tokens of accepted completions per second the site held work, "
                    "as the control plane measured it (recent held time weighs most).")
    uptime: float | None = Field(description="Observed fraction of time up since first contact.")
    usd_per_mtok: float = Field(description="$/Mtok at the reported rate (placement's view).")
    expected_loss: float = Field(description="Fraction of placed work expected to be lost.")
    effective_usd_per_mtok: float = Field(
        description="usd_per_mtok / (1 - expected_loss): background work goes to the lowest.")
    cost_usd_per_mtok: float | None = Field(
        description="What a million of its output tokens cost, at the measured rate.")
    busy_s: float = Field(description="Seconds it held at least one lease.")
    cost_usd: float = Field(description="What its held time cost: busy_s at price_per_hour.")
    billed_usd: float = Field(description="What tenants were billed for its completions.")
    margin_usd: float = Field(description="billed_usd - cost_usd.")
    in_flight: int
    free_capacity: int = Field(description="What its worker last said it could still take.")
    leases_granted: int
    leases_expired: int
    completions: int
    stale_completions: int
    usage_rejections: int = Field(description="Completions refused because their usage "
                                  "report disagreed with what they returned.")
    wasted_tokens: int
    tokens_generated: int
    last_seen_at: float | None
    outages: list[OutageWindow]


class SiteList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SiteObject]


class PriceSet(BaseModel):
    """One entry of the price list, in US dollars per million tokens."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = Field(min_length=1, max_length=200, description='A model name, or "*" for '
                       "the default entry (models not listed).")
    tier: Literal["realtime", "background"] = "realtime"
    input_usd_per_mtok: float = Field(ge=0)
    output_usd_per_mtok: float = Field(ge=0)
    cached_input_usd_per_mtok: float | None = Field(
        default=None, ge=0, description="Prompt tokens from a reused prefix (default: input).")


class PriceObject(BaseModel):
    object: Literal["price"] = "price"
    model: str
    tier: str = Field(description="realtime | background")
    input_usd_per_mtok: float
    cached_input_usd_per_mtok: float
    output_usd_per_mtok: float
    entry: str | None = Field(description='The entry it comes from: the model\'s own, "*" '
                              "(the default entry), or null (the built-in price).")
    discounted: bool = Field(description="The entry's realtime price times the background "
                             "discount (no background price set).")

    @classmethod
    def of(cls, quoted: QuotedPrice) -> PriceObject:
        p = quoted.price
        return cls(model=quoted.model, tier=quoted.tier.value,
                   input_usd_per_mtok=p.input_usd_per_mtok,
                   cached_input_usd_per_mtok=p.cached_input_usd_per_mtok,
                   output_usd_per_mtok=p.output_usd_per_mtok,
                   entry=quoted.entry, discounted=quoted.discounted)


class PriceTable(BaseModel):
    object: Literal["list"] = "list"
    data: list[PriceObject] = Field(description="The default entry, each model with an entry "
                                    "and each model served, in both tiers.")
    background_price_factor: float


class PriceDeleted(BaseModel):
    model: str
    tier: str
    deleted: bool


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    tenant: str | None = Field(default=None, min_length=1, max_length=200,
                               description="Tenant name (created if new), for a tenant key.")
    operator: bool = Field(default=False, description="An operator key instead.")


class KeyCreated(BaseModel):
    object: Literal["api_key"] = "api_key"
    key: str = Field(description="Shown once; the store keeps only its hash.")
    tenant: str | None
    operator: bool


class KeyRevoke(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    key: str = Field(min_length=1, max_length=200, description="The key's id (key_..., "
                     "opk_...), the key itself, or its first characters (at least 6 after "
                     "mm- or mmo-).")


class KeyRevoked(BaseModel):
    object: Literal["api_key"] = "api_key"
    id: str
    tenant: str | None = Field(description="Its tenant; null for an operator key.")
    hint: str | None = Field(description="Its first characters.")
    revoked_at: float | None


class PriceScheduleSet(BaseModel):
    """A site's hourly price schedule."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    hourly_usd: list[float] = Field(min_length=1, max_length=24 * 366,
                                    description="$/h of each hour from start_at.")
    start_at: float | None = Field(default=None, description="Unix seconds of the first "
                                   "hour (default: the start of the current UTC day).")
    repeat: bool = Field(default=True, description="Start over after the last hour.")


class PriceScheduleObject(BaseModel):
    object: Literal["price_schedule"] = "price_schedule"
    site: str
    start_at: float | None
    hourly_usd: list[float]
    repeat: bool


class TenantLimitsObject(BaseModel):
    """A tenant's limits in effect (null: unlimited), and which of them are its own."""

    object: Literal["tenant.limits"] = "tenant.limits"
    tenant: str
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrent_realtime: int | None
    max_boxes: int | None
    max_agents: int | None
    max_stored_bytes: int | None
    weight: float
    share_prefix_cache: bool
    overrides: dict[str, Any] = Field(description="The tenant's own values; the others are "
                                      "the operator's defaults (minimill serve --tenant-*).")

    @classmethod
    def of(cls, view: TenantLimitsView) -> TenantLimitsObject:
        return cls(tenant=view.tenant, overrides=view.overrides, **as_dict(view.limits))


class TenantLimitsList(BaseModel):
    object: Literal["list"] = "list"
    data: list[TenantLimitsObject]


class TenantLimitsSet(BaseModel):
    """Changes to a tenant's own limits: a value sets it (null: unlimited for this tenant);
    `reset` names those that go back to the operator's defaults."""

    model_config = ConfigDict(extra="forbid")

    requests_per_minute: int | None = Field(default=None, ge=0)
    tokens_per_minute: int | None = Field(default=None, ge=0)
    max_concurrent_realtime: int | None = Field(default=None, ge=0)
    max_boxes: int | None = Field(default=None, ge=0)
    max_agents: int | None = Field(default=None, ge=0)
    max_stored_bytes: int | None = Field(default=None, ge=0)
    weight: float | None = Field(default=None, gt=0, le=1000)
    share_prefix_cache: bool | None = None
    reset: list[str] = Field(default_factory=list, max_length=16)

    def changes(self) -> dict[str, Any]:
        """The fields the body sent, as given (an explicit null included)."""
        return {k: getattr(self, k) for k in self.model_fields_set if k != "reset"}
