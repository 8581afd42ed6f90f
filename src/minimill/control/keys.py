"""Tenants and their API keys, and operator keys. A key is shown once; the store keeps only its
SHA-256 hash. The prefix tells the roles apart: `mm-` a tenant, `mmo-` an operator (the fleet:
sites, outages, prices, keys), and `mms-` a site (sites.py; the worker protocol only)."""

from __future__ import annotations

import hashlib
import secrets
import time

from sqlalchemy import insert, select
from sqlalchemy.exc import IntegrityError

from minimill.control.errors import InvalidRequestError
from minimill.control.records import Operator, Tenant, new_id
from minimill.control.store import Store
from minimill.control.tables import api_keys, operator_keys, tenants

KEY_PREFIX = "mm-"
OPERATOR_KEY_PREFIX = "mmo-"
MAX_TENANT_NAME = 200


def hash_secret(secret: str) -> str:
    """Hex SHA-256: keys and tokens have 256 random bits, so no salt or slow hash is needed."""
    return hashlib.sha256(secret.encode()).hexdigest()


def ensure_tenant(store: Store, name: str) -> Tenant:
    """The tenant called `name`, created if new (safe when two processes race)."""
    name = name.strip()
    if not name or len(name) > MAX_TENANT_NAME:
        raise InvalidRequestError(f"a tenant name must have 1 to {MAX_TENANT_NAME} characters",
                                  param="tenant")
    for _ in range(2):
        with store.read() as conn:
            row = conn.execute(select(tenants.c.id).where(tenants.c.name == name)).first()
        if row is not None:
            return Tenant(id=row.id, name=name)
        try:
            with store.write() as conn:
                tenant_id = new_id("ten_")
                conn.execute(insert(tenants).values(id=tenant_id, name=name,
                                                    created_at=time.time()))
            return Tenant(id=tenant_id, name=name)
        except IntegrityError:
            continue  # another process created it first: read it back
    raise RuntimeError(f"could not create tenant {name!r}")  # pragma: no cover


def create_key(store: Store, tenant: str) -> str:
    """A new API key for tenant `tenant` (a name; created if new). Returned once, never stored."""
    owner = ensure_tenant(store, tenant)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    with store.write() as conn:
        conn.execute(insert(api_keys).values(id=new_id("key_"), tenant_id=owner.id,
                                             key_hash=hash_secret(key), created_at=time.time()))
    return key


def authenticate(store: Store, key: str) -> Tenant | None:
    """The tenant owning `key`, or None for an unknown key."""
    if not key.startswith(KEY_PREFIX):
        return None
    query = (select(tenants.c.id, tenants.c.name)
             .join(api_keys, api_keys.c.tenant_id == tenants.c.id)
             .where(api_keys.c.key_hash == hash_secret(key)))
    with store.read() as conn:
        row = conn.execute(query).first()
    return Tenant(id=row.id, name=row.name) if row else None


def create_operator_key(store: Store) -> str:
    """A new operator key. Returned once, never stored."""
    key = OPERATOR_KEY_PREFIX + secrets.token_urlsafe(32)
    with store.write() as conn:
        conn.execute(insert(operator_keys).values(id=new_id("opk_"), key_hash=hash_secret(key),
                                                  created_at=time.time()))
    return key


def authenticate_operator(store: Store, key: str) -> Operator | None:
    """The operator holding `key`, or None (a tenant key or site token is no operator key)."""
    if not key.startswith(OPERATOR_KEY_PREFIX):
        return None
    with store.read() as conn:
        key_id = conn.execute(select(operator_keys.c.id).where(
            operator_keys.c.key_hash == hash_secret(key))).scalar()
    return Operator(key_id=key_id) if key_id else None
