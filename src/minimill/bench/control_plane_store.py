"""The store of a `bench control-plane` run (control_plane_bench.py): emptied before it,
its tenants and sites registered, and what the run left in it read back afterwards."""

from __future__ import annotations

from sqlalchemy import func, select, text

from minimill.control.keys import create_key
from minimill.control.sites import create_site
from minimill.control.store import open_store
from minimill.control.tables import metadata, requests, sites


def fresh_store(url: str) -> None:
    """An empty store at `url` (a PostgreSQL database keeps its tables between runs)."""

    store = open_store(url)
    try:
        if store.is_postgres:
            with store.write() as conn:
                metadata.drop_all(conn)
    finally:
        store.close()


def register(url: str, num_sites: int) -> tuple[dict[str, str], list[str]]:
    """(the two tenants' API keys by tenant, the tokens of `num_sites` new sites)."""

    store = open_store(url)
    try:
        keys = {t: create_key(store, t) for t in ("batch-tenant", "realtime-tenant")}
        return keys, [create_site(store, f"site-{i}", 1.0) for i in range(num_sites)]
    finally:
        store.close()


def pg_rows_written(url: str) -> int | None:
    """Tuples inserted, updated and deleted in the store's database so far (PostgreSQL)."""
    if not url.startswith("postgres"):
        return None


    store = open_store(url)
    try:
        with store.read() as conn:
            return int(conn.execute(text(
                "SELECT tup_inserted + tup_updated + tup_deleted FROM pg_stat_database "
                "WHERE datname = current_database()")).scalar() or 0)
    finally:
        store.close()


def store_counts(url: str) -> dict[str, int]:
    """Requests by status, and the sites' counters, as the store holds them."""


    store = open_store(url)
    try:
        with store.read() as conn:
            statuses: dict[str, int] = dict(conn.execute(select(requests.c.status, func.count())
                                         .group_by(requests.c.status)).tuples().all())
            totals = conn.execute(select(
                func.coalesce(func.sum(sites.c.completions), 0),
                func.coalesce(func.sum(sites.c.leases_expired), 0),
                func.coalesce(func.sum(sites.c.stale_completions), 0),
                func.coalesce(func.sum(sites.c.leases_granted), 0))).one()
    finally:
        store.close()
    return {"succeeded": int(statuses.get("succeeded", 0)),
            "unfinished": sum(n for s, n in statuses.items()
                              if s not in ("succeeded", "failed", "cancelled", "expired")),
            "completions_accepted": int(totals[0]), "leases_expired": int(totals[1]),
            "stale_completions": int(totals[2]), "leases_granted": int(totals[3])}
