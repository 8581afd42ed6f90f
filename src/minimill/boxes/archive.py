"""Unpacking an image or snapshot archive into a workspace, as a hostile archive requires.

Archives come from tenants (`POST /v1/boxes/images`) and from sites (snapshots a compromised
host may have planted), and the host unpacks them unsandboxed, as root on root hosts. So:

- Two passes over the (streamed, decompressed) archive. The first writes nothing: it reads
  every header and refuses the archive unless each member is acceptable and the whole stays
  within `ArchiveBounds`: member count, logical bytes (a sparse file counts its full size, a
  hard link its target's size again) and, for a compressed archive, bytes per compressed
  byte. Decompression is counted as it goes, so a gzip bomb is refused after reading at most
  the bound, never unpacked. Only then does the second pass extract.
- Every path is resolved from the workspace's directory descriptor one component at a time
  with O_NOFOLLOW (openat): there is no long path to overflow PATH_MAX and no symlink to
  follow, whatever the archive planted before. A member whose path runs through a symlink is
  refused; so are absolute names, `..`, device nodes, FIFOs and hard links to anything but an
  earlier member of the same archive.
- A symlink is stored as a symlink, its target untouched: it is resolved only inside the
  box's sandbox, where `/usr/bin/python3` is the box's own read-only system (a venv is made of
  such links). Nothing on the host ever resolves it.
- Files are written with holes where the archive has zeros, so a sparse file stays sparse.
"""

from __future__ import annotations

import bz2
import contextlib
import errno
import gzip
import io
import lzma
import os
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

from minimill.boxes.workspace import PathError

# Decompressed bytes per archive byte at most, once past RATIO_FLOOR_BYTES. Deflate cannot go
# past about 1032:1; xz and bzip2 can go past a million to one.
DEFAULT_MAX_RATIO = 1100.0
RATIO_FLOOR_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_MEMBERS = 200_000
# A member's name (long names come in extra headers), and any one extra header.
MAX_NAME_CHARS = 16 * 1024
MAX_HEADER_BYTES = 1024 * 1024
# Headers and padding: what a tar holds besides its files' data, per member.
_FRAMING_PER_MEMBER = 3 * 512
_COPY_CHUNK = 256 * 1024
_ZEROS = bytes(_COPY_CHUNK)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ArchiveError(PathError):
    """An archive refused whole; nothing of it was written."""

    def __init__(self, message: str, code: str = "invalid_archive") -> None:
        super().__init__(message, code=code)


@dataclass(frozen=True, slots=True)
class ArchiveBounds:
    max_bytes: int  # logical bytes of all files together
    max_members: int = DEFAULT_MAX_MEMBERS
    max_ratio: float = DEFAULT_MAX_RATIO


@dataclass(frozen=True, slots=True)
class Summary:
    members: int
    logical_bytes: int


# An archive: in memory, a file, or the part of a file from an offset on (a delta's tar).
Source = bytes | Path | tuple[Path, int]


def _open_source(source: Source) -> IO[bytes]:
    if isinstance(source, bytes):
        return io.BytesIO(source)
    path, offset = (source, 0) if isinstance(source, Path) else source
    f = open(path, "rb")  # the caller closes it
    f.seek(offset)
    return f


class _Counted(io.RawIOBase):
    """A stream that counts what passes through it and stops (ArchiveError) past a bound."""

    def __init__(self, inner: IO[bytes], limit: int | None = None,
                 compressed: _Counted | None = None, max_ratio: float = 0.0) -> None:
        self._inner = inner
        self.count = 0
        self._limit = limit
        self._compressed = compressed
        self._max_ratio = max_ratio

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._inner.read(len(buffer))
        n = len(data)
        buffer[:n] = data
        self.count += n
        if self._limit is not None and self.count > self._limit:
            raise ArchiveError(f"the archive unpacks to more than {self._limit} bytes",
                               code="archive_too_large")
        if (self._compressed is not None and self.count > RATIO_FLOOR_BYTES
                and self.count > self._max_ratio * max(self._compressed.count, 1)):
            raise ArchiveError(
                f"the archive expands more than {self._max_ratio:g} times "
                f"({self._compressed.count} compressed bytes gave {self.count} so far): "
                "refused as a decompression bomb", code="archive_too_large")
        return n


