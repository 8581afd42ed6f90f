"""The box host: a site's loop that pulls boxes and their operations from the control plane.

One long poll at a time extends the leases of the boxes held, takes new boxes for free slots
and brings their queued operations. Each held box has a task that first builds its workspace
(from its latest snapshot's chain, else its image, else empty), then runs its operations as
they come, up to CONCURRENT_OPS_PER_BOX at once, each in a thread (sandbox.py), and posts each
result with the box's epoch; an exec's output is posted as it comes too (exec_output.py),
all of it before the result. A box whose workspace changed is snapshotted every
`snapshot_interval_s` while it has work, and once it goes idle, so that a host lost with it
costs at most that much of its files.

Snapshots are incremental where that pays (snapshots.py): the host keeps what it scanned for
a box's last snapshot, and the next one holds only what changed since, unless the chain is
long (every FULL_EVERY-th is full) or most of the files changed. A box this host restored
(after a restart, or from another host) has no such scan yet: its first snapshot is full.

`stop()`: no new boxes; running operations finish (up to `drain_timeout_s`), changed boxes
are snapshotted, and every box is released so it comes back elsewhere at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio

from minimill.boxes import snapshots
from minimill.boxes.archive import ArchiveBounds
from minimill.boxes.exec_output import ExecOutput
from minimill.boxes.host_client import BoxHostClient, NotHeld, ParentMissing, Refused
from minimill.boxes.host_snapshots import Taken, download_chain, take, upload
from minimill.boxes.ops import MUTATING, OpError, Workspace, run_op
from minimill.boxes.uids import UidPool
from minimill.boxes.workspace import PathError, usage_bytes
from minimill.transport.box_protocol import (
    BoxLease,
    BoxLimits,
    BoxOp,
    BoxOpError,
    BoxOpResult,
    BoxPollRequest,
    BoxReleaseRequest,
    BoxResultsRequest,
    HeldBox,
    SnapshotStored,
)
from minimill.transport.client import Backoff, ControlPlaneUnavailable, retrying, sleep_backoff

log = logging.getLogger("minimill.boxes")
T = TypeVar("T")
POLL_WAIT_S = 2.0
# Execs and file operations of one box run side by side (a harness's subagents share a box),
# up to this many; the rest wait in the box's queue. Each box has its own threads (this many,
# plus one for its builds and snapshots), so one tenant's slow operations never hold another
# box's.
CONCURRENT_OPS_PER_BOX = 4
EXCLUSIVE_OPS = frozenset({"snapshot", "pause"})
# Where archives on their way in and out are kept (under the host's root, never a workspace).
ARCHIVES_DIR = ".archives"


@dataclass
class HostedBox:
    lease: BoxLease
    ws: Workspace
    queue: asyncio.Queue[BoxOp] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None
    dirty: bool = False
    in_flight: int = 0  # operations running now
    ops: set[asyncio.Task[None]] = field(default_factory=set)
    threads: anyio.CapacityLimiter = field(
        default_factory=lambda: anyio.CapacityLimiter(CONCURRENT_OPS_PER_BOX + 1))
    last_snapshot_at: float = field(default_factory=time.monotonic)
    # The last snapshot this host took of the box, and the scan it was taken from: the next
    # one may be a delta of it. None: the next one is full.
    base: Taken | None = None

    @property
    def busy(self) -> bool:
        return self.in_flight > 0

    @property
    def box_id(self) -> str:
        return self.lease.box_id

    @property
    def epoch(self) -> int:
        return self.lease.epoch


class BoxHost:
    def __init__(self, client: BoxHostClient, root: Path, slots: int, *,
                 insecure: bool = False, snapshot_interval_s: float = 30.0,
                 drain_timeout_s: float = 10.0, uids: UidPool | None = None,
                 caps: BoxLimits | None = None) -> None:
        self.client = client
        # A root host's uid per box (uids.py); None: boxes run as this host's own uid.
        self.uids = uids
        # The operator's caps on every box limit: a lease asking for more runs within them.
        self.caps = caps
        self.root = root
        self.slots = slots
        self.insecure = insecure
        self.snapshot_interval_s = snapshot_interval_s
        self.drain_timeout_s = drain_timeout_s
        self.boxes: dict[str, HostedBox] = {}
        # A dropped box's files being removed, by box id: a box taken again by this host
        # builds its workspace only once they are gone (they share its paths).
        self._forgetting: dict[str, asyncio.Future[None]] = {}
        self.stopping = asyncio.Event()
        self.stats = {"boxes": 0, "ops": 0, "snapshots": 0, "revoked": 0}

    # ---- the poll loop ----------------------------------------------------------------------
    async def run(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        backoff = Backoff()
        while not self.stopping.is_set():
            ask = BoxPollRequest(
                capacity=max(0, self.slots - len(self.boxes)),
                held=[HeldBox(box_id=b.box_id, epoch=b.epoch) for b in self.boxes.values()],
                wait_s=POLL_WAIT_S)
            try:
                answer = await self.client.poll(ask)
            except (ControlPlaneUnavailable, Refused) as exc:
                await sleep_backoff(backoff, "box poll", exc)
                continue
            backoff.reset()
            for box_id in answer.revoked:
                self._drop(box_id, "revoked (deleted, paused or taken over)")
            for lease in answer.leases:
                self._take(lease)
            for op in answer.ops:
                box = self.boxes.get(op.box_id)
                if box is not None and box.epoch == op.epoch:
                    box.queue.put_nowait(op)
        await self._drain()

    def stop(self) -> None:
        self.stopping.set()

    def _take(self, lease: BoxLease) -> None:
        old = self.boxes.get(lease.box_id)
        if old is not None:
            # The box keeps its uid (take below returns it): the old one must not give it
            # back, or another box could be given it while this one runs.
            self._drop(lease.box_id, "re-leased at a newer epoch", keep_uid=True)
        ws = Workspace(path=self.root / lease.box_id, limits=self._capped(lease),
                       network=lease.network, insecure=self.insecure,
                       owner=self.uids.take(lease.box_id) if self.uids is not None else None)
        box = HostedBox(lease=lease, ws=ws)
        self.boxes[lease.box_id] = box
        self.stats["boxes"] += 1
        box.task = asyncio.create_task(self._box_main(box), name=f"box-{lease.box_id}")
        log.info("box %s (epoch %d) taken, starting from %s", lease.box_id, lease.epoch,
                 lease.snapshot_id or "an empty workspace")

    def _drop(self, box_id: str, why: str, keep_uid: bool = False) -> None:
        box = self.boxes.pop(box_id, None)
        if box is None:
            return
        self.stats["revoked"] += 1
        log.info("box %s %s: dropping its workspace", box_id, why)
        box.ws.cancel.set()
        if box.task is not None:
            box.task.cancel()
        forgetting = asyncio.get_running_loop().run_in_executor(None, self._forget, box,
                                                                 keep_uid)
        self._forgetting[box_id] = forgetting
        forgetting.add_done_callback(
            lambda done: self._forgetting.pop(box_id, None) if self._forgetting.get(box_id)
            is done else None)

    def _forget(self, box: HostedBox, keep_uid: bool) -> None:
        _remove(box.ws.path)
        _remove(self._archives(box))
        if self.uids is not None and not keep_uid:
            self.uids.give_back(box.box_id)

    def _capped(self, lease: BoxLease) -> BoxLimits:
        """The lease's limits, each at most the operator's cap (the control plane refuses a
        box over its own caps; a host whose operator set lower ones holds to them)."""
        if self.caps is None:
            return lease.limits
        asked, caps = lease.limits.model_dump(), self.caps.model_dump()
        capped = {name: min(value, caps[name]) for name, value in asked.items()}
        if capped != asked:
            log.warning("box %s asks for limits over this host's caps %s; it runs within them",
                        lease.box_id, {k: v for k, v in caps.items() if asked[k] > v})
        return BoxLimits.model_validate(capped)

    # ---- one box ----------------------------------------------------------------------------
    async def _box_main(self, box: HostedBox) -> None:
        try:
            await self._build(box)
        except (NotHeld, asyncio.CancelledError):
            return
        except PathError as exc:  # a refused archive: the box cannot run here or anywhere
            log.warning("box %s: cannot build its workspace: %s", box.box_id, exc)
            await self._fail_queued(box, exc.code, f"cannot build the workspace: {exc}")
            return
        except Exception as exc:
            log.exception("box %s: cannot build its workspace", box.box_id)
            await self._fail_queued(box, "invalid_archive", f"cannot build the workspace: {exc}")
            return
        limit = asyncio.Semaphore(CONCURRENT_OPS_PER_BOX)
        try:
            while True:
                # While changes may be pending, look again every interval.
                timeout = self.snapshot_interval_s if box.dirty or box.busy else None
                try:
                    op = await asyncio.wait_for(box.queue.get(), timeout)
                except TimeoutError:
                    if box.dirty and not box.busy:
                        await self._auto_snapshot(box)  # idle with changes
                    continue
                if op.kind in EXCLUSIVE_OPS:
                    await self._settle(box)
                    box.in_flight += 1
                    await self._run(box, op)
                else:
                    await limit.acquire()
                    box.in_flight += 1  # busy from now on, not from when the task starts
                    task = asyncio.create_task(self._run(box, op))
                    task.add_done_callback(lambda _t: limit.release())
                    box.ops.add(task)
                    task.add_done_callback(box.ops.discard)
                due = time.monotonic() - box.last_snapshot_at >= self.snapshot_interval_s
                if box.dirty and due:
                    await self._settle(box)
                    await self._auto_snapshot(box)
        finally:
            for task in list(box.ops):
                task.cancel()

    async def _settle(self, box: HostedBox) -> None:
        """Wait for the box's running operations (a snapshot sees their effects whole)."""
        if box.ops:
            await asyncio.gather(*list(box.ops), return_exceptions=True)

    def _archives(self, box: HostedBox) -> Path:
        return self.root / ARCHIVES_DIR / box.box_id

    async def _build(self, box: HostedBox) -> None:
        forgetting = self._forgetting.pop(box.box_id, None)
        if forgetting is not None:  # its previous run here: its files go first, whole
            await forgetting
        path = box.ws.path
        archives = self._archives(box)
        await self._in_thread(box, _remove, path)
        await self._in_thread(box, _remove, archives)
        archives.mkdir(parents=True)
        lease = box.lease
        ids = lease.chain or ([lease.snapshot_id] if lease.snapshot_id else [])
        chain = await download_chain(self.client, box.box_id, ids, archives)
        owner = box.ws.owner
        # An archive may hold what the box's quota allows, no more (archive.py checks each
        # before writing anything of it).
        bounds = ArchiveBounds(max_bytes=box.ws.quota_bytes)

        def build() -> None:
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o700)
            if owner is not None:
                os.chown(path, owner, owner)
            if any(p.stat().st_size for _, p in chain if isinstance(p, Path)):
                snapshots.restore(chain, path, owner, bounds)

        try:
            await self._in_thread(box, build)
        finally:
            await self._in_thread(box, _remove, archives)

    async def _in_thread(self, box: HostedBox, func: Callable[..., T], *args: Any) -> T:
        """`func(*args)` in one of the box's own threads."""
        return await anyio.to_thread.run_sync(func, *args, limiter=box.threads)

    async def _run(self, box: HostedBox, op: BoxOp) -> None:
        """Run one operation; the caller counted it in `box.in_flight` already."""
        result: dict[str, object] | None = None
        error: BoxOpError | None = None
        try:
            if op.kind in ("snapshot", "pause"):
                stored = await self._snapshot(box, "manual" if op.kind == "snapshot" else "auto")
                result = {"snapshot_id": stored}
            else:
                if op.kind == "exec":
                    result = await self._exec(box, op)
                else:
                    result = await self._in_thread(box, run_op, box.ws, op.kind, op.args)
                box.dirty = box.dirty or op.kind in MUTATING
        except OpError as exc:
            error = BoxOpError(code=exc.code, message=exc.message)
            box.dirty = box.dirty or op.kind in MUTATING
        except NotHeld:
            return
        finally:
            box.in_flight -= 1
        self.stats["ops"] += 1
        await self._post(BoxOpResult(op_id=op.op_id, box_id=op.box_id, epoch=op.epoch,
                                     result=result, error=error))

    async def _exec(self, box: HostedBox, op: BoxOp) -> dict[str, object]:
        output = ExecOutput(self.client, op)
        try:
            result = await self._in_thread(box, run_op, box.ws, op.kind, op.args,
                                           output.write)
        except BaseException:
            output.abandon()  # a failed exec's output goes with it: its error is what counts
            raise
        # All of its output goes before its result, so a reader sees every piece in order.
        await output.close()
        return result

    async def _snapshot(self, box: HostedBox, kind: str) -> str:
        """Take and store a snapshot; raises OpError when it cannot be (the workspace is over
        its quota, or the control plane refuses the archive for good)."""
        used = await self._in_thread(box, usage_bytes, box.ws.path)
        if used > box.ws.quota_bytes:
            raise OpError("disk_quota_exceeded",
                          f"the workspace holds {used} bytes, more than its quota of "
                          f"{box.ws.limits.disk_mb} MiB: free space before it is snapshotted")
        out = self._archives(box) / f"out-{secrets.token_hex(4)}"
        try:
            taken = await self._in_thread(box, take, box.ws.path, box.base, out)
            try:
                stored = await self._upload(box, kind, taken)
            except ParentMissing:
                log.info("box %s: the parent of its incremental snapshot is gone; sending a "
                         "full one", box.box_id)
                taken = await self._in_thread(box, take, box.ws.path, None, out)
                stored = await self._upload(box, kind, taken)
        except Refused as exc:
            raise OpError("snapshot_refused", f"the control plane refused the snapshot: "
                          f"{exc}") from None
        finally:
            await self._in_thread(box, _remove, out)
        box.base = Taken(manifest=taken.manifest, depth=taken.depth,
                         snapshot_id=stored.snapshot_id)
        log.debug("box %s: %s snapshot %s (%d bytes)", box.box_id,
                  "incremental" if taken.depth else "full", stored.snapshot_id, stored.bytes)
        box.dirty = False
        box.last_snapshot_at = time.monotonic()
        self.stats["snapshots"] += 1
        return stored.snapshot_id

    async def _auto_snapshot(self, box: HostedBox) -> None:
        """A snapshot the host takes on its own: one that cannot be taken is tried again
        after the next interval, and the box goes on meanwhile."""
        try:
            await self._snapshot(box, "auto")
        except OpError as exc:
            log.warning("box %s: no automatic snapshot (%s)", box.box_id, exc.message)
            box.last_snapshot_at = time.monotonic()

    async def _upload(self, box: HostedBox, kind: str, taken: Taken) -> SnapshotStored:
        return await upload(self.client, box.box_id, box.epoch, kind, taken.path,
                            functools.partial(self._in_thread, box))

    async def _post(self, item: BoxOpResult) -> None:
        try:
            answer = await retrying(lambda: self.client.results(
                BoxResultsRequest(results=[item])), "box result")
        except Refused as exc:
            if item.error is not None:
                log.error("the error result of %s was refused: %s", item.op_id, exc)
                return
            # A result the control plane cannot take (too large, malformed): the operation
            # fails with the reason, rather than waiting forever.
            await self._post(item.model_copy(update={"result": None, "error": BoxOpError(
                code="result_refused", message=f"the result was refused: {exc}")}))
            return
        if answer.rejected:
            log.info("result of %s on box %s rejected: the box is not this host's any more",
                     item.op_id, item.box_id)

    async def _fail_queued(self, box: HostedBox, code: str, message: str) -> None:
        while True:
            op = await box.queue.get()
            await self._post(BoxOpResult(op_id=op.op_id, box_id=op.box_id, epoch=op.epoch,
                                         error=BoxOpError(code=code, message=message)))

    # ---- stopping ---------------------------------------------------------------------------
    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while any(b.busy for b in self.boxes.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        boxes = list(self.boxes.values())
        # What still runs is stopped: its result says so (box_host_lost), so that no next host
        # runs it a second time.
        for box in boxes:
            box.ws.cancel.set()
        deadline = time.monotonic() + 5.0
        while any(b.busy for b in boxes) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for box in boxes:
            if box.task is not None:
                box.task.cancel()
        for box in boxes:
            if box.dirty and not box.busy:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._snapshot(box, "auto"), 30)
        if boxes:
            with contextlib.suppress(Exception):
                await self.client.release(BoxReleaseRequest(
                    boxes=[HeldBox(box_id=b.box_id, epoch=b.epoch) for b in boxes]))
            log.info("released %d boxes", len(boxes))
        for box in boxes:
            await anyio.to_thread.run_sync(self._forget, box, False)
        self.boxes.clear()


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
