"""Idle policies end to end: SDK and CLI → control plane (its janitor) → a real box host
process running bubblewrap. A box left idle past its timeout is snapshotted and leaves its
host; its next exec brings it back with its files; activity (and a running exec) keeps a box
where it is; boxes without a timeout never idle out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from api_harness import ApiEnv, start_env, stop_env
from box_harness import BoxHostProc

from minimill.client.boxes import Box, BoxError, Boxes

IDLE_S = 2.0


def _box(env: ApiEnv, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "minimill.cli", "box", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MINIMILL_BASE_URL": env.v1,
                               "MINIMILL_API_KEY": env.key})


def wait_status(box: Box, status: str, timeout_s: float = 30.0) -> float:
    """Seconds until the box shows `status`."""
    started = time.monotonic()
    while box.refresh().status != status:
        assert time.monotonic() - started < timeout_s, box.data
        time.sleep(0.1)
    return time.monotonic() - started


def test_an_idle_box_leaves_its_host_and_its_next_exec_brings_it_back(
        boxes: Boxes, box_host: BoxHostProc) -> None:
    idle = boxes.create(idle_timeout_s=IDLE_S)
    never = boxes.create(idle_timeout_s=None)
    default = boxes.create()  # this server's default: no idle timeout
    assert (idle.data["idle_timeout_s"], idle.data["idle_action"]) == (IDLE_S, "pause")
    assert never.data["idle_timeout_s"] is None and default.data["idle_timeout_s"] is None

    idle.write("notes/kept.txt", "written before the pause\n")
    assert idle.exec("echo more >> notes/kept.txt").exit_code == 0
    last_op = time.monotonic()
    for other in (never, default):
        assert other.exec("echo here > here.txt").exit_code == 0
    workspace = box_host.box_dir / idle.id
    assert workspace.is_dir()

    waited = wait_status(idle, "paused")
    assert time.monotonic() - last_op >= IDLE_S  # not before a whole timeout went by
    assert waited < IDLE_S + 10
    assert idle.pause_reason == "idle"
    assert idle.data["latest_snapshot"] is not None
    # Its host let it go: it dropped the workspace.
    box_host.wait_for_log(rf"box {idle.id} revoked .*: dropping its workspace", timeout=15)
    deadline = time.monotonic() + 15
    while workspace.exists():
        assert time.monotonic() < deadline, "the host kept the idle box's workspace"
        time.sleep(0.1)

    # The boxes without a timeout outlived it, and stay: a box with the timeout, idle since
    # after their last exec, is paused by a later pass of the janitor, which left them running.
    witness = boxes.create(idle_timeout_s=IDLE_S)
    wait_status(witness, "paused")
    for other in (never, default):
        assert other.refresh().status == "running"
        assert other.pause_reason is None

    # The next exec resumes it where it was: same id, same files.
    result = idle.exec("cat notes/kept.txt; ls")
    assert result.stdout == "written before the pause\nmore\nnotes\n"
    back = idle.refresh()
    assert (back.id, back.status, back.data["restarts"]) == (idle.id, "running", 1)
    assert back.pause_reason is None
    assert workspace.is_dir()  # restored on a host (the only one here)


def test_activity_and_a_running_exec_keep_a_box_on_its_host(boxes: Boxes,
                                                             box_host: BoxHostProc) -> None:
    box = boxes.create(idle_timeout_s=IDLE_S)
    started = time.monotonic()
    while time.monotonic() - started < 2 * IDLE_S:  # used more often than its timeout
        assert box.exec("echo tick >> ticks.txt").exit_code == 0
        time.sleep(IDLE_S / 4)
        assert box.refresh().status == "running"
    # An exec that runs longer than the timeout is activity all along.
    result = box.exec(f"sleep {2 * IDLE_S}; wc -l < ticks.txt")
    assert result.exit_code == 0 and int(result.stdout) >= 4
    assert box.refresh().status == "running" and box.data["restarts"] == 0


def test_idle_settings_are_checked(box_env: ApiEnv) -> None:
    for bad in ({"idle_timeout_s": -1}, {"idle_timeout_s": 0}, {"idle_timeout_s": "soon"},
                {"idle_action": "delete"}, {"idle_timeout_s": 10**12}):
        resp = httpx.post(box_env.v1 + "/boxes", json=bad, timeout=30,
                          headers={"Authorization": f"Bearer {box_env.key}"})
        assert resp.status_code == 400, (bad, resp.text)
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], error
        assert error["param"] is not None and "idle" in error["param"], error


def test_server_default_and_a_hostless_box(tmp_path: Path) -> None:
    """MINIMILL_BOX_IDLE_TIMEOUT_S applies to boxes created without a timeout; a box no host
    took is paused in place; a tenant's pause of it is kept until resumed."""
    env = start_env("sqlite", f"sqlite:///{tmp_path / 'idle.db'}", box_idle_timeout_s=1.5)
    try:
        with Boxes(env.v1, env.key, timeout_s=30) as client:
            inherited = client.create()
            never = client.create(idle_timeout_s=None)
            own = client.create(idle_timeout_s=600)
            assert inherited.data["idle_timeout_s"] == 1.5
            assert never.data["idle_timeout_s"] is None
            assert own.data["idle_timeout_s"] == 600
            # No host here: the box waits pending, then its idle policy pauses it in place.
            wait_status(inherited, "paused", timeout_s=15)
            assert inherited.pause_reason == "idle"
            assert never.refresh().status == own.refresh().status == "pending"
            # Its tenant pauses it too: now an operation waits for an explicit resume.
            assert client.request("POST", f"/{inherited.id}/pause").json()[
                "pause_reason"] == "request"
            with pytest.raises(BoxError) as err:
                inherited.exec("true")
            assert (err.value.status, err.value.code) == (409, "box_paused")
            assert inherited.resume().status == "pending"
    finally:
        stop_env(env)


def test_box_create_idle_timeout_cli(box_env: ApiEnv, box_host: BoxHostProc) -> None:
    helped = " ".join(_box(box_env, "create", "--help").stdout.split())  # help wraps
    assert "--idle-timeout" in helped and "resumes it" in helped
    created = _box(box_env, "create", "--idle-timeout", "45")
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout)["idle_timeout_s"] == 45
    never = _box(box_env, "create", "--idle-timeout", "never")
    assert json.loads(never.stdout)["idle_timeout_s"] is None
    bad = _box(box_env, "create", "--idle-timeout", "soon")
    assert bad.returncode == 2 and "--idle-timeout" in bad.stderr
