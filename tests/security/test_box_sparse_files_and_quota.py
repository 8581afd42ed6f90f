"""Sparse files against the disk quota: counted by their logical size, so a box cannot hold
a 100 GiB file in a 4 MiB quota, nor snapshot one, and packing a sparse file never reads its
bytes into memory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from box_harness import BoxHostProc
from security_harness import assert_healthy

from minimill.client.boxes import Boxes


def test_a_sparse_file_counts_whole(boxes: Boxes, box_host: BoxHostProc) -> None:
    box = boxes.create(limits={"disk_mb": 4})
    huge = box.exec("truncate -s 100G huge.bin")
    assert huge.exit_code != 0 and "File size limit" in huge.stderr, huge
    # 3 MiB of holes leaves 1 MiB of the quota: a second such file does not fit.
    first = box.exec("truncate -s 3M a.bin && echo ok")
    assert first.stdout == "ok\n", first
    second = box.exec("truncate -s 3M b.bin")
    assert second.exit_code != 0 and "File size limit" in second.stderr, second
    # The refused ones were made, and stayed empty.
    sizes = {e["name"]: e["bytes"] for e in box.list_files(".")}
    assert sizes == {"a.bin": 3 * 1024 * 1024, "b.bin": 0, "huge.bin": 0}
    assert box.snapshot().startswith("snap_")  # within its quota: snapshotted as ever
    assert_healthy(box)
    box.delete()


PACK = """
import resource, sys
from pathlib import Path
from minimill.boxes import snapshots
ws, out = Path(sys.argv[1]), Path(sys.argv[2])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with open(out, "wb") as f:
    snapshots.write_full(ws, f)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_packing_streams_a_sparse_file(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    with open(ws / "sparse.bin", "wb") as f:
        f.truncate(256 * 1024 * 1024)
        f.write(b"start")
    out = tmp_path / "snap.tar.gz"
    grew_mib = int(subprocess.run([sys.executable, "-c", PACK, str(ws), str(out)],
                                  capture_output=True, text=True, check=True).stdout)
    assert grew_mib < 64, f"packing 256 MiB of holes took {grew_mib} MiB of memory"
    assert out.stat().st_size < 4 * 1024 * 1024
