"""A box host's snapshots on their way: taking one into a file (full, or a delta where that
pays), sending it to the control plane in parts, and downloading the chain a box is restored
from. Archives live in files, never whole in memory, whatever the workspace holds.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minimill.boxes import snapshots
from minimill.boxes.host_client import BoxHostClient
from minimill.transport.box_protocol import SNAPSHOT_PART_BYTES, SnapshotStored
from minimill.transport.client import retrying

# Runs a blocking call in a thread of the box's own.
InThread = Callable[..., Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class Taken:
    """A snapshot of a box's workspace: its archive's file and the scan it was taken from."""

    manifest: snapshots.Manifest
    depth: int  # deltas since the last full snapshot (0: this one is full)
    snapshot_id: str = ""  # the control plane's id, once stored
    path: Path = Path()


def take(root: Path, base: Taken | None, out: Path) -> Taken:
    """A delta of `base` where the rules say it pays (snapshots.worth_a_delta), else a full
    archive, written to the file `out`. The scan comes first: whatever changes after it
    differs from it next time."""
    now = snapshots.scan(root)
    out.parent.mkdir(parents=True, exist_ok=True)
    if base is not None and base.snapshot_id:
        delta = snapshots.diff(base.manifest, now)
        if snapshots.worth_a_delta(base.depth, delta, now):
            try:
                with open(out, "wb") as f:
                    snapshots.write_delta(root, base.snapshot_id, delta, now, f)
            except OSError:
                pass  # an entry went between the scan and the archive: a full one instead
            else:
                return Taken(manifest=now, depth=base.depth + 1, path=out)
    with open(out, "wb") as f:
        snapshots.write_full(root, f)
    return Taken(manifest=now, depth=0, path=out)


async def upload(client: BoxHostClient, box_id: str, epoch: int, kind: str, path: Path,
                 in_thread: InThread) -> SnapshotStored:
    """Send the archive at `path` in parts, each tried again on its own, then commit it."""
    upload_id = "snap_" + secrets.token_hex(12)
    seq = 0
    with open(path, "rb") as archive:
        while True:
            part = await in_thread(archive.read, SNAPSHOT_PART_BYTES)
            if not part and seq:
                break
            await retrying(functools.partial(client.put_snapshot_part, box_id, epoch,
                                             upload_id, seq, part), "snapshot part")
            seq += 1
            if not part:
                break
    return await retrying(functools.partial(client.commit_snapshot, box_id, epoch, kind,
                                            upload_id, seq), "snapshot commit")


async def download_chain(client: BoxHostClient, box_id: str, ids: list[str],
                         archives: Path) -> list[tuple[str, bytes | Path]]:
    """The archives of a chain, each streamed into a file under `archives`."""
    chain: list[tuple[str, bytes | Path]] = []
    for snapshot_id in ids:
        dest = archives / snapshot_id
        await retrying(functools.partial(client.download_snapshot, box_id, snapshot_id, dest),
                       "snapshot download")
        chain.append((snapshot_id, dest))
    return chain