def _decompressed(raw: IO[bytes], bounds: ArchiveBounds) -> IO[bytes]:
    counted_raw = _Counted(raw)
    head = raw.read(6)
    raw.seek(-len(head), os.SEEK_CUR)
    limit = bounds.max_bytes + (bounds.max_members + 2) * _FRAMING_PER_MEMBER
    opener: Any = None
    if head.startswith(b"\x1f\x8b"):
        opener = gzip.GzipFile
    elif head.startswith(b"BZh"):
        opener = bz2.BZ2File
    elif head.startswith(b"\xfd7zXZ\x00"):
        opener = lzma.LZMAFile
    if opener is None:
        return io.BufferedReader(_Counted(raw, limit))
    inner = opener(fileobj=io.BufferedReader(counted_raw))
    return io.BufferedReader(_Counted(inner, limit, counted_raw, bounds.max_ratio))


_EXTRA_HEADERS = frozenset({tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK,
                            tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE})


class _TarInfo(tarfile.TarInfo):
    """Refuses an oversized extra header before tarfile reads it into memory."""

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _EXTRA_HEADERS and self.size > MAX_HEADER_BYTES:
            raise ArchiveError(f"an extended header of {self.size} bytes (at most "
                               f"{MAX_HEADER_BYTES})")
        return super()._proc_member(tar)  # type: ignore[misc]


@contextlib.contextmanager
def _members(source: Source, bounds: ArchiveBounds) -> Iterator[
        tuple[tarfile.TarFile, Iterator[tarfile.TarInfo]]]:
    raw = _open_source(source)
    try:
        stream = _decompressed(raw, bounds)
        try:
            tar = tarfile.open(fileobj=stream, mode="r|", tarinfo=_TarInfo)
        except (tarfile.TarError, OSError, EOFError, lzma.LZMAError) as exc:
            raise ArchiveError(f"not a tar archive: {exc}") from None
        with tar:
            yield tar, _iterate(tar)
    except ArchiveError:
        raise
    except (tarfile.TarError, OSError, EOFError, lzma.LZMAError, ValueError) as exc:
        raise ArchiveError(f"the archive is broken: {exc}") from None
    finally:
        raw.close()


