"""Leftover build locks of the compiled kernels are cleared; live ones are left alone."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from minimill.fleet.kernel_lock import clear_stale_kernel_locks, stale_kernel_locks_cleared


def build_dir(root: Path, name: str, *, built: bool = True, lock_age_s: float = 60.0) -> Path:
    directory = root / name
    directory.mkdir()
    if built:
        (directory / f"{name}.so").write_bytes(b"\x7fELF")
    lock = directory / "lock"
    lock.touch()
    then = time.time() - lock_age_s
    os.utime(lock, (then, then))
    return lock


def test_only_old_locks_beside_a_built_library_with_nobody_working_there_go(
        tmp_path: Path) -> None:
    stale = build_dir(tmp_path, "cpu-stale")
    fresh = build_dir(tmp_path, "cpu-fresh", lock_age_s=1.0)  # someone is checking it now
    first_build = build_dir(tmp_path, "cpu-first", built=False)  # the first build runs
    busy = build_dir(tmp_path, "cpu-busy")
    # A compiler at work in that directory (the loader runs it there): a rebuild in progress.
    compiler = subprocess.Popen(["sleep", "30"], cwd=busy.parent)
    try:
        assert clear_stale_kernel_locks(tmp_path) == [stale]
    finally:
        compiler.kill()
        compiler.wait()
    assert not stale.exists()
    assert fresh.exists() and first_build.exists() and busy.exists()
    assert clear_stale_kernel_locks(tmp_path / "nowhere") == []


def test_a_start_waiting_on_a_leftover_goes_on(tmp_path: Path) -> None:
    lock = build_dir(tmp_path, "cpu-left", lock_age_s=3.0)  # not old enough yet
    with stale_kernel_locks_cleared(tmp_path, every_s=0.1):
        deadline = time.time() + 10
        while lock.exists() and time.time() < deadline:  # what torch's loader does
            time.sleep(0.1)
    assert not lock.exists()


def test_a_build_killed_half_way_is_cleared_once_old(tmp_path: Path) -> None:
    """A worker stopped while it built the kernels leaves objects, no library, and the lock:
    once it is older than a build's pause between compiler runs, it goes."""
    killed = build_dir(tmp_path, "cpu-killed", built=False, lock_age_s=60.0)
    (killed.parent / "attention.o").write_bytes(b"\x7fELF")
    recent = build_dir(tmp_path, "cpu-recent", built=False, lock_age_s=10.0)
    (recent.parent / "attention.o").write_bytes(b"\x7fELF")
    assert clear_stale_kernel_locks(tmp_path) == [killed]
    assert recent.exists()
