"""Agents and the box host slots they use, as a user meets them: a finished agent gives its
box back (so the fifth box after four agent runs gets a slot and runs), a harness may keep
its box, and a harness whose box exec fails says why in `minimill agent logs` and
`agent status`, on a real control plane and a real worker that hosts boxes and runs agents."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from api_harness import ApiEnv
from box_harness import BoxHostProc

from minimill.agents.client import Agents
from minimill.boxes.client import Boxes

SLOTS = 4
HARNESS = '''
async def main(ctx, task):
    if task == "keep":
        await ctx.box.keep()
    if task == "unchecked":
        done = await ctx.box.exec("ls docs", check=False)
        return {"exit_code": done["exit_code"]}
    done = await ctx.box.exec(task if task.startswith("ls") else "echo " + task)
    return done["stdout"].strip()
'''


@pytest.fixture(scope="module")
def host(box_env: ApiEnv, host_root: Path) -> Iterator[BoxHostProc]:
    proc = BoxHostProc(box_env, host_root, slots=SLOTS, agents=SLOTS).start_and_wait()
    yield proc
    proc.stop()


def _cli(env: ApiEnv, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "minimill.cli", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "MINIMILL_BASE_URL": env.v1,
                                                       "MINIMILL_API_KEY": env.key})


def _live(client: Boxes) -> list[str]:
    return [b.id for b in client.list() if b.status in ("pending", "running")]


def test_the_fifth_box_after_four_agent_runs_is_created_and_runs(
        box_env: ApiEnv, host: BoxHostProc, tmp_path: Path) -> None:
    harness = tmp_path / "harness.py"
    harness.write_text(HARNESS)
    with Agents(box_env.v1, box_env.key) as agents, Boxes(box_env.v1, box_env.key) as boxes:
        before = set(_live(boxes))
        ids = [agents.run(harness, f"run{i}") for i in range(SLOTS)]
        done = [agents.wait(a, timeout_s=120) for a in ids]
        assert [(d["status"], d["result"]) for d in done] == [
            ("succeeded", f"run{i}") for i in range(SLOTS)]
        assert set(_live(boxes)) == before  # every agent's box went with its agent

        created = _cli(box_env, "box", "create", "--wait-s", "60")
        assert created.returncode == 0, created.stderr
        box_id = next(b.id for b in boxes.list() if b.id not in before)
        assert boxes.get(box_id).status == "running", created.stderr
        ran = _cli(box_env, "box", "exec", box_id, "echo fifth")
        assert (ran.returncode, ran.stdout) == (0, "fifth\n"), ran.stderr
        listed = _cli(box_env, "box", "list").stdout.splitlines()
        assert listed[0].split("\t")[:3] == ["ID", "STATUS", "HOST SLOT"]
        assert f"{box_id}\trunning\theld\t-" in listed

        # A harness that keeps its box leaves it to the tenant.
        kept = agents.wait(agents.run(harness, "keep"), timeout_s=120)
        assert kept["status"] == "succeeded", kept
        held = set(_live(boxes)) - before - {box_id}
        assert len(held) == 1
        boxes.get(held.pop()).delete()
        boxes.get(box_id).delete()


def test_a_box_exec_that_fails_says_why_in_logs_and_status(
        box_env: ApiEnv, host: BoxHostProc, tmp_path: Path) -> None:
    harness = tmp_path / "notes.py"
    harness.write_text(HARNESS)
    with Agents(box_env.v1, box_env.key) as agents, Boxes(box_env.v1, box_env.key) as boxes:
        before = set(_live(boxes))
        failed = agents.wait(agents.run(harness, "ls docs"), timeout_s=120)
        unchecked = agents.wait(agents.run(harness, "unchecked"), timeout_s=120)
        assert set(_live(boxes)) == before  # a failed agent gives its box back too
    assert failed["status"] == "failed"
    assert unchecked["status"] == "succeeded" and unchecked["result"]["exit_code"] != 0

    logs = _cli(box_env, "agent", "logs", failed["id"])
    assert logs.returncode == 0, logs.stderr
    assert "box exec exited" in logs.stdout and "docs" in logs.stdout
    assert "No such file" in logs.stdout or "can't access" in logs.stdout, logs.stdout
    assert "ExecFailed" in logs.stdout
    status = _cli(box_env, "agent", "status", failed["id"])
    assert "ExecFailed: box exec 'ls docs' exited" in status.stdout, status.stdout
    # The traceback shows the harness's own frames, not minimill's.
    assert "notes.py" in status.stdout and "runtime.py" not in status.stdout


def test_a_box_with_no_host_slot_says_so(box_env: ApiEnv, host: BoxHostProc) -> None:
    with Boxes(box_env.v1, box_env.key) as boxes:
        held = [boxes.create().id for _ in range(SLOTS)]
        created = _cli(box_env, "box", "create", "--wait-s", "1")
        assert created.returncode == 0, created.stderr
        extra = next(b.id for b in boxes.list() if b.id not in held)
        assert f"{extra}: pending: no box host has room" in created.stderr
        assert f"{extra}\tpending\twaiting\t-" in _cli(box_env, "box", "list").stdout
        seen = httpx.get(box_env.base_url + "/dashboard/data", headers={
            "Authorization": f"Bearer {box_env.operator_key}"}).json()["boxes"]
        assert set(held) <= set(seen["held"][host.site]) and seen["pending"] >= 1
        waited = _cli(box_env, "box", "exec", "--wait-s", "1", extra, "echo hi")
        assert waited.returncode == 1 and waited.stdout == ""
        assert f"error: {extra} is still pending: no box host has room after 1 s" \
            in waited.stderr
        boxes.get(held.pop()).delete()  # a slot frees: the waiting exec goes through
        ran = _cli(box_env, "box", "exec", extra, "echo hi")
        assert (ran.returncode, ran.stdout) == (0, "hi\n"), ran.stderr
        assert "waiting up to 60 s for a host slot" in ran.stderr or \
            boxes.get(extra).status == "running"
        for box_id in [*held, extra]:
            boxes.get(box_id).delete()
