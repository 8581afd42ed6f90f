"""A box host killed with -9 mid-exec: the box comes back on another host under the same id,
with its files as at its last snapshot (an incremental one: its whole chain is restored); the
exec that was running fails with box_host_lost."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

from api_harness import ApiEnv
from box_harness import BoxHostProc

from minimill.boxes.snapshots import RACY_NS
from minimill.client.boxes import BoxError, Boxes, ExecEvent, ExecResult


def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_kill9_host_mid_exec(box_env: ApiEnv, host_root: Path, boxes: Boxes) -> None:
    first = BoxHostProc(box_env, host_root).start_and_wait()
    second: BoxHostProc | None = None
    try:
        box = boxes.create()
        box.exec(f"head -c {1024 * 1024} /dev/urandom > big.bin")
        # Out of the window in which a scan stores a file again whatever its signature says.
        time.sleep(RACY_NS / 1e9 + 0.5)
        base = box.snapshot()
        box.write("kept.txt", "as snapshotted")
        snap = box.snapshot()
        # The latest snapshot is a delta: the box comes back from its whole chain.
        latest = next(s for s in box.snapshots() if s["id"] == snap)
        assert (latest["incremental"], latest["parent"]) == (True, base)
        digest = box.exec("sha256sum big.bin").stdout
        box.write("lost.txt", "written after the snapshot")

        outcome: list[ExecResult | BoxError] = []

        def run() -> None:
            try:
                outcome.append(box.exec("touch started; sleep 31337", timeout_s=120))
            except BoxError as exc:
                outcome.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        _wait_for(first.box_dir / box.id / "started", 30)
        first.kill9()
        # The sandbox died with its host: nothing of the box runs on this machine.
        deadline = time.monotonic() + 10
        while subprocess.run(["pgrep", "-f", "sleep 31337"], capture_output=True).stdout:
            assert time.monotonic() < deadline, "the box's processes outlived their host"
            time.sleep(0.1)

        # The lease lapses; the running exec fails clearly (it is not run a second time).
        thread.join(timeout=60)
        assert len(outcome) == 1 and isinstance(outcome[0], BoxError), outcome
        assert (outcome[0].status, outcome[0].code) == (409, "box_host_lost")

        second = BoxHostProc(box_env, host_root).start_and_wait()
        listing = box.exec("ls")
        assert listing.stdout.split() == ["big.bin", "kept.txt"]
        assert box.read_text("kept.txt") == "as snapshotted"
        assert box.exec("sha256sum big.bin").stdout == digest
        again = box.refresh()
        assert again.id == box.id and again.status == "running"
        assert again.data["restarts"] == 1 and again.data["latest_snapshot"] == snap
        assert (second.box_dir / box.id / "kept.txt").exists()
        box.delete()
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_kill9_host_mid_streamed_exec(box_env: ApiEnv, host_root: Path, boxes: Boxes) -> None:
    """A streamed exec whose host dies: what it printed came, then the stream ends with the
    error the non-streamed exec answers (box_host_lost; it is not run a second time)."""
    host = BoxHostProc(box_env, host_root).start_and_wait()
    try:
        box = boxes.create()
        received: list[ExecEvent] = []
        outcome: list[BoxError] = []

        def run() -> None:
            try:
                for event in box.exec_stream("echo started; sleep 31338", timeout_s=120):
                    received.append(event)
            except BoxError as exc:
                outcome.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + 30
        while not received:
            assert time.monotonic() < deadline and thread.is_alive(), "no output streamed"
            time.sleep(0.05)
        host.kill9()
        thread.join(timeout=60)
        assert [(e.type, e.data) for e in received] == [("stdout", "started\n")]
        assert len(outcome) == 1, outcome
        assert (outcome[0].status, outcome[0].code) == (409, "box_host_lost")
        box.delete()
    finally:
        host.stop()


def test_auto_snapshot_and_graceful_stop(box_env: ApiEnv, host_root: Path,
                                         boxes: Boxes) -> None:
    """A host that is stopped (SIGTERM) snapshots changed boxes and hands them back at once;
    one that keeps running snapshots changed boxes by itself every interval."""
    first = BoxHostProc(box_env, host_root, snapshot_interval_s=0.5).start_and_wait()
    second: BoxHostProc | None = None
    try:
        box = boxes.create()
        box.write("auto.txt", "snapshotted by the host")
        deadline = time.monotonic() + 20
        while box.refresh().data["latest_snapshot"] is None:
            assert time.monotonic() < deadline, "no automatic snapshot"
            time.sleep(0.1)
        box.write("late.txt", "saved when the host stops")
        assert first.stop() == 0
        assert box.refresh().status == "pending"  # handed back, not waiting for an expiry
        second = BoxHostProc(box_env, host_root).start_and_wait()
        assert sorted(box.exec("ls").stdout.split()) == ["auto.txt", "late.txt"]
        box.delete()
    finally:
        first.stop()
        if second is not None:
            second.stop()

