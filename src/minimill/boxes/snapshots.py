"""Snapshot archives of a workspace, full or incremental, and their restore.

A full snapshot is a gzipped tar of the workspace (images are the same). An incremental one
(a delta) holds only what changed since its parent snapshot: the entries added or changed
(by their stat signature: type, mode, size, mtime, ctime, inode, link target) and the paths
deleted. Its blob is DELTA_MAGIC, a JSON header (parent id, deleted paths, and the entry count
and file bytes of the workspace it makes), then the gzipped tar of those entries: never a tar
member, so no file of the box can be mistaken for it.

Restoring applies a chain, the full archive first and each delta on the one before it; every
delta checks that it is applied on its own parent, and the last one that the result has the
entries and bytes it had when it was taken. A broken chain is a SnapshotError (the API's
`invalid_archive`), never a workspace that differs from the snapshot.

Signatures, not contents, decide what goes into a delta: a file touched but unchanged is
stored again (harmless), and a file whose signature did not move cannot have changed, except
within the timestamp granularity of the scan itself. Entries modified shortly before a scan
are therefore stored again by the next delta whatever their signature says (as git treats
"racily clean" files).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import struct
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from minimill.boxes.archive import ArchiveBounds, ArchiveError, extract
from minimill.boxes.workspace import PathError, parts_of

DELTA_MAGIC = b"MMSNAPDELTA1\n"
_HEADER_LEN = struct.Struct(">I")
# Entries whose mtime is this close to their scan are stored again by the next delta.
RACY_NS = 2_000_000_000
# Chains are bounded: every FULL_EVERY-th snapshot is a full one, and so is one whose delta
# would carry more than FULL_RATIO of the workspace's file bytes.
FULL_EVERY = 8
FULL_RATIO = 0.5


class SnapshotError(PathError):
    """A snapshot (chain) that cannot be restored as it was taken."""

    def __init__(self, message: str, code: str = "invalid_archive") -> None:
        super().__init__(message, code=code)


@dataclass(frozen=True, slots=True)
class Item:
    kind: str  # file | dir | symlink
    mode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    target: str = ""  # a symlink's


@dataclass(slots=True)
class Manifest:
    """What a scan found: workspace-relative paths (sorted: parents first) and when."""

    items: dict[str, Item] = field(default_factory=dict)
    scanned_ns: int = 0

    @property
    def file_bytes(self) -> int:
        return sum(i.size for i in self.items.values() if i.kind == "file")


def scan(root: Path) -> Manifest:
    """The workspace's files, directories and symlinks (what a tar keeps: sockets, pipes and
    devices are left out), never following a symlink."""
    started = time.time_ns()
    items: dict[str, Item] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        for name in (*dirnames, *sorted(filenames)):
            full = os.path.join(dirpath, name)
            try:
                st = os.lstat(full)
            except OSError:
                continue  # removed meanwhile
            if stat.S_ISREG(st.st_mode):
                kind = "file"
            elif stat.S_ISDIR(st.st_mode):
                kind = "dir"
            elif stat.S_ISLNK(st.st_mode):
                kind = "symlink"
            else:
                continue
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            items[rel] = Item(kind=kind, mode=stat.S_IMODE(st.st_mode),
                              size=st.st_size if kind == "file" else 0,
                              mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns, ino=st.st_ino,
                              target=os.readlink(full) if kind == "symlink" else "")
    return Manifest(items=dict(sorted(items.items())), scanned_ns=started)


@dataclass(frozen=True, slots=True)
class Delta:
    changed: list[str]  # added or changed, parents first
    deleted: list[str]  # gone (or changed type), none under another one of them
    changed_bytes: int


def diff(base: Manifest, now: Manifest) -> Delta:
    changed: list[str] = []
    gone: list[str] = []
    for path, item in now.items.items():
        before = base.items.get(path)
        if before is None:
            changed.append(path)
        elif before.kind != item.kind:
            gone.append(path)  # removed first, then the new one is extracted
            changed.append(path)
        elif item.kind == "dir":
            if before.mode != item.mode:
                changed.append(path)
        elif before != item or before.mtime_ns >= base.scanned_ns - RACY_NS:
            changed.append(path)
    gone += [p for p in base.items if p not in now.items]
    deleted: list[str] = []
    removed: set[str] = set()
    for path in sorted(set(gone)):
        parts = path.split("/")
        # A deleted directory takes what was under it along.
        if not any("/".join(parts[:i]) in removed for i in range(1, len(parts))):
            deleted.append(path)
            removed.add(path)
    size = sum(now.items[p].size for p in changed if now.items[p].kind == "file")
    return Delta(changed=changed, deleted=deleted, changed_bytes=size)


def worth_a_delta(base_depth: int, delta: Delta, now: Manifest) -> bool:
    """A delta on a chain of `base_depth` deltas, or a full snapshot instead."""
    if base_depth + 1 >= FULL_EVERY:
        return False
    return delta.changed_bytes <= FULL_RATIO * now.file_bytes


def write_full(root: Path, out: IO[bytes]) -> None:
    """The workspace as a gzipped tar, streamed to `out` (a file: a workspace of any size is
    never held in memory). Symlinks are kept as links, never followed; sockets, pipes and
    devices are left out, as a restore would refuse them."""
    with tarfile.open(fileobj=out, mode="w:gz", compresslevel=3) as tar:
        for name in sorted(os.listdir(root)):
            tar.add(root / name, arcname=name, recursive=True, filter=_keepable)


def pack_full(root: Path) -> bytes:
    """`write_full` into memory (small workspaces, tests)."""
    buf = io.BytesIO()
    write_full(root, buf)
    return buf.getvalue()


def _keepable(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    return info if info.isreg() or info.isdir() or info.issym() or info.islnk() else None


def write_delta(root: Path, parent_id: str, delta: Delta, now: Manifest,
                out: IO[bytes]) -> None:
    """A delta of the workspace, streamed to `out`."""
    header = json.dumps({"parent": parent_id, "deleted": delta.deleted,
                         "entries": len(now.items), "file_bytes": now.file_bytes}).encode()
    out.write(DELTA_MAGIC)
    out.write(_HEADER_LEN.pack(len(header)))
    out.write(header)
    with tarfile.open(fileobj=out, mode="w:gz", compresslevel=3) as tar:
        for path in delta.changed:
            tar.add(root / path, arcname=path, recursive=False, filter=_keepable)


def pack_delta(root: Path, parent_id: str, delta: Delta, now: Manifest) -> bytes:
    """`write_delta` into memory (small workspaces, tests)."""
    buf = io.BytesIO()
    write_delta(root, parent_id, delta, now, buf)
    return buf.getvalue()


@dataclass(frozen=True, slots=True)
class DeltaHeader:
    parent: str
    deleted: list[str]
    entries: int
    file_bytes: int


# The longest delta header read (the paths it deletes are in it).
MAX_DELTA_HEADER_BYTES = 64 * 1024 * 1024


def read_delta(blob: bytes | Path) -> tuple[DeltaHeader, bytes | tuple[Path, int]] | None:
    """A delta's header and its tar (bytes, or the file and the offset it starts at); None
    for a full archive."""
    if isinstance(blob, Path):
        with open(blob, "rb") as f:
            head = f.read(len(DELTA_MAGIC) + 4)
            if not head.startswith(DELTA_MAGIC):
                return None
            header = _parse_header(head, lambda n: f.read(n))
            return header, (blob, f.tell())
    if not blob.startswith(DELTA_MAGIC):
        return None
    offset = len(DELTA_MAGIC) + 4
    view = io.BytesIO(blob)
    view.seek(offset)
    header = _parse_header(blob[:offset], view.read)
    return header, blob[view.tell():]


def delta_header(first: bytes, more: Callable[[int], bytes]) -> DeltaHeader | None:
    """The header of an archive whose first bytes are `first` (`more(n)` reads the next n);
    None for a full archive."""
    if not first.startswith(DELTA_MAGIC):
        return None
    return _parse_header(first, more)


def _parse_header(head: bytes, more: Callable[[int], bytes]) -> DeltaHeader:
    start = len(DELTA_MAGIC)
    try:
        (length,) = _HEADER_LEN.unpack_from(head, start)
        if length > MAX_DELTA_HEADER_BYTES:
            raise ValueError(f"a header of {length} bytes")
        text = head[start + 4:start + 4 + length]
        text += more(length - len(text)) if len(text) < length else b""
        raw = json.loads(text)
        return DeltaHeader(parent=str(raw["parent"]),
                           deleted=[str(p) for p in raw["deleted"]],
                           entries=int(raw["entries"]), file_bytes=int(raw["file_bytes"]))
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise SnapshotError(f"an incremental snapshot's header is unreadable: {exc}") from None


# What a restore refuses past, where its caller names no bound (the box's quota).
DEFAULT_BOUNDS = ArchiveBounds(max_bytes=1024 * 1024 * 1024)


def restore(chain: Sequence[tuple[str, bytes | Path]], root: Path, owner: int | None = None,
            bounds: ArchiveBounds = DEFAULT_BOUNDS) -> None:
    """Build the workspace at `root` (empty) from a chain of (snapshot id, archive): a full
    archive, then each delta on the one before it. Each archive is checked whole against
    `bounds` before anything of it is written (archive.py); files belong to `owner`."""
    if not chain:
        return
    last: DeltaHeader | None = None
    for i, (snapshot_id, blob) in enumerate(chain):
        delta = read_delta(blob)
        if i == 0:
            if delta is not None:
                raise SnapshotError(f"snapshot {snapshot_id} is incremental (of "
                                    f"{delta[0].parent}), but its chain starts with it")
            _unpack(blob, root, owner, bounds, snapshot_id, replace=False)
            continue
        if delta is None:
            raise SnapshotError(f"snapshot {snapshot_id} is a full archive in the middle of a "
                                "chain")
        header, archive = delta
        if header.parent != chain[i - 1][0]:
            raise SnapshotError(f"snapshot {snapshot_id} was taken on {header.parent}, not on "
                                f"{chain[i - 1][0]}")
        for path in header.deleted:
            _remove(root, path)
        _unpack(archive, root, owner, bounds, snapshot_id, replace=True)
        last = header
    if last is not None:
        now = scan(root)
        if (len(now.items), now.file_bytes) != (last.entries, last.file_bytes):
            raise SnapshotError(
                f"restoring snapshot {chain[-1][0]} gave {len(now.items)} entries and "
                f"{now.file_bytes} bytes of files, where it had {last.entries} and "
                f"{last.file_bytes}: its chain does not add up")


def _unpack(archive: bytes | Path | tuple[Path, int], root: Path, owner: int | None,
            bounds: ArchiveBounds, snapshot_id: str, replace: bool) -> None:
    """Extract one archive of the chain. A delta's entries replace what is there (removed
    first: writing into an existing file would write through a hard link it shares)."""
    try:
        extract(archive, root, bounds, owner=owner, replace=replace)
    except ArchiveError as exc:
        what = "incremental snapshot" if replace else "snapshot or image"
        raise SnapshotError(f"{what} {snapshot_id} cannot be unpacked: {exc}",
                            code=exc.code) from None


def _remove(root: Path, path: str) -> None:
    """Delete a path of the workspace being restored, without following any symlink."""
    parts = parts_of(path)
    if not parts:
        raise SnapshotError(f"an incremental snapshot deletes {path!r}, the workspace itself")
    where = root
    for name in parts[:-1]:
        where = where / name
        try:
            if not stat.S_ISDIR(os.lstat(where).st_mode):
                return  # a symlink or file there: nothing of ours lies under it
        except FileNotFoundError:
            return
    target = where / parts[-1]
    try:
        mode = os.lstat(target).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(target)
    else:
        target.unlink()
