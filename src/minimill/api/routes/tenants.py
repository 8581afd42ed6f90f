"""Operator routes of tenants' limits: rate limits, quotas, fair-share weight, and whether a
tenant's cached prompt prefixes are shared (`minimill tenants` does the same on the store)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from minimill.api.deps import ConfigDep, OperatorDep, StoreDep
from minimill.api.errors import error_responses
from minimill.api.operator_schemas import TenantLimitsList, TenantLimitsObject, TenantLimitsSet
from minimill.control import tenant_limits

# Not in the public OpenAPI document: tenants should not learn these routes exist.
router = APIRouter(prefix="/v1/tenants", tags=["operator"], include_in_schema=False,
                   responses=error_responses(400, 404))
TenantName = Annotated[str, Path(min_length=1, max_length=200)]


@router.get("", response_model=TenantLimitsList)
def list_tenants(store: StoreDep, config: ConfigDep, _operator: OperatorDep) -> TenantLimitsList:
    return TenantLimitsList(data=[TenantLimitsObject.of(v) for v in tenant_limits.list_views(
        store, config.tenant_limits)])


@router.get("/{tenant}/limits", response_model=TenantLimitsObject)
def get_limits(tenant: TenantName, store: StoreDep, config: ConfigDep,
               _operator: OperatorDep) -> TenantLimitsObject:
    return TenantLimitsObject.of(tenant_limits.view(store, tenant, config.tenant_limits))


@router.post("/{tenant}/limits", response_model=TenantLimitsObject)
def set_limits(tenant: TenantName, body: TenantLimitsSet, store: StoreDep, config: ConfigDep,
               _operator: OperatorDep) -> TenantLimitsObject:
    return TenantLimitsObject.of(tenant_limits.set_overrides(
        store, tenant, body.changes(), body.reset, config.tenant_limits))
