"""Hostile image and snapshot archives, unpacked by the box host (boxes/archive.py) on a real
file system: each is refused whole with a clear error, before anything of it is written, and
nothing lands outside the workspace, whatever the path length, link or member type."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from minimill.boxes import snapshots
from minimill.boxes.archive import ArchiveBounds, ArchiveError, check, extract

BOUNDS = ArchiveBounds(max_bytes=64 * 1024 * 1024, max_members=1000)


def tar_of(*members: tuple[tarfile.TarInfo, bytes | None], gz: bool = True,
           fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w", format=fmt) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o755 if kind == tarfile.DIRTYPE else 0o644
    return info


def everything_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
def ground(tmp_path: Path) -> tuple[Path, Path]:
    """A workspace to unpack into, and a host directory beside it that must stay empty."""
    ws, outside = tmp_path / "a" / "b" / "ws", tmp_path / "outside"
    ws.mkdir(parents=True)
    outside.mkdir()
    return ws, outside


def refused(archive: bytes, ws: Path, outside: Path, says: str) -> ArchiveError:
    with pytest.raises(ArchiveError) as err:
        extract(archive, ws, BOUNDS)
    assert says in str(err.value), err.value
    assert list(ws.iterdir()) == [], "the first pass must refuse before writing anything"
    assert list(outside.iterdir()) == []
    return err.value


def test_long_paths_through_one_letter_symlinks_then_a_climbing_link(
        ground: tuple[Path, Path]) -> None:
    """The reproduced escape: short member names run through one-letter symlinks into
    247-character directories, past PATH_MAX, then a link that climbs out, then a file
    written through it. Every member is resolved from the workspace's descriptor without
    following a link, so the chain never resolves."""
    ws, outside = ground
    members: list[tuple[tarfile.TarInfo, bytes | None]] = []
    prefix = ""
    for i in range(20):  # 20 x 248 characters: far past PATH_MAX (4096)
        long_dir = chr(ord("a") + i) * 247
        members.append((entry(f"{prefix}{long_dir}", tarfile.DIRTYPE), None))
        members.append((entry(f"{prefix}{chr(ord('A') + i)}", tarfile.SYMTYPE, long_dir), None))
        prefix += f"{chr(ord('A') + i)}/"
    climb = "../" * 40 + str(outside).lstrip("/")
    members.append((entry(f"{prefix}up", tarfile.SYMTYPE, climb), None))
    members.append((entry(f"{prefix}up/planted", tarfile.REGTYPE), b"written on the host"))
    error = refused(tar_of(*members), ws, outside, "a symlink is never followed")
    assert error.code == "invalid_archive"


def test_a_delta_through_a_symlink_already_in_the_workspace(ground: tuple[Path, Path]) -> None:
    """An incremental snapshot applies on a workspace that has links of its own: the second
    pass resolves each member from the workspace's descriptor and refuses to pass one."""
    ws, outside = ground
    (ws / "esc").symlink_to(outside)
    with pytest.raises(ArchiveError) as err:
        extract(tar_of((entry("esc/planted"), b"x")), ws, BOUNDS, replace=True)
    assert "a symlink is never followed" in str(err.value)
    assert list(outside.iterdir()) == []


def test_a_symlink_then_a_file_through_it(ground: tuple[Path, Path]) -> None:
    ws, outside = ground
    archive = tar_of((entry("esc", tarfile.SYMTYPE, str(outside)), None),
                     (entry("esc/planted"), b"x"))
    refused(archive, ws, outside, "a symlink is never followed")
    # Relative, and through a directory symlink deeper down: the same.
    archive = tar_of((entry("d", tarfile.DIRTYPE), None),
                     (entry("d/up", tarfile.SYMTYPE, "../../../outside"), None),
                     (entry("d/up/planted"), b"x"))
    refused(archive, ws, outside, "a symlink is never followed")


def test_a_hard_link_to_a_host_file(ground: tuple[Path, Path]) -> None:
    ws, outside = ground
    secret = outside / "secret"
    secret.write_text("the host's")
    for target in (str(secret), "../../../outside/secret", "nowhere-in-the-archive"):
        archive = tar_of((entry("h", tarfile.LNKTYPE, target), None))
        with pytest.raises(ArchiveError) as err:
            extract(archive, ws, BOUNDS)
        assert "hard link" in str(err.value) or "absolute" in str(err.value) \
            or "'..'" in str(err.value), err.value
        assert list(ws.iterdir()) == []
    assert secret.read_text() == "the host's" and os.stat(secret).st_nlink == 1
    # A hard link to an earlier file of the same archive is fine (snapshots have them).
    summary = extract(tar_of((entry("f"), b"12345"), (entry("g", tarfile.LNKTYPE, "f"), None)),
                      ws, BOUNDS)
    assert os.stat(ws / "g").st_ino == os.stat(ws / "f").st_ino
    assert summary.logical_bytes == 10  # each name counts its whole size


