"""Wire messages between a box host (boxes/host.py) and the control plane (api/routes/
box_fleet.py serves, control/box_hosts.py decides).

A box host pulls, as a worker does: one long-polling call (`/poll`) extends the leases of the
boxes it holds, grants it new boxes for its free slots (each with a bumped fencing epoch and
the snapshot to start from) and hands it the operations queued for its boxes. Results,
snapshots and releases carry the box's epoch: a host whose lease lapsed (its box came back
elsewhere) is refused. While an exec runs, its host also posts its output as it comes
(`/output`), fenced the same way. Routes are under `/v1/fleet/boxes`, authenticated with the
site token. Times are Unix seconds from the control plane's clock.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

BOX_FLEET_PREFIX = "/v1/fleet/boxes"
# What a host may be asked to do with a box, in the order a tenant asked.
OpKind = Literal["exec", "write", "read", "list", "snapshot", "pause"]

# What an exec keeps of each of its stdout and stderr (the rest is discarded); its streamed
# output is held to the same size.
MAX_EXEC_OUTPUT_BYTES = 1024 * 1024
# The most text one streamed chunk carries (a host splits longer output).
MAX_CHUNK_CHARS = 64 * 1024
OutputStream = Literal["stdout", "stderr"]

# Fencing epochs count leases of one box or agent: a 32-bit column holds any real one, and a
# larger number from a client is a 400, not a store error.
Epoch = Annotated[int, Field(ge=0, le=2**31 - 1)]


class BoxLimits(BaseModel):
    """Per-exec limits of a box; each exec may lower its own timeout."""

    cpu_s: int = Field(default=60, ge=1, le=7 * 24 * 3600, description="CPU seconds per exec.")
    memory_mb: int = Field(default=1024, ge=16, le=1024 * 1024,
                           description="Address space per process, MiB.")
    max_processes: int = Field(default=64, ge=1, le=4096,
                               description="Processes and threads at once, per exec.")
    disk_mb: int = Field(default=1024, ge=1, le=1024 * 1024, description="Workspace quota, MiB.")
    timeout_s: float = Field(default=60.0, gt=0, le=7 * 24 * 3600,
                             description="Default wall clock per exec, seconds.")


# The operator's caps on every box limit unless set (`minimill serve|worker --box-max-*`, env
# MINIMILL_BOX_MAX_*): a tenant asking for more gets a 400 naming the limit, and a host runs
# no box past its own caps.
DEFAULT_BOX_CAPS = BoxLimits(cpu_s=3600, memory_mb=8192, max_processes=512, disk_mb=16384,
                             timeout_s=24 * 3600.0)
# Each limit's option (without `--box-max-`) and settings name.
CAP_NAMES = {"memory_mb": "memory-mb", "max_processes": "processes", "cpu_s": "cpu-s",
             "timeout_s": "exec-s", "disk_mb": "disk-mb"}


class HeldBox(BaseModel):
    box_id: str
    epoch: Epoch


class BoxPollRequest(BaseModel):
    capacity: int = Field(ge=0, le=4096, description="How many more boxes this host can take.")
    held: list[HeldBox] = Field(default_factory=list, max_length=4096)
    # Seconds the control plane may hold the call open while there is nothing to hand out.
    wait_s: float = Field(0.0, ge=0.0, le=10.0)


class BoxLease(BaseModel):
    box_id: str
    epoch: Epoch
    # The archive to start the workspace from (latest snapshot, else the image); None: empty.
    snapshot_id: str | None = None
    # What restoring it applies, in order: a full archive, then each incremental snapshot on
    # the one before (boxes/snapshots.py); it ends with `snapshot_id`.
    chain: list[str] = Field(default_factory=list)
    network: bool = False
    limits: BoxLimits = BoxLimits()


class BoxOp(BaseModel):
    op_id: str
    box_id: str
    epoch: Epoch
    kind: OpKind
    args: dict[str, Any] = Field(default_factory=dict)


class BoxPollResponse(BaseModel):
    lease_ttl_s: float
    leases: list[BoxLease] = Field(default_factory=list)
    # box_id -> new expiry, for boxes still held at the sent epoch.
    extended: dict[str, float] = Field(default_factory=dict)
    # Boxes the host no longer holds (deleted, paused, expired, taken over): drop them.
    revoked: list[str] = Field(default_factory=list)
    ops: list[BoxOp] = Field(default_factory=list)


class BoxOpError(BaseModel):
    code: str
    message: str


class BoxOpResult(BaseModel):
    op_id: str
    box_id: str
    epoch: Epoch
    result: dict[str, Any] | None = None
    error: BoxOpError | None = None


class BoxResultsRequest(BaseModel):
    results: list[BoxOpResult] = Field(max_length=1024)


class BoxResultsResponse(BaseModel):
    accepted: list[str]
    # Not this host's at that epoch any more: the result is dropped.
    rejected: list[str]


class BoxOutputChunk(BaseModel):
    # Numbered by the host from 1 for each run of the operation: a chunk sent again (its
    # answer was lost) is recognised and stored once.
    seq: int = Field(ge=1, le=2**31 - 1)
    stream: OutputStream
    data: str = Field(max_length=MAX_CHUNK_CHARS)


class BoxOutputRequest(BaseModel):
    """Output of a running exec, sent while it runs; refused (409) unless the host holds the
    box at `epoch` and the operation is running at that epoch."""

    op_id: str = Field(max_length=40)
    box_id: str = Field(max_length=40)
    epoch: Epoch
    chunks: list[BoxOutputChunk] = Field(max_length=64)


class BoxOutputResponse(BaseModel):
    # Chunks stored now (chunks seen before, or past the output limit, are not counted).
    stored: int


class BoxReleaseRequest(BaseModel):
    """Boxes the host gives back (it is stopping): they come back elsewhere from their latest
    snapshot at once."""

    boxes: list[HeldBox] = Field(max_length=4096)


class BoxReleaseResponse(BaseModel):
    released: list[str]


class SnapshotStored(BaseModel):
    snapshot_id: str
    bytes: int
    incremental: bool = False


# An incremental snapshot's upload names (in its archive's header) a parent the control plane
# does not have for that box: a 409 with this code; the host sends a full archive instead.
SNAPSHOT_PARENT_NOT_FOUND = "snapshot_parent_not_found"

# Snapshots travel in parts of at most this many bytes (PUT .../snapshots/uploads/{upload}/
# parts/{seq}), then a commit (POST .../snapshots?upload=...&parts=N): no call carries more, so
# a snapshot's size is bounded by the control plane's file limit, not by one body's.
SNAPSHOT_PART_BYTES = 8 * 1024 * 1024
# An upload's id: chosen by the host, the snapshot's id once committed.
SNAPSHOT_UPLOAD_ID = r"^snap_[0-9a-f]{24}$"
