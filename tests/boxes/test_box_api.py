"""The box API end to end: SDK → control plane → a box host process → bubblewrap, and back."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from box_harness import BoxHostProc

from minimill.client.boxes import BoxError, Boxes

# Every test of this module runs against SQLite and PostgreSQL stores.
pytestmark = pytest.mark.parametrize(
    "box_env", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
    indirect=True, scope="module")


def test_create_exec_files_snapshot_restore(boxes: Boxes, box_host: BoxHostProc,
                                            tmp_path: Path) -> None:
    image = tmp_path / "image"
    (image / "src").mkdir(parents=True)
    (image / "src" / "main.py").write_text("print(sum(range(10)))\n")
    box = boxes.create(image=image)
    assert box.id.startswith("box_")

    result = box.exec("python3 src/main.py")
    assert (result.exit_code, result.stdout, result.error) == (0, "45\n", None)
    result = box.exec(["sh", "-c", "cat; echo $GREETING >&2; exit 3"], stdin="in",
                      env={"GREETING": "hello"})
    assert (result.exit_code, result.stdout, result.stderr) == (3, "in", "hello\n")

    assert box.write("notes/a.txt", "first") == 5
    assert box.read_text("notes/a.txt") == "first"
    names = {e["name"]: e["type"] for e in box.list_files(".")}
    assert names == {"src": "dir", "notes": "dir"}
    assert box.refresh().status == "running"

    snap = box.snapshot()
    box.write("notes/a.txt", "changed after the snapshot")
    twin = boxes.create(snapshot=snap)
    assert twin.read_text("notes/a.txt") == "first"
    assert twin.exec("python3 src/main.py").stdout == "45\n"
    assert box.read_text("notes/a.txt") == "changed after the snapshot"
    assert [s["id"] for s in box.snapshots() if s["kind"] == "manual"] == [snap]

    ids = {b.id for b in boxes.list()}
    assert {box.id, twin.id} <= ids
    twin.delete()
    with pytest.raises(BoxError) as err:
        twin.exec("true")
    assert err.value.status == 404


def test_archive_image_and_pause_resume(boxes: Boxes, box_host: BoxHostProc,
                                        tmp_path: Path) -> None:
    archive = tmp_path / "image.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = b"from the archive\n"
        info = tarfile.TarInfo("data.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    box = boxes.create(image=archive)
    assert box.exec("cat data.txt").stdout == "from the archive\n"
    box.write("state.txt", "kept across a pause")

    assert box.pause().status == "paused"
    with pytest.raises(BoxError) as err:
        box.exec("true")
    assert (err.value.status, err.value.code) == (409, "box_paused")
    box.resume()
    assert box.read_text("state.txt") == "kept across a pause"
    # It came back from its snapshot (on whichever host took it): a restart of the same box.
    assert box.refresh().data["restarts"] == 1
    box.delete()
