"""A tenant's webhook endpoints, at the paths the official client uses (`client.webhooks`):
create (the signing secret is in this answer only), list, retrieve, delete. Fleet-wide
endpoints are the operator's, made with `minimill webhooks create --fleet`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from minimill.api.deps import ConfigDep, StoreDep, TenantDep
from minimill.api.errors import error_responses
from minimill.api.response_schemas import (
    WebhookEndpointCreate,
    WebhookEndpointDeleted,
    WebhookEndpointList,
    WebhookEndpointObject,
    WebhookEndpointWithSecret,
)
from minimill.control import webhooks

router = APIRouter(prefix="/v1/webhook_endpoints", tags=["webhooks"],
                   responses=error_responses(400, 401, 404))


@router.post("", response_model=WebhookEndpointWithSecret)
def create_webhook_endpoint(body: WebhookEndpointCreate, store: StoreDep,
                            tenant: TenantDep, config: ConfigDep) -> WebhookEndpointWithSecret:
    """400 (param url) for a URL to a loopback, link-local, private or unspecified address,
    unless the operator allows them (MINIMILL_WEBHOOK_ALLOW_PRIVATE)."""
    endpoint, secret = webhooks.create_endpoint(
        store, tenant.id, body.name, body.url, body.event_types,
        allow_private=config.webhook_allow_private)
    return WebhookEndpointWithSecret(**WebhookEndpointObject.of(endpoint).model_dump(),
                                     signing_secret=secret)


@router.get("", response_model=WebhookEndpointList)
def list_webhook_endpoints(store: StoreDep, tenant: TenantDep, after: str | None = None,
                           limit: Annotated[int, Query(ge=1, le=100)] = 20
                           ) -> WebhookEndpointList:
    page, has_more = webhooks.list_endpoints(store, tenant.id, after=after, limit=limit)
    data = [WebhookEndpointObject.of(e) for e in page]
    return WebhookEndpointList(data=data, has_more=has_more,
                               first_id=data[0].id if data else None,
                               last_id=data[-1].id if data else None)


@router.get("/{webhook_endpoint_id}", response_model=WebhookEndpointObject)
def retrieve_webhook_endpoint(webhook_endpoint_id: str, store: StoreDep,
                              tenant: TenantDep) -> WebhookEndpointObject:
    return WebhookEndpointObject.of(webhooks.get_endpoint(store, tenant.id, webhook_endpoint_id))


@router.delete("/{webhook_endpoint_id}", response_model=WebhookEndpointDeleted)
def delete_webhook_endpoint(webhook_endpoint_id: str, store: StoreDep,
                            tenant: TenantDep) -> WebhookEndpointDeleted:
    webhooks.delete_endpoint(store, tenant.id, webhook_endpoint_id)
    return WebhookEndpointDeleted(id=webhook_endpoint_id, deleted=True)
