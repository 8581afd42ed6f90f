"""Memory, process and CPU limits of a box exec through cgroup v2, where the host has one.

rlimits are per process (RLIMIT_AS per address space, RLIMIT_CPU per process): a box that
forks many processes uses many times its memory and CPU limits, and the kernel's OOM killer
picks its victim anywhere on the host. A cgroup bounds the exec as a whole: memory.max (no
swap) is the box's memory limit, pids.max its process limit, and the CPU time of all its
processes (cpu.stat) is held to its CPU seconds by the host, which polls it.

A cgroup is used where this host has cgroup v2 with the memory and pids controllers and may
make child groups: MINIMILL_BOX_CGROUP names a delegated directory (a systemd unit's with
Delegate=yes); otherwise a root host whose cgroup is the hierarchy's root makes
`minimill-boxes` there. Elsewhere (cgroup v1, as on hosts that mount the hybrid layout, or no
delegation) `available()` says why, and the rlimits alone hold: the README names which.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("minimill.boxes")
NEEDED = ("memory", "pids")
BOXES_GROUP = "minimill-boxes"


@dataclass(frozen=True, slots=True)
class CgroupRoot:
    path: Path  # a directory whose children may be made, with NEEDED controllers enabled
    has_cpu: bool


def _cgroup2_mount() -> Path | None:
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            if fields[sep + 1] == "cgroup2":
                return Path(fields[4])
    return None


def _own_cgroup() -> str | None:
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                return line[3:].strip()
    return None


def _controllers(path: Path, name: str = "cgroup.controllers") -> set[str]:
    try:
        return set((path / name).read_text().split())
    except OSError:
        return set()


def _enable(path: Path, controllers: set[str]) -> None:
    missing = controllers - _controllers(path, "cgroup.subtree_control")
    if missing:
        (path / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in missing))


def prepare(path: Path) -> CgroupRoot:
    """Make `path` a place for box cgroups (raises OSError or ValueError if it cannot be)."""
    available_here = _controllers(path)
    if not set(NEEDED) <= available_here:
        raise ValueError(f"{path} lacks the {', '.join(sorted(set(NEEDED) - available_here))} "
                         "controller")
    wanted = set(NEEDED) | ({"cpu"} & available_here)
    _enable(path, wanted)
    return CgroupRoot(path=path, has_cpu="cpu" in wanted)


@functools.cache
def detect() -> CgroupRoot | str:
    """Where box cgroups go, or why there are none."""
    given = os.environ.get("MINIMILL_BOX_CGROUP")
    mount = _cgroup2_mount()
    try:
        if given:
            return prepare(Path(given))
        if mount is None:
            return "no cgroup v2 hierarchy is mounted (cgroup v1 or hybrid layout)"
        own = _own_cgroup()
        if own != "/" or os.geteuid() != 0:
            return ("no delegated cgroup v2 (set MINIMILL_BOX_CGROUP to a directory this "
                    "host may manage, such as a systemd unit's with Delegate=yes)")
        if not set(NEEDED) <= _controllers(mount):
            return ("the cgroup v2 hierarchy has no memory and pids controllers (they are "
                    "bound to cgroup v1 here)")
        _enable(mount, set(NEEDED) | ({"cpu"} & _controllers(mount)))
        group = mount / BOXES_GROUP
        group.mkdir(exist_ok=True)
        return prepare(group)
    except (OSError, ValueError) as exc:
        return f"cgroup v2 cannot be used here: {exc}"


def available() -> CgroupRoot | None:
    found = detect()
    return found if isinstance(found, CgroupRoot) else None


class ExecGroup:
    """The cgroup of one exec: made with its limits, emptied and removed by `close`."""

    def __init__(self, root: CgroupRoot, memory_mb: int, max_processes: int) -> None:
        self.path = root.path / f"exec-{secrets.token_hex(6)}"
        self.path.mkdir()
        try:
            (self.path / "memory.max").write_text(str(memory_mb * 1024 * 1024))
            with contextlib.suppress(OSError):  # no swap accounting: nothing to turn off
                (self.path / "memory.swap.max").write_text("0")
            (self.path / "pids.max").write_text(str(max_processes))
        except OSError:
            self.close()
            raise

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def cpu_seconds(self) -> float:
        try:
            for line in (self.path / "cpu.stat").read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "usage_usec":
                    return int(value) / 1e6
        except (OSError, ValueError):
            pass
        return 0.0

    def oom_killed(self) -> bool:
        try:
            for line in (self.path / "memory.events").read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value) > 0
        except (OSError, ValueError):
            pass
        return False

    def close(self) -> None:
        """Kill what is left in it and remove it."""
        kill = self.path / "cgroup.kill"
        with contextlib.suppress(OSError):
            kill.write_text("1")
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)  # its processes are still dying
        log.warning("cannot remove %s", self.path)
