"""Snapshot archives on a real file system (boxes/snapshots.py, and the host's choice between
a delta and a full archive): a chain of deltas with files added, changed and deleted,
symlinks, hard links, directories and type changes restores to the workspace exactly; a
chain that does not add up is refused; chains stay bounded."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from minimill.boxes import snapshots
from minimill.boxes.host import Taken, take
from minimill.boxes.snapshots import SnapshotError
from minimill.boxes.workspace import PathError

# Older than any scan's racy window: such a file's signature alone says it is unchanged.
LONG_AGO_NS = 1_600_000_000 * 10**9


def tree(root: Path) -> dict[str, tuple[str, int, bytes | str]]:
    """What a workspace holds: each path's kind, mode and content (a symlink's target)."""
    found: dict[str, tuple[str, int, bytes | str]] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in (*dirnames, *filenames):
            full = Path(dirpath) / name
            rel = str(full.relative_to(root))
            st = os.lstat(full)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                found[rel] = ("symlink", 0, os.readlink(full))
            elif stat.S_ISDIR(st.st_mode):
                found[rel] = ("dir", mode, b"")
            else:
                found[rel] = ("file", mode, full.read_bytes())
    return found


def restored(chain: list[tuple[str, bytes]], where: Path) -> dict[str, tuple[str, int,
                                                                              bytes | str]]:
    where.mkdir()
    snapshots.restore(chain, where)
    return tree(where)


def step(ws: Path, chain: list[tuple[str, bytes]], base: snapshots.Manifest,
         snapshot_id: str) -> snapshots.Manifest:
    """Append a delta of the workspace as it is now to `chain`; the new scan."""
    now = snapshots.scan(ws)
    delta = snapshots.diff(base, now)
    chain.append((snapshot_id, snapshots.pack_delta(ws, chain[-1][0], delta, now)))
    return now


def test_a_chain_of_deltas_restores_the_workspace(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "src").mkdir(parents=True)
    (ws / "src" / "main.py").write_text("print(1)\n")
    (ws / "a.txt").write_text("first")
    (ws / "deep" / "x" / "y").mkdir(parents=True)
    (ws / "deep" / "x" / "y" / "z.txt").write_text("deep down")
    (ws / "empty").mkdir()
    (ws / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (ws / "run.sh").chmod(0o755)
    (ws / "link").symlink_to("a.txt")
    (ws / "dangling").symlink_to("nowhere/at/all")
    big = ws / "big.bin"
    big.write_bytes(os.urandom(512 * 1024))
    os.utime(big, ns=(LONG_AGO_NS, LONG_AGO_NS))
    base = snapshots.scan(ws)
    full = snapshots.pack_full(ws)
    chain = [("snap_0", full)]
    assert snapshots.read_delta(full) is None
    assert restored(chain, tmp_path / "r0") == tree(ws)

    # Changed, added, deleted (a whole tree), a symlink re-pointed, a mode changed.
    (ws / "a.txt").write_text("second, longer")
    (ws / "b.txt").write_text("new")
    for path in (ws / "deep" / "x" / "y" / "z.txt", ws / "deep" / "x" / "y",
                 ws / "deep" / "x", ws / "deep"):
        path.unlink() if path.is_file() else path.rmdir()
    (ws / "link").unlink()
    (ws / "link").symlink_to("src/main.py")
    (ws / "src" / "main.py").chmod(0o600)
    (ws / "new" / "sub").mkdir(parents=True)
    (ws / "new" / "sub" / "f").write_bytes(b"\x00\x01binary")
    base = step(ws, chain, base, "snap_1")
    header, _ = snapshots.read_delta(chain[-1][1]) or pytest.fail("not a delta")
    assert header.parent == "snap_0" and header.deleted == ["deep"]
    # The big file, unchanged, is not in it.
    assert len(chain[-1][1]) < 8 * 1024 < len(full)
    assert restored(chain, tmp_path / "r1") == tree(ws)

    # Type changes both ways, a symlink becoming a file, a hard link, a deletion.
    (ws / "a.txt").unlink()
    (ws / "a.txt").mkdir()
    (ws / "a.txt" / "inner").write_text("a directory now")
    (ws / "src" / "main.py").unlink()
    (ws / "src").rmdir()
    (ws / "src").write_text("a file now")
    (ws / "link").unlink()
    (ws / "link").write_text("no longer a link")
    (ws / "b.txt").unlink()
    os.link(ws / "run.sh", ws / "run-too.sh")
    base = step(ws, chain, base, "snap_2")
    assert restored(chain, tmp_path / "r2") == tree(ws)

    # A small change: a small delta.
    (ws / "new" / "sub" / "f").write_bytes(b"changed")
    base = step(ws, chain, base, "snap_3")
    assert len(chain[-1][1]) < 4 * 1024
    assert restored(chain, tmp_path / "r3") == tree(ws)

    # The big file changes too, and nearly everything goes.
    big.write_bytes(os.urandom(1024))
    for name in ("a.txt/inner", "src", "link", "run.sh", "run-too.sh", "dangling"):
        (ws / name).unlink()
    (ws / "a.txt").rmdir()
    step(ws, chain, base, "snap_4")
    assert sorted(tree(ws)) == ["big.bin", "empty", "new", "new/sub", "new/sub/f"]
    assert restored(chain, tmp_path / "r4") == tree(ws)


def _small_chain(tmp_path: Path) -> list[tuple[str, bytes]]:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "keep.txt").write_text("kept")
    chain = [("snap_0", snapshots.pack_full(ws))]
    base = snapshots.scan(ws)
    (ws / "one.txt").write_text("one")
    base = step(ws, chain, base, "snap_1")
    (ws / "two.txt").write_text("two")
    step(ws, chain, base, "snap_2")
    return chain


@pytest.mark.parametrize("broken", ["missing_link", "delta_first", "full_in_the_middle",
                                    "out_of_order", "other_base", "bad_header"])
def test_a_broken_chain_is_refused(tmp_path: Path, broken: str) -> None:
    chain = _small_chain(tmp_path)
    full, one, two = chain
    if broken == "missing_link":
        bad = [full, two]
    elif broken == "delta_first":
        bad = [one, two]
    elif broken == "full_in_the_middle":
        bad = [full, full, two]
    elif broken == "out_of_order":
        bad = [full, two, one]
    elif broken == "other_base":
        # The right ids, but the full archive of another workspace: it does not add up.
        other = tmp_path / "other"
        other.mkdir()
        (other / "else.txt").write_text("something else entirely")
        bad = [("snap_0", snapshots.pack_full(other)), one, two]
    else:
        blob = two[1]
        cut = len(snapshots.DELTA_MAGIC) + 4
        bad = [full, one, ("snap_2", blob[:cut] + b"{not json" + blob[cut + 9:])]
    with pytest.raises(SnapshotError) as err:
        snapshots.restore(bad, tmp_path / "restored")
    assert err.value.code == "invalid_archive"
    assert snapshots.restore(chain, tmp_path / "fine") is None  # the chain itself is fine
    assert sorted(tree(tmp_path / "fine")) == ["keep.txt", "one.txt", "two.txt"]


def test_the_host_takes_deltas_where_they_pay_and_bounds_chains(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    big = ws / "big.bin"
    big.write_bytes(os.urandom(256 * 1024))
    os.utime(big, ns=(LONG_AGO_NS, LONG_AGO_NS))
    depths: list[int] = []
    base: Taken | None = None
    chain: list[tuple[str, bytes]] = []
    for i in range(snapshots.FULL_EVERY + 2):
        (ws / f"note-{i}.txt").write_text(f"note {i}")
        taken = take(ws, base, tmp_path / f"out{i}")
        snapshot_id = f"snap_{i}"
        depths.append(taken.depth)
        if taken.depth == 0:
            chain = []
        chain.append((snapshot_id, taken.path.read_bytes()))
        base = Taken(manifest=taken.manifest, depth=taken.depth, snapshot_id=snapshot_id)
        assert restored(chain, tmp_path / f"r{i}") == tree(ws)
    # Every FULL_EVERY-th snapshot is full: no chain is longer than FULL_EVERY archives.
    assert depths == [*range(snapshots.FULL_EVERY), 0, 1]

    # Most of the files changed: a full snapshot, not a delta carrying them all.
    assert base is not None
    big.write_bytes(os.urandom(256 * 1024))
    assert take(ws, base, tmp_path / "full").depth == 0
    # Without a scan of an earlier snapshot (a host that just restored the box): full.
    assert take(ws, None, tmp_path / "none").depth == 0


def test_symlinks_that_point_out_of_the_workspace_are_kept_and_never_written_through(
        tmp_path: Path) -> None:
    """A venv's `python -> /usr/bin/python3` (resolved inside the box's sandbox) survives a
    snapshot and its restore, full and incremental; an archive that would write through a
    link to outside the workspace is refused, and nothing lands outside."""
    ws = tmp_path / "ws"
    (ws / "venv" / "bin").mkdir(parents=True)
    (ws / "venv" / "bin" / "python").symlink_to("/usr/bin/python3")
    (ws / "up").symlink_to("../../outside")
    chain = [("snap_0", snapshots.pack_full(ws))]
    base = snapshots.scan(ws)
    (ws / "venv" / "bin" / "python3").symlink_to("/usr/bin/python3")
    step(ws, chain, base, "snap_1")
    assert restored(chain, tmp_path / "back") == tree(ws)
    assert os.readlink(tmp_path / "back" / "venv" / "bin" / "python") == "/usr/bin/python3"

    outside = tmp_path / "outside"
    outside.mkdir()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        link = tarfile.TarInfo("esc")
        link.type, link.linkname = tarfile.SYMTYPE, str(outside)
        tar.addfile(link)
        payload = b"written through the link"
        member = tarfile.TarInfo("esc/planted")
        member.size = len(payload)
        tar.addfile(member, io.BytesIO(payload))
    with pytest.raises(PathError) as refused:
        snapshots.restore([("snap_evil", buffer.getvalue())], tmp_path / "evil")
    assert refused.value.code == "invalid_archive"
    assert list(outside.iterdir()) == []
