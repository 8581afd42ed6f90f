"""Statuses and typed records of boxes, their operations and their snapshots."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class BoxStatus(StrEnum):
    PENDING = "pending"  # waiting for a host (new, resumed, or its host was lost)
    RUNNING = "running"  # a host holds it at the row's current epoch
    PAUSED = "paused"  # snapshotted and on no host; resume sends it back to pending
    DELETED = "deleted"  # gone; its operations fail, its host drops its workspace


class OpStatus(StrEnum):
    QUEUED = "queued"  # waiting for the box's host
    RUNNING = "running"  # its host took it at `epoch`
    SUCCEEDED = "succeeded"  # `result` is set
    FAILED = "failed"  # `error` is set (a limit, a bad path, a lost host, a deleted box)


TERMINAL_OP_STATUSES = (OpStatus.SUCCEEDED, OpStatus.FAILED)

# The idle policy lives in the box row's `limits` JSON under this key ({"timeout_s": seconds or
# None, "action": "pause"}), beside the per-exec limits that hosts read (they ignore it).
IDLE_KEY = "idle"
IDLE_ACTIONS = ("pause",)


class SnapshotKind(StrEnum):
    IMAGE = "image"  # uploaded by a tenant to create boxes from
    MANUAL = "manual"  # asked for by the tenant; kept until the box is deleted
    AUTO = "auto"  # taken by the host after changes; only the latest is kept


@dataclass(frozen=True, slots=True)
class BoxRecord:
    id: str
    tenant_id: str
    status: BoxStatus
    epoch: int
    image_id: str | None
    snapshot_id: str | None
    network: bool
    limits: dict[str, Any]
    metadata: dict[str, Any] | None
    created_at: float
    restarts: int
    # Its idle policy: after `idle_timeout_s` (None: never) with no operation, `idle_action`.
    idle_timeout_s: float | None = None
    idle_action: str = "pause"
    last_active_at: float | None = None
    idle_paused: bool = False  # paused by its idle policy: its next operation resumes it


@dataclass(frozen=True, slots=True)
class OpRecord:
    id: str
    box_id: str
    kind: str
    status: OpStatus
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    epoch: int | None = None  # the box's epoch when its host took it (None: not taken yet)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_OP_STATUSES


@dataclass(frozen=True, slots=True)
class OutputChunk:
    """A piece of a running exec's output (box_op_output)."""

    epoch: int
    seq: int
    stream: str  # stdout | stderr
    data: str


@dataclass(frozen=True, slots=True)
class SnapshotRecord:
    id: str
    tenant_id: str
    box_id: str | None
    kind: SnapshotKind
    bytes: int
    created_at: float
    # The snapshot this one is a delta of; None: a full archive (its chain is itself alone).
    parent_id: str | None = None

    @property
    def incremental(self) -> bool:
        return self.parent_id is not None


def idle_timeout(limits: dict[str, Any] | None) -> float | None:
    """The idle timeout stored in a box row's `limits` JSON (None: never)."""
    idle = (limits or {}).get(IDLE_KEY) or {}
    timeout = idle.get("timeout_s") if isinstance(idle, dict) else None
    return float(timeout) if timeout is not None else None


def box_record(row: Any) -> BoxRecord:
    """A box from its row; `last_active_at` and `idle_paused` when the query joined
    box_activity."""
    limits = dict(row.limits or {})
    idle = limits.pop(IDLE_KEY, None) or {}
    mapping = row._mapping
    return BoxRecord(id=row.id, tenant_id=row.tenant_id, status=BoxStatus(row.status),
                     epoch=row.epoch, image_id=row.image_id, snapshot_id=row.snapshot_id,
                     network=bool(row.network), limits=limits,
                     metadata=row.metadata, created_at=row.created_at, restarts=row.restarts,
                     idle_timeout_s=idle_timeout({IDLE_KEY: idle}),
                     idle_action=str(idle.get("action") or "pause"),
                     last_active_at=mapping.get("last_active_at"),
                     idle_paused=bool(mapping.get("idle_paused") or False))


def op_record(row: Any) -> OpRecord:
    return OpRecord(id=row.id, box_id=row.box_id, kind=row.kind, status=OpStatus(row.status),
                    result=row.result, error=row.error, epoch=row.epoch)


def snapshot_record(row: Any) -> SnapshotRecord:
    return SnapshotRecord(id=row.id, tenant_id=row.tenant_id, box_id=row.box_id,
                          kind=SnapshotKind(row.kind), bytes=row.bytes,
                          created_at=row.created_at, parent_id=row.parent_id)
