"""Stale build locks of the engine's compiled CPU kernels, cleared before a worker starts.

The engine loads its kernels through torch's extension loader, which holds a lock file in the
kernels' build directory (created exclusively, removed when done) even when it only checks
that the cached build is current. A worker killed -9 in that moment leaves the file behind,
and every later start on the machine waits on it forever: one unlucky kill stops every
restart. A lock is taken for a leftover when it is older than `min_age_s`, a built library
sits beside it (or, older than KILLED_BUILD_AGE_S, the objects of a build killed half way),
and no process is working in that directory (the loader runs the compiler there): then it
is removed. While a worker starts, a thread looks again every second, so a
start that is already waiting on a leftover goes on as soon as it is removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("minimill.worker")
KILLED_BUILD_AGE_S = 30.0


def _busy_dirs() -> set[Path]:
    """Working directories of the processes we can see (Linux /proc; empty elsewhere)."""
    found: set[Path] = set()
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                found.add(Path(os.readlink(entry / "cwd")))
            except OSError:
                continue
    return found


def clear_stale_kernel_locks(cache_dir: Path, min_age_s: float = 5.0) -> list[Path]:
    """Remove leftover build locks under `cache_dir`; returns the ones removed."""
    if not Path("/proc/self/cwd").exists():
        return []  # without /proc, a build in progress cannot be told from a leftover
    removed: list[Path] = []
    busy: set[Path] | None = None
    for lock in cache_dir.glob("*/lock"):
        try:
            age_s = time.time() - lock.stat().st_mtime
        except OSError:
            continue
        if any(lock.parent.glob("*.so")):
            needed_age_s = min_age_s
        elif any(lock.parent.glob("*.o")):
            # Objects and no library, nobody compiling: a build killed half way (a worker
            # stopped while it started). Older still, so that a build between two compiler
            # runs is not taken for one.
            needed_age_s = max(min_age_s, KILLED_BUILD_AGE_S)
        else:
            continue  # nothing built yet: a first build may be on its way
        if age_s < needed_age_s:
            continue
        busy = _busy_dirs() if busy is None else busy
        if lock.parent.resolve() in busy:
            continue
        lock.unlink(missing_ok=True)
        removed.append(lock)
        log.warning("removed a build lock left %.0fs ago by a killed process: %s", age_s, lock)
    return removed


@contextlib.contextmanager
def stale_kernel_locks_cleared(cache_dir: Path, every_s: float = 1.0) -> Iterator[None]:
    """Sweep leftover locks under `cache_dir` every `every_s` while the block runs."""
    done = threading.Event()

    def sweep() -> None:
        while True:
            try:
                clear_stale_kernel_locks(cache_dir)
            except OSError as exc:  # a directory that vanished, a file we cannot remove
                log.debug("kernel lock sweep: %s", exc)
            if done.wait(every_s):
                return

    threading.Thread(target=sweep, name="minimill-kernel-locks", daemon=True).start()
    try:
        yield
    finally:
        done.set()
