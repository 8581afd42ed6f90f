"""A process and its descendants, read from /proc: who they are and the CPU time they used.

The control plane runs batch jobs in a child process: what it costs is the whole tree's.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def _stat_fields(stat_path: Path) -> list[str]:
    # The command name, in parentheses, may hold spaces: the fields that follow start after
    # its closing one (field 3, the state, is the first of them).
    return stat_path.read_text().rsplit(")", 1)[1].split()


def process_tree(pid: int) -> list[int]:
    """The process and its descendants."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(stat.parent.name)] = int(_stat_fields(stat)[1])
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(child for child, parent in parents.items() if parent == current)
    return tree


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User plus system CPU seconds each live process of `pids` has used (its own threads',
    not its children's): the ones gone are left out."""
    tick = os.sysconf("SC_CLK_TCK")
    used: dict[int, float] = {}
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = _stat_fields(Path(f"/proc/{pid}/stat"))
            used[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return used
