"""Incremental snapshots end to end (SDK → control plane → a box host process → bubblewrap):
a second snapshot after a small change is a delta, far smaller than the first, and a new box
restored from it has every file as it was then; a host whose parent snapshot is gone sends a
full one instead."""

from __future__ import annotations

import time
from typing import Any

import pytest
from api_harness import ApiEnv
from box_harness import BoxHostProc

from minimill.boxes.snapshots import RACY_NS
from minimill.client.boxes import Box, Boxes
from minimill.control.boxes import drop_archives

# Every test of this module runs against SQLite and PostgreSQL stores.
pytestmark = pytest.mark.parametrize(
    "box_env", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
    indirect=True, scope="module")

BIG_BYTES = 8 * 1024 * 1024


def snapshot_object(box: Box, snapshot_id: str) -> dict[str, Any]:
    return next(s for s in box.snapshots() if s["id"] == snapshot_id)


def files_of(box: Box) -> str:
    """Every path with its type, its content's digest or its link target."""
    return box.exec("find . -mindepth 1 | sort | while read -r p; do "
                    "if [ -L \"$p\" ]; then echo \"$p -> $(readlink \"$p\")\"; "
                    "elif [ -d \"$p\" ]; then echo \"$p/\"; "
                    "else echo \"$p $(sha256sum < \"$p\")\"; fi; done").stdout


def test_a_small_change_is_a_small_delta_that_restores_whole(
        box_env: ApiEnv, boxes: Boxes, box_host: BoxHostProc) -> None:
    box = boxes.create()
    made = box.exec(f"head -c {BIG_BYTES} /dev/urandom > big.bin && mkdir -p src/lib docs && "
                    "echo 'v1' > src/small.txt && echo 'doc' > docs/old.md && "
                    "echo 'lib' > src/lib/util.py && ln -s src/small.txt current")
    assert made.exit_code == 0, made.stderr
    # Files written just before a scan are stored again by the next delta (the scan cannot
    # tell a change within its clock's granularity): let them age out of that window.
    time.sleep(RACY_NS / 1e9 + 0.5)
    first_id = box.snapshot()

    box.write("src/small.txt", "v2: changed after the first snapshot")
    second_id = box.snapshot()
    first, second = snapshot_object(box, first_id), snapshot_object(box, second_id)
    print(f"\nfull snapshot: {first['bytes']} bytes; incremental snapshot: "
          f"{second['bytes']} bytes")
    assert (first["incremental"], first["parent"]) == (False, None)
    assert (second["incremental"], second["parent"]) == (True, first_id)
    assert first["bytes"] > BIG_BYTES
    assert second["bytes"] * 100 < first["bytes"]

    expected = files_of(box)
    assert "big.bin" in expected and "./current -> src/small.txt" in expected
    # A change after it is not in it.
    box.write("src/small.txt", "v3: after the second snapshot")

    twin = boxes.create(snapshot=second_id)
    assert twin.read_text("src/small.txt") == "v2: changed after the first snapshot"
    assert files_of(twin) == expected
    assert twin.exec("readlink current; cat current").stdout == \
        "src/small.txt\nv2: changed after the first snapshot"

    # The twin's own first snapshot is full: its host has no scan of the chain it came from.
    twin.write("docs/new.md", "twin")
    twin_first = snapshot_object(twin, twin.snapshot())
    assert twin_first["incremental"] is False
    twin.delete()

    # Its parent gone behind the host's back: the host's next snapshot is a full one.
    with box_env.store.write() as conn:
        drop_archives(conn, [second_id])
    box.write("after.txt", "written after the parent went")
    third = snapshot_object(box, box.snapshot())
    assert (third["incremental"], third["parent"]) == (False, None)
    assert third["bytes"] > BIG_BYTES
    box.delete()
