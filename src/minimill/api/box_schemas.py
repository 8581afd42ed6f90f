"""Wire schemas of `/v1/boxes` (separate from the store's rows and the host protocol)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from minimill.control.box_records import BoxRecord, SnapshotRecord
from minimill.transport.box_protocol import BoxLimits

MAX_INLINE_BYTES = 16 * 1024 * 1024
MAX_IDLE_TIMEOUT_S = 365 * 24 * 3600.0


class BoxCreate(BaseModel):
    image: str | None = Field(None, description="An image id (POST /v1/boxes/images) to "
                              "start from.")
    snapshot: str | None = Field(None, description="A snapshot id to restore into the new box.")
    network: bool = Field(False, description="Let the box reach the network (off by default).")
    limits: BoxLimits = BoxLimits()
    metadata: dict[str, str] | None = Field(None, max_length=16)
    idle_timeout_s: float | None = Field(
        None, gt=0, le=MAX_IDLE_TIMEOUT_S,
        description="After this many seconds without an operation (exec, file, snapshot), "
        "apply `idle_action`. null: never. Left out: the server's default "
        "(MINIMILL_BOX_IDLE_TIMEOUT_S; never unless set).")
    idle_action: Literal["pause"] = Field(
        "pause", description="What an idle box does. pause: snapshot it and free its host; "
        "the next exec or file operation resumes it (same id, same files).")

    @model_validator(mode="after")
    def _one_source(self) -> BoxCreate:
        if self.image is not None and self.snapshot is not None:
            raise ValueError("give either image or snapshot, not both")
        return self


class BoxObject(BaseModel):
    id: str
    object: Literal["box"] = "box"
    status: str
    created_at: int
    network: bool
    limits: BoxLimits
    # The image or snapshot it was created from, and its latest snapshot.
    source: str | None
    latest_snapshot: str | None
    # Times it came back on another host (its host was lost, or it was resumed).
    restarts: int
    metadata: dict[str, Any] | None
    # Its idle policy (None: never idles out), and when an operation last used it.
    idle_timeout_s: float | None = None
    idle_action: str = "pause"
    last_active_at: int | None = None
    # Why a paused box is paused: "idle" (its next operation resumes it) or "request" (it
    # waits for POST .../resume). None unless paused.
    pause_reason: Literal["idle", "request"] | None = None

    @classmethod
    def of(cls, record: BoxRecord) -> BoxObject:
        paused = record.status.value == "paused"
        return cls(id=record.id, status=record.status.value, created_at=int(record.created_at),
                   network=record.network, limits=BoxLimits.model_validate(record.limits),
                   source=record.image_id, latest_snapshot=record.snapshot_id,
                   restarts=record.restarts, metadata=record.metadata,
                   idle_timeout_s=record.idle_timeout_s, idle_action=record.idle_action,
                   last_active_at=(int(record.last_active_at)
                                   if record.last_active_at is not None else None),
                   pause_reason=("idle" if record.idle_paused else "request")
                   if paused else None)


class BoxList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BoxObject]


class BoxDeleted(BaseModel):
    id: str
    object: Literal["box.deleted"] = "box.deleted"
    deleted: bool = True


class SnapshotObject(BaseModel):
    id: str
    object: Literal["box.snapshot"] = "box.snapshot"
    box_id: str | None
    kind: str
    bytes: int
    created_at: int
    incremental: bool = Field(False, description="Only what changed since `parent`; a "
                              "restore applies its chain (a full snapshot, then deltas).")
    parent: str | None = Field(None, description="The snapshot an incremental one is a "
                               "delta of.")

    @classmethod
    def of(cls, record: SnapshotRecord) -> SnapshotObject:
        return cls(id=record.id, box_id=record.box_id, kind=record.kind.value,
                   bytes=record.bytes, created_at=int(record.created_at),
                   incremental=record.incremental, parent=record.parent_id)


class SnapshotList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SnapshotObject]


class ExecCreate(BaseModel):
    command: list[str] | str = Field(description="argv, or a string run by /bin/sh -c.")
    stdin: str = Field("", max_length=MAX_INLINE_BYTES)
    env: dict[str, str] = Field(default_factory=dict, max_length=256)
    timeout_s: float | None = Field(None, gt=0, le=7 * 24 * 3600,
                                    description="Wall clock; default: the box's limit.")
    stream: bool = Field(False, description="Answer with server-sent events: stdout and "
                         "stderr as they come, then the exit (text/event-stream).")

    @model_validator(mode="after")
    def _not_empty(self) -> ExecCreate:
        if not self.command or (isinstance(self.command, list) and not self.command[0]):
            raise ValueError("command must not be empty")
        return self


class ExecResult(BaseModel):
    object: Literal["box.exec"] = "box.exec"
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool
    # "timeout" | "disk_quota_exceeded" when a limit ended or spoiled the exec; "cpu_limit" |
    # "memory_limit" where the host holds the exec in a cgroup.
    error: str | None = None
    output_truncated: bool = False


class FileWritten(BaseModel):
    object: Literal["box.file"] = "box.file"
    path: str
    bytes: int


class FileEntry(BaseModel):
    name: str
    type: str  # file | dir | symlink | other
    bytes: int


class FileListing(BaseModel):
    object: Literal["list"] = "list"
    path: str
    data: list[FileEntry]