@pytest.mark.parametrize(("kind", "says"), [(tarfile.CHRTYPE, "character device"),
                                            (tarfile.BLKTYPE, "block device"),
                                            (tarfile.FIFOTYPE, "FIFO")])
def test_device_nodes_and_fifos(ground: tuple[Path, Path], kind: bytes, says: str) -> None:
    ws, outside = ground
    node = entry("dev", kind)
    node.devmajor, node.devminor = 1, 3  # /dev/null's numbers
    refused(tar_of((entry("fine.txt"), b"ok"), (node, None)), ws, outside, says)


@pytest.mark.parametrize("name", ["/etc/planted", "../planted", "a/../../planted"])
def test_absolute_and_climbing_names(ground: tuple[Path, Path], name: str) -> None:
    ws, outside = ground
    refused(tar_of((entry(name), b"x")), ws, outside, "member")


def test_a_gzip_bomb_is_refused_while_decompressing(ground: tuple[Path, Path]) -> None:
    """A few hundred KiB that unpack to 256 MiB: refused after reading at most the bound."""
    ws, outside = ground
    big = entry("zeros.bin")
    big.size = 256 * 1024 * 1024
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9) as gz:
        gz.write(big.tobuf(tarfile.PAX_FORMAT))
        chunk = bytes(1024 * 1024)
        for _ in range(256):
            gz.write(chunk)
        gz.write(bytes(1024))
    archive = raw.getvalue()
    assert len(archive) < 512 * 1024
    error = refused(archive, ws, outside, "bytes")
    assert error.code == "archive_too_large"
    # The ratio bound alone, under a size bound that would let the bomb through.
    generous = ArchiveBounds(max_bytes=2 * 1024 * 1024 * 1024, max_ratio=100.0)
    with pytest.raises(ArchiveError) as err:
        check(archive, generous)
    assert "expands more than 100 times" in str(err.value)


def test_a_sparse_100_gib_file_in_a_tiny_archive(ground: tuple[Path, Path],
                                                 tmp_path: Path) -> None:
    """GNU tar's sparse member: a few hundred bytes that claim 100 GiB. Counted by its
    logical size, it is refused before anything is written."""
    ws, outside = ground
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "sparse.bin", "wb") as f:
        f.truncate(100 * 1024**3)
    archive = tmp_path / "sparse.tar.gz"
    subprocess.run(["tar", "--sparse", "-czf", str(archive), "-C", str(src), "sparse.bin"],
                   check=True)
    assert archive.stat().st_size < 64 * 1024
    with pytest.raises(ArchiveError) as err:
        extract(archive, ws, BOUNDS)
    assert err.value.code == "archive_too_large" and "sparse" in str(err.value)
    assert list(ws.iterdir()) == [] and list(outside.iterdir()) == []
    # Within the bound, a sparse file is unpacked sparse (its holes stay holes).
    with open(src / "sparse.bin", "wb") as f:
        f.truncate(32 * 1024 * 1024)
        f.write(b"head")
    subprocess.run(["tar", "--sparse", "-czf", str(archive), "-C", str(src), "sparse.bin"],
                   check=True)
    extract(archive, ws, BOUNDS)
    unpacked = os.stat(ws / "sparse.bin")
    assert unpacked.st_size == 32 * 1024 * 1024
    assert unpacked.st_blocks * 512 < 1024 * 1024


def test_too_many_members(ground: tuple[Path, Path]) -> None:
    ws, outside = ground
    many = [(entry(f"f{i}"), b"") for i in range(BOUNDS.max_members + 1)]
    error = refused(tar_of(*many), ws, outside, "more than 1000 members")
    assert error.code == "archive_too_large"


def test_an_oversized_extended_header(ground: tuple[Path, Path]) -> None:
    """A pax header tarfile would read whole into memory: refused by its size first."""
    ws, outside = ground
    info = entry("x")
    info.pax_headers = {"comment": "c" * (2 * 1024 * 1024)}
    refused(tar_of((info, b"x")), ws, outside, "extended header")


def test_not_an_archive(ground: tuple[Path, Path]) -> None:
    ws, outside = ground
    refused(b"\x1f\x8b" + os.urandom(200), ws, outside, "")
    refused(os.urandom(2000), ws, outside, "")


@pytest.mark.parametrize("make", [
    lambda outside: tar_of((entry("esc", tarfile.SYMTYPE, str(outside)), None),
                           (entry("esc/planted"), b"x")),
    lambda outside: tar_of((entry("n", tarfile.FIFOTYPE), None)),
])
def test_a_planted_snapshot_chain_is_refused(tmp_path: Path,
                                             make: Callable[[Path], bytes]) -> None:
    """A compromised site's snapshot, restored by the next honest host: the same checks."""
    outside = tmp_path / "outside"
    outside.mkdir()
    ws = tmp_path / "ws"
    with pytest.raises(snapshots.SnapshotError) as err:
        snapshots.restore([("snap_planted", make(outside))], ws)
    assert err.value.code == "invalid_archive"
    assert list(outside.iterdir()) == []
    shutil.rmtree(ws, ignore_errors=True)
