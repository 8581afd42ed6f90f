"""A host uid per box, on hosts that run as root.

One uid for every box would make each box's processes count against every other box's
process limit (RLIMIT_NPROC is per real uid), and would let one box signal or ptrace
another's processes. So a root host gives each box it holds a uid of its own, from a range
no account of the host uses (BOX_UID_FIRST, BOX_UID_COUNT; MINIMILL_BOX_UID_FIRST moves it).

The allocation is recorded in a file beside the host's workspaces, under a lock: hosts sharing
a machine never hand out the same uid, and a restarted host gives a box it holds again the
uid it had (its files and any process it left behind belong to that uid, not to a neighbour).
An entry whose host process is gone is free again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
from collections.abc import Iterator
from pathlib import Path

BOX_UID_FIRST = int(os.environ.get("MINIMILL_BOX_UID_FIRST", "200000"))
BOX_UID_COUNT = 65536


class UidsExhausted(RuntimeError):
    """Every uid of the range is held by a live box."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


class UidPool:
    """The record at `path`: {uid: {"box": box_id, "pid": holder's pid}}."""

    def __init__(self, path: Path, first: int = BOX_UID_FIRST,
                 count: int = BOX_UID_COUNT) -> None:
        self.path = path
        self.first = first
        self.count = count

    @contextlib.contextmanager
    def _record(self) -> Iterator[dict[str, dict[str, object]]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            try:
                record = json.loads(f.read() or "{}")
            except ValueError:
                record = {}  # a torn write: start over (entries of live hosts come back)
            yield record
            f.seek(0)
            f.truncate()
            f.write(json.dumps(record))
            f.flush()

    def take(self, box_id: str) -> int:
        """The uid of `box_id` on this host: the one it had, else the lowest free one."""
        with self._record() as record:
            live = {uid: entry for uid, entry in record.items()
                    if _alive(int(entry.get("pid", 0)))}  # type: ignore[call-overload]
            for uid, entry in record.items():
                if entry.get("box") == box_id:
                    if uid not in live or entry.get("pid") == os.getpid():
                        record[uid] = {"box": box_id, "pid": os.getpid()}
                        return int(uid)
            for number in range(self.first, self.first + self.count):
                if str(number) not in live and not _is_account(number):
                    record[str(number)] = {"box": box_id, "pid": os.getpid()}
                    return number
        raise UidsExhausted(f"all {self.count} box uids from {self.first} are in use")

    def give_back(self, box_id: str) -> None:
        with self._record() as record:
            for uid, entry in list(record.items()):
                if entry.get("box") == box_id and entry.get("pid") == os.getpid():
                    del record[uid]
