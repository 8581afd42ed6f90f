"""Per-tenant quotas on what a tenant keeps: live boxes, unfinished agents, stored bytes of
files (tenant_limits.py holds the numbers). Each check runs inside the write transaction that
adds the thing, so it counts what is there at that moment; over the quota the answer is
OpenAI's 429 `insufficient_quota`, which its clients do not retry (x-should-retry: false):
waiting does not help, deleting something (or the operator's `minimill tenants set`) does.

Batch output and error files are written whatever the quota: a tenant's finished work is
never lost for it, it only counts against its next upload.
"""

from __future__ import annotations

from sqlalchemy import Connection, func, select

from minimill.control.box_records import BoxStatus
from minimill.control.errors import ControlError
from minimill.control.tables import agents, boxes, files
from minimill.control.tenant_limits import TenantLimits

_UNFINISHED_AGENTS = ("queued", "running", "sleeping")  # agents.AgentStatus, not terminal
_KEPT_FILES = ("writing", "processed")  # files.py: not being deleted


class QuotaExceededError(ControlError):
    """Over a quota (429 insufficient_quota)."""

    status_code = 429
    error_type = "insufficient_quota"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message, param=param, code="insufficient_quota")
        self.headers = {"x-should-retry": "false"}


def check_boxes(conn: Connection, tenant_id: str, limits: TenantLimits | None) -> None:
    cap = limits.max_boxes if limits is not None else None
    if cap is None:
        return
    live = conn.execute(select(func.count()).select_from(boxes).where(
        boxes.c.tenant_id == tenant_id, boxes.c.status != BoxStatus.DELETED.value)).scalar()
    if int(live or 0) >= cap:
        raise QuotaExceededError(f"You have {live} boxes; your quota is {cap}. Delete a box "
                                 "(DELETE /v1/boxes/{box_id}) before creating another.")


def check_agents(conn: Connection, tenant_id: str, limits: TenantLimits | None) -> None:
    cap = limits.max_agents if limits is not None else None
    if cap is None:
        return
    running = conn.execute(select(func.count()).select_from(agents).where(
        agents.c.tenant_id == tenant_id, agents.c.status.in_(_UNFINISHED_AGENTS))).scalar()
    if int(running or 0) >= cap:
        raise QuotaExceededError(f"You have {running} unfinished agents; your quota is {cap}. "
                                 "Wait for one to finish or cancel one first.")


def stored_bytes(conn: Connection, tenant_id: str, excluding: str | None = None) -> int:
    query = select(func.coalesce(func.sum(files.c.bytes), 0)).where(
        files.c.tenant_id == tenant_id, files.c.status.in_(_KEPT_FILES))
    if excluding is not None:
        query = query.where(files.c.id != excluding)
    return int(conn.execute(query).scalar() or 0)


def check_stored_bytes(conn: Connection, tenant_id: str, adding: int,
                       limits: TenantLimits | None, excluding: str | None = None) -> None:
    """Refuse `adding` more bytes of files past the tenant's quota (`excluding`: the file
    being added, counted in `adding`)."""
    cap = limits.max_stored_bytes if limits is not None else None
    if cap is None:
        return
    used = stored_bytes(conn, tenant_id, excluding)
    if used + adding > cap:
        raise QuotaExceededError(
            f"Your files hold {used} bytes; adding {adding} would pass your quota of {cap} "
            "bytes. Delete files you no longer need (DELETE /v1/files/{file_id}).",
            param="file")
