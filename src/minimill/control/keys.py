"""Tenants and their API keys, and operator keys. A key is shown once; the store keeps only its
SHA-256 hash. The prefix tells the roles apart: `mm-` a tenant, `mmo-` an operator (the fleet:
sites, outages, prices, keys), and `mms-` a site (sites.py; the worker protocol only).

A key is revoked (`revoke_key`) by its id, the whole key, or its first characters (its hint,
kept in clear for that): every process reads the store on each call, so a revoked key is
refused at once everywhere.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Table, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from minimill.control.errors import InvalidRequestError, NotFoundError
from minimill.control.records import Operator, Tenant, new_id
from minimill.control.store import Store
from minimill.control.tables import api_keys, operator_keys, tenants

KEY_PREFIX = "mm-"
OPERATOR_KEY_PREFIX = "mmo-"
MAX_TENANT_NAME = 200
# Random characters of a key kept in clear after its prefix (48 of its 256 bits): enough to
# tell keys apart when revoking one, too few to help guess the rest.
KEY_HINT_CHARS = 8
# The shortest prefix of a key `revoke_key` accepts (after `mm-`): fewer would match by luck.
MIN_REVOKE_CHARS = 6
_SECRET_CHARS = 43  # secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    """Hex SHA-256: keys and tokens have 256 random bits, so no salt or slow hash is needed."""
    return hashlib.sha256(secret.encode()).hexdigest()


def key_hint(key: str) -> str:
    """What the store keeps of a key in clear: its role prefix and first random characters."""
    prefix = OPERATOR_KEY_PREFIX if key.startswith(OPERATOR_KEY_PREFIX) else KEY_PREFIX
    return key[:len(prefix) + KEY_HINT_CHARS]


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
                                             key_hash=hash_secret(key), hint=key_hint(key),
                                             created_at=time.time()))
    return key


def authenticate(store: Store, key: str) -> Tenant | None:
    """The tenant owning `key`, or None for an unknown key."""
    if not key.startswith(KEY_PREFIX):
        return None
    query = (select(tenants.c.id, tenants.c.name)
             .join(api_keys, api_keys.c.tenant_id == tenants.c.id)
             .where(api_keys.c.key_hash == hash_secret(key), api_keys.c.revoked_at.is_(None)))
    with store.read() as conn:
        row = conn.execute(query).first()
    return Tenant(id=row.id, name=row.name) if row else None


def create_operator_key(store: Store) -> str:
    """A new operator key. Returned once, never stored."""
    key = OPERATOR_KEY_PREFIX + secrets.token_urlsafe(32)
    with store.write() as conn:
        conn.execute(insert(operator_keys).values(id=new_id("opk_"), key_hash=hash_secret(key),
                                                  hint=key_hint(key), created_at=time.time()))
    return key


def authenticate_operator(store: Store, key: str) -> Operator | None:
    """The operator holding `key`, or None (a tenant key or site token is no operator key)."""
    if not key.startswith(OPERATOR_KEY_PREFIX):
        return None
    with store.read() as conn:
        key_id = conn.execute(select(operator_keys.c.id).where(
            operator_keys.c.key_hash == hash_secret(key),
            operator_keys.c.revoked_at.is_(None))).scalar()
    return Operator(key_id=key_id) if key_id else None


def is_revoked(store: Store, key: str) -> bool:
    """Whether `key` is a revoked tenant or operator key (for a clearer 401)."""
    table = operator_keys if key.startswith(OPERATOR_KEY_PREFIX) else api_keys
    with store.read() as conn:
        return conn.execute(select(table.c.id).where(
            table.c.key_hash == hash_secret(key), table.c.revoked_at.is_not(None))
        ).first() is not None


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """A key as operators see it: never the key itself."""

    id: str
    tenant: str | None  # None: an operator key
    hint: str | None  # its first characters (None for keys made before hints were kept)
    created_at: float
    revoked_at: float | None


def _records(conn: Any, table: Table, where: Any) -> list[KeyRecord]:
    if table is api_keys:
        query = (select(api_keys.c.id, tenants.c.name.label("tenant"), api_keys.c.hint,
                        api_keys.c.created_at, api_keys.c.revoked_at)
                 .join(tenants, tenants.c.id == api_keys.c.tenant_id)
                 # Keys minted for an agent's lease die with it; they are not the operator's.
                 .where(api_keys.c.agent_id.is_(None)))
    else:
        query = select(operator_keys.c.id, operator_keys.c.hint, operator_keys.c.created_at,
                       operator_keys.c.revoked_at)
    rows = conn.execute(query.where(where).order_by(table.c.created_at)).all()
    return [KeyRecord(id=r.id, tenant=getattr(r, "tenant", None), hint=r.hint,
                      created_at=r.created_at, revoked_at=r.revoked_at) for r in rows]


def list_keys(store: Store, tenant: str | None = None) -> list[KeyRecord]:
    """Every tenant key (of `tenant` only, when given) and, without `tenant`, every operator
    key, oldest first."""
    with store.read() as conn:
        found = _records(conn, api_keys, tenants.c.name == tenant if tenant is not None
                         else api_keys.c.id.is_not(None))
        if tenant is None:
            found += _records(conn, operator_keys, operator_keys.c.id.is_not(None))
    return found


def _matching(table: Table, ref: str, prefix: str) -> Any:
    """The condition that picks the keys of `table` that `ref` names (its id, the whole key,
    or the key's first characters)."""
    if ref.startswith(("key_", "opk_")):
        return table.c.id == ref
    if len(ref) == len(prefix) + _SECRET_CHARS:
        return table.c.key_hash == hash_secret(ref)
    if len(ref) < len(prefix) + MIN_REVOKE_CHARS:
        raise InvalidRequestError(
            f"{ref!r} is too short to name a key: give its id (key_..., opk_...), the key, or "
            f"at least its first {len(prefix) + MIN_REVOKE_CHARS} characters", param="key")
    hint_chars = len(prefix) + KEY_HINT_CHARS
    return func.substr(table.c.hint, 1, min(len(ref), hint_chars)) == ref[:hint_chars]


def revoke_key(store: Store, ref: str, now: float) -> KeyRecord:
    """Revoke the one tenant or operator key `ref` names (its id, the whole key, or its first
    characters); it is refused from then on. NotFoundError if none matches, InvalidRequestError
    if several do (give more characters). Revoking a revoked key again changes nothing."""
    ref = ref.strip()
    if ref.startswith("mms-"):
        raise InvalidRequestError("a site token is replaced, not revoked: minimill sites "
                                  "create NAME --replace", param="key")
    operator = ref.startswith((OPERATOR_KEY_PREFIX, "opk_"))
    table = operator_keys if operator else api_keys
    if not ref.startswith((KEY_PREFIX, OPERATOR_KEY_PREFIX, "key_", "opk_")):
        raise InvalidRequestError(f"{ref[:20]!r} names no key: give its id (key_..., "
                                  "opk_...), the key (mm-..., mmo-...), or its first characters",
                                  param="key")
    where = _matching(table, ref, OPERATOR_KEY_PREFIX if operator else KEY_PREFIX)
    with store.write() as conn:
        found = _records(conn, table, where)
        if not found:
            raise NotFoundError("no key matches that id or prefix", param="key")
        if len(found) > 1:
            raise InvalidRequestError(f"{len(found)} keys match; give more characters or the "
                                      f"id ({', '.join(k.id for k in found[:5])})", param="key")
        key = found[0]
        if key.revoked_at is not None:
            return key
        conn.execute(update(table).where(table.c.id == key.id).values(revoked_at=now))
    return KeyRecord(id=key.id, tenant=key.tenant, hint=key.hint, created_at=key.created_at,
                     revoked_at=now)
