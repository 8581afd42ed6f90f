"""Operator routes that make API keys (a tenant's, or another operator's) and revoke them."""

from __future__ import annotations

import time

from fastapi import APIRouter

from minimill.api.deps import OperatorDep, StoreDep
from minimill.api.errors import error_responses
from minimill.api.operator_schemas import KeyCreate, KeyCreated, KeyRevoke, KeyRevoked
from minimill.control.errors import InvalidRequestError
from minimill.control.keys import create_key, create_operator_key, revoke_key

# Not in the public OpenAPI document: tenants should not learn these routes exist.
router = APIRouter(prefix="/v1/keys", tags=["operator"], include_in_schema=False,
                   responses=error_responses(400, 404))


@router.post("", response_model=KeyCreated)
def create(body: KeyCreate, store: StoreDep, _operator: OperatorDep) -> KeyCreated:
    if body.operator and body.tenant is None:
        return KeyCreated(key=create_operator_key(store), tenant=None, operator=True)
    if not body.operator and body.tenant is not None:
        return KeyCreated(key=create_key(store, body.tenant), tenant=body.tenant.strip(),
                          operator=False)
    raise InvalidRequestError("Give either a tenant name or operator: true.", param="tenant")


@router.post("/revoke", response_model=KeyRevoked)
def revoke(body: KeyRevoke, store: StoreDep, _operator: OperatorDep) -> KeyRevoked:
    """Revoke a tenant's or an operator's key: refused at once by every process."""
    record = revoke_key(store, body.key, time.time())
    return KeyRevoked(id=record.id, tenant=record.tenant, hint=record.hint,
                      revoked_at=record.revoked_at)