def _iterate(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    while (member := tar.next()) is not None:
        yield member


def member_parts(name: str) -> list[str]:
    """A member's path as workspace components; refuses what could land outside it."""
    if not name or len(name) > MAX_NAME_CHARS or "\x00" in name:
        raise ArchiveError(f"a member name of {len(name)} characters (1 to "
                           f"{MAX_NAME_CHARS}, no NUL)")
    if name.startswith("/"):
        raise ArchiveError(f"member {name[:200]!r} has an absolute path")
    parts = [p for p in PurePosixPath(name).parts if p not in ("", ".")]
    if ".." in parts:
        raise ArchiveError(f"member {name[:200]!r} contains '..'")
    if not parts:
        return []
    return parts


def _kind(member: tarfile.TarInfo) -> str:
    if member.isreg():
        return "file"
    if member.isdir():
        return "dir"
    if member.issym():
        return "symlink"
    if member.islnk():
        return "hardlink"
    what = {tarfile.CHRTYPE: "a character device", tarfile.BLKTYPE: "a block device",
            tarfile.FIFOTYPE: "a FIFO"}.get(member.type, f"of type {member.type!r}")
    raise ArchiveError(f"member {member.name[:200]!r} is {what}: archives hold files, "
                       "directories and links only")


def check(source: Source, bounds: ArchiveBounds) -> Summary:
    """The first pass: every header read, nothing written. Raises ArchiveError."""
    sizes: dict[str, int] = {}
    kinds: dict[str, str] = {}  # what each name of the archive is, as far as it has gone
    members = logical = 0
    with _members(source, bounds) as (_tar, items):
        for member in items:
            members += 1
            if members > bounds.max_members:
                raise ArchiveError(f"the archive has more than {bounds.max_members} members",
                                   code="archive_too_large")
            parts = member_parts(member.name)
            kind = _kind(member)
            key = "/".join(parts)
            for i in range(1, len(parts)):
                above = kinds.get("/".join(parts[:i]))
                if above not in (None, "dir"):
                    raise ArchiveError(f"member {member.name[:200]!r} would be written "
                                       f"through {'/'.join(parts[:i])[:200]!r}, a {above} of "
                                       "the archive (a symlink is never followed)")
            kinds[key] = kind
            if kind == "file":
                sizes[key] = member.size
                logical += member.size
            elif kind == "hardlink":
                target = "/".join(member_parts(member.linkname))
                if target not in sizes:
                    raise ArchiveError(f"hard link {member.name[:200]!r} points at "
                                       f"{member.linkname[:200]!r}, not a file earlier in "
                                       "the archive")
                sizes[key] = sizes[target]
                logical += sizes[target]
            elif kind == "symlink" and (not member.linkname or "\x00" in member.linkname
                                        or len(member.linkname) > MAX_NAME_CHARS):
                raise ArchiveError(f"symlink {member.name[:200]!r} has no usable target")
            if logical > bounds.max_bytes:
                raise ArchiveError(
                    f"the archive's files add up to more than {bounds.max_bytes} bytes "
                    "(sparse and hard-linked files count their full size)",
                    code="archive_too_large")
    return Summary(members=members, logical_bytes=logical)


def extract(source: Source, root: Path, bounds: ArchiveBounds, owner: int | None = None,
            replace: bool = False) -> Summary:
    """Check the archive (`check`), then unpack it into `root`. With `replace` (an
    incremental snapshot applied on its parent), an entry already there is replaced: removed
    first, never written into (it may share an inode with another name)."""
    summary = check(source, bounds)
    root.mkdir(parents=True, exist_ok=True)
    root_fd = os.open(root, _DIR_FLAGS)
    try:
        with _members(source, bounds) as (tar, items):
            for member in items:
                _extract_one(tar, member, root_fd, owner, replace)
    finally:
        os.close(root_fd)
    return summary


@contextlib.contextmanager
def _parent_fd(root_fd: int, parts: list[str], owner: int | None) -> Iterator[int]:
    """The directory holding `parts[-1]`, reached from the root without following a link;
    missing directories are made."""
    fd = os.dup(root_fd)
    try:
        for i, name in enumerate(parts[:-1]):
            try:
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                os.mkdir(name, 0o755, dir_fd=fd)
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
                if owner is not None:
                    os.fchown(nxt, owner, owner)
            except OSError as exc:
                where = "/".join(parts[:i + 1])
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise ArchiveError(f"member {'/'.join(parts)[:200]!r} would be written "
                                       f"through {where[:200]!r}, which is not a directory "
                                       "(a symlink is never followed)") from None
                raise
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def _clear(dir_fd: int, name: str, for_dir: bool, replace: bool) -> bool:
    """Make room for a new entry; True if a directory is already there (and may stay)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        if for_dir:
            return True
        raise ArchiveError(f"member {name[:200]!r} would replace a directory")
    if not replace and for_dir:
        raise ArchiveError(f"member {name[:200]!r} is a directory where a file is")
    os.unlink(name, dir_fd=dir_fd)
    return False


def _extract_one(tar: tarfile.TarFile, member: tarfile.TarInfo, root_fd: int,
                 owner: int | None, replace: bool) -> None:
    parts = member_parts(member.name)
    kind = _kind(member)
    if not parts:
        return  # "." itself: the workspace
    name = parts[-1]
    mode = stat.S_IMODE(member.mode) & 0o777  # never set-id or sticky bits
    try:
        with _parent_fd(root_fd, parts, owner) as dir_fd:
            if kind == "dir":
                if not _clear(dir_fd, name, True, replace):
                    os.mkdir(name, 0o700, dir_fd=dir_fd)
                fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
                try:
                    os.fchmod(fd, mode | 0o700)
                    if owner is not None:
                        os.fchown(fd, owner, owner)
                finally:
                    os.close(fd)
                return
            _clear(dir_fd, name, False, True)
            if kind == "symlink":
                os.symlink(member.linkname, name, dir_fd=dir_fd)
                if owner is not None:
                    os.chown(name, owner, owner, dir_fd=dir_fd, follow_symlinks=False)
            elif kind == "hardlink":
                target = member_parts(member.linkname)
                with _parent_fd(root_fd, target, None) as src_fd:
                    # No AT_SYMLINK_FOLLOW: a link is made to the entry itself, which the
                    # first pass saw to be a file of this archive.
                    os.link(target[-1], name, src_dir_fd=src_fd, dst_dir_fd=dir_fd,
                            follow_symlinks=False)
            else:
                _write_file(tar, member, dir_fd, name, mode, owner)
    except ArchiveError:
        raise
    except OSError as exc:
        raise ArchiveError(f"member {member.name[:200]!r} cannot be unpacked: "
                           f"{exc.strerror}") from None


def _write_file(tar: tarfile.TarFile, member: tarfile.TarInfo, dir_fd: int, name: str,
                mode: int, owner: int | None) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=dir_fd)
    try:
        data = tar.extractfile(member)
        left = member.size
        offset = 0
        while data is not None and left > 0:
            chunk = data.read(min(_COPY_CHUNK, left))
            if not chunk:
                raise ArchiveError(f"member {member.name[:200]!r} ends early")
            if chunk != _ZEROS[:len(chunk)]:  # zeros stay a hole
                os.pwrite(fd, chunk, offset)
            offset += len(chunk)
            left -= len(chunk)
        os.ftruncate(fd, member.size)
        os.fchmod(fd, mode)
        if owner is not None:
            os.fchown(fd, owner, owner)
    finally:
        os.close(fd)
