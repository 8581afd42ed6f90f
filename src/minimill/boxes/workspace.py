"""A box's files on its host: file operations that cannot leave the workspace, and disk usage
against the quota (archive.py unpacks archives; snapshots.py makes and restores snapshots).

The host process is not sandboxed, and a box's own commands can plant symlinks in its
workspace (`ln -s /etc/shadow x`). So every file operation walks the path one component at a
time from the workspace's directory descriptor with O_NOFOLLOW: a symlink anywhere in the path,
or a `..`, is refused with `PathError` rather than followed.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

MAX_PATH_CHARS = 4096


class PathError(ValueError):
    """A path the file API refuses: absolute, `..`, a symlink, or not what was expected.
    `code` is the error code the API reports."""

    def __init__(self, message: str, code: str = "invalid_path") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    kind: str  # "file" | "dir" | "symlink" | "other"
    bytes: int


def parts_of(path: str) -> list[str]:
    """The components of a workspace-relative path; raises PathError for escapes.

    Leading "/workspace/" or "/" is accepted as the workspace root, as a box sees it.
    """
    if not path or len(path) > MAX_PATH_CHARS or "\x00" in path:
        raise PathError(f"path must have 1 to {MAX_PATH_CHARS} characters, none of them NUL")
    pure = PurePosixPath(path)
    parts = list(pure.parts)
    if parts and parts[0] == "/":
        parts = parts[1:]
        if parts and parts[0] == "workspace":
            parts = parts[1:]
    if ".." in parts:
        raise PathError(f"path {path!r} contains '..': paths stay inside the workspace",
                        code="path_escape")
    return [p for p in parts if p not in ("", ".")]


@contextmanager
def _open_dir(root: Path, parts: list[str], create: bool = False) -> Iterator[int]:
    """A descriptor of the directory `root/parts`, reached without following any symlink."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i, name in enumerate(parts):
            if create:
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                raise PathError(f"no such directory: {'/'.join(parts[:i + 1])}",
                                code="not_found") from None
            except (NotADirectoryError, OSError) as exc:
                where = "/".join(parts[:i + 1])
                if _is_symlink(fd, name):
                    raise PathError(f"{where} is a symlink: file operations never follow "
                                    "symlinks", code="symlink") from None
                raise PathError(f"{where} is not a directory ({exc.strerror})") from None
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def _is_symlink(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _file_flags(write: bool) -> int:
    # O_NONBLOCK: opening a FIFO a box planted (or a device) must not wait for a writer; the
    # fstat below then refuses it before anything reads from it.
    if write:
        return os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK
    return os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK


def _open_file(dir_fd: int, name: str, write: bool, path: str) -> int:
    try:
        fd = os.open(name, _file_flags(write), 0o644, dir_fd=dir_fd)
    except FileNotFoundError:
        raise PathError(f"no such file: {path}", code="not_found") from None
    except OSError as exc:
        if _is_symlink(dir_fd, name):
            raise PathError(f"{path} is a symlink: file operations never follow symlinks",
                            code="symlink") from None
        if exc.errno == errno.ENXIO:  # a FIFO without a reader, opened for writing
            raise PathError(f"{path} is not a regular file", code="not_a_file") from None
        raise PathError(f"cannot open {path}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PathError(f"{path} is not a regular file", code="not_a_file")
    # A regular file never blocks; back to blocking reads and writes for it.
    os.set_blocking(fd, True)
    return fd


def write_file(root: Path, path: str, data: bytes, owner: int | None = None) -> int:
    """Write `data` to the workspace file `path` (parents created); returns its size."""
    parts = parts_of(path)
    if not parts:
        raise PathError("path names the workspace itself, not a file")
    with _open_dir(root, parts[:-1], create=True) as dir_fd:
        fd = _open_file(dir_fd, parts[-1], True, path)
        try:
            with os.fdopen(fd, "wb", closefd=False) as f:
                f.write(data)
            if owner is not None:
                os.fchown(fd, owner, owner)
        finally:
            os.close(fd)
        if owner is not None:
            _chown_parents(root, parts[:-1], owner)
    return len(data)


def _chown_parents(root: Path, parts: list[str], owner: int) -> None:
    for i in range(1, len(parts) + 1):
        with _open_dir(root, parts[:i]) as fd:
            os.fchown(fd, owner, owner)


def read_file(root: Path, path: str, max_bytes: int) -> bytes:
    parts = parts_of(path)
    if not parts:
        raise PathError("path names the workspace itself, not a file")
    with _open_dir(root, parts[:-1]) as dir_fd:
        fd = _open_file(dir_fd, parts[-1], False, path)
        with os.fdopen(fd, "rb") as f:
            data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise PathError(f"{path} is larger than {max_bytes} bytes; read it with exec",
                        code="file_too_large")
    return data


def list_dir(root: Path, path: str) -> list[Entry]:
    with _open_dir(root, parts_of(path or ".")) as fd:
        entries = []
        for name in sorted(os.listdir(fd)):
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            kind = ("file" if stat.S_ISREG(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode)
                    else "symlink" if stat.S_ISLNK(st.st_mode) else "other")
            entries.append(Entry(name=name, kind=kind,
                                 bytes=st.st_size if kind == "file" else 0))
    return entries


def usage_bytes(root: Path) -> int:
    """Bytes the workspace holds against its quota: each file's logical size, so a sparse
    file counts whole (it may be filled in, and a snapshot carries it whole) and so does each
    name of a hard-linked one; a directory or symlink counts the blocks it takes. Symlinks
    are not followed."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in (*dirnames, *filenames):
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue  # removed meanwhile
            total += st.st_size if stat.S_ISREG(st.st_mode) else st.st_blocks * 512
    return total
