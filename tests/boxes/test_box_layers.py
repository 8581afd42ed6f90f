"""The sandbox's layers on their own: the uid pool's record across hosts and restarts, the
cgroup v2 detection on this host, an exec's cgroup files (against a fake cgroup directory:
this machine's memory and pids controllers are bound to cgroup v1), and the seccomp filters
built by libseccomp."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from minimill.boxes import cgroups, seccomp
from minimill.boxes.uids import UidPool


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_each_box_has_its_own_uid_and_keeps_it_across_a_restart(tmp_path: Path) -> None:
    record = tmp_path / "uids.json"
    pool = UidPool(record, first=300000, count=4)
    a, b = pool.take("box_a"), pool.take("box_b")
    assert a != b and {a, b} <= set(range(300000, 300004))
    assert pool.take("box_a") == a  # asked again: the same
    # A host that died holding box_a: the next host (another process) gives it its uid
    # again, and never gives a live host's uid to anyone else.
    text = record.read_text().replace(f'"pid": {os.getpid()}', f'"pid": {_dead_pid()}', 1)
    record.write_text(text)
    restarted = UidPool(record, first=300000, count=4)
    assert restarted.take("box_a") == a
    assert restarted.take("box_c") not in (a, b)
    pool.give_back("box_b")
    assert restarted.take("box_d") == b  # given back: free again
    restarted.take("box_e")  # the fourth of four
    with pytest.raises(RuntimeError, match="in use"):
        restarted.take("box_f")


def test_cgroup_detection_says_why_not_here() -> None:
    found = cgroups.detect()
    if isinstance(found, cgroups.CgroupRoot):
        assert (found.path / "cgroup.subtree_control").exists()
    else:
        assert "cgroup" in found  # the reason the README's rlimits-only case names


def test_an_exec_group_writes_its_limits(tmp_path: Path) -> None:
    """Against a fake cgroup directory (plain files where the kernel has its own)."""
    fake = tmp_path / "fake-cgroup"
    fake.mkdir()
    (fake / "cgroup.controllers").write_text("cpu memory pids\n")
    (fake / "cgroup.subtree_control").write_text("")
    root = cgroups.prepare(fake)
    assert root.has_cpu and (fake / "cgroup.subtree_control").read_text().count("+") == 3
    group = cgroups.ExecGroup(root, memory_mb=96, max_processes=8)
    assert (group.path / "memory.max").read_text() == str(96 * 1024 * 1024)
    assert (group.path / "memory.swap.max").read_text() == "0"
    assert (group.path / "pids.max").read_text() == "8"
    (group.path / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\n")
    (group.path / "memory.events").write_text("oom 1\noom_kill 1\n")
    assert group.cpu_seconds() == 2.5 and group.oom_killed()
    with pytest.raises(ValueError, match="pids"):
        (tmp_path / "no-pids").mkdir()
        (tmp_path / "no-pids" / "cgroup.controllers").write_text("memory\n")
        cgroups.prepare(tmp_path / "no-pids")


def test_seccomp_filters_are_built_by_libseccomp() -> None:
    box, harness = seccomp.box_filter(), seccomp.no_fork_filter()
    assert box is not None and harness is not None
    # Classic BPF: 8-byte instructions, the harness's a few more (no fork, vfork, clone).
    assert len(box) % 8 == 0 and len(harness) > len(box)


@pytest.mark.skipif(os.geteuid() != 0, reason="a root host's box uid")
def test_an_exec_enters_its_cgroup_before_it_drops_to_the_box_uid(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole exec path with a cgroup, against a fake cgroup directory: the wrapper writes
    its own pid into the group's cgroup.procs as root, then runs the sandbox as the box's uid
    (a real cgroup's kernel moves it there; this machine has no delegated cgroup v2)."""
    from minimill.boxes import sandbox

    fake = tmp_path / "fake-cgroup"
    fake.mkdir()
    (fake / "cgroup.controllers").write_text("memory pids\n")
    (fake / "cgroup.subtree_control").write_text("")
    monkeypatch.setattr(cgroups, "available", lambda: cgroups.prepare(fake))
    made: list[cgroups.ExecGroup] = []
    real = cgroups.ExecGroup

    def recording(*args: object) -> cgroups.ExecGroup:
        made.append(real(*args))  # type: ignore[arg-type]
        return made[-1]

    monkeypatch.setattr(cgroups, "ExecGroup", recording)
    ws = tmp_path / "ws"
    ws.mkdir()
    for path in (ws, *ws.parents):
        path.chmod(path.stat().st_mode | 0o001)
    os.chown(ws, 300123, 300123)
    result = sandbox.run_exec(ws, ["sh", "-c", "id -u; touch mine"],
                              limits=sandbox.Limits(memory_mb=64, max_processes=8), uid=300123)
    assert (result.exit_code, result.stdout) == (0, b"1000\n"), result
    assert os.stat(ws / "mine").st_uid == 300123  # the box's host uid, not root
    assert (made[0].path / "memory.max").read_text() == str(64 * 1024 * 1024)
    assert int((made[0].path / "cgroup.procs").read_text()) > 1
