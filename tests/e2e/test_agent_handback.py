"""A runner stopped with SIGTERM hands its agents back at once, on real processes: with leases
of two minutes, another runner resumes them within seconds. The effect in flight at the signal
is journaled by the stopping runner when it ends within the drain time, and abandoned when it
does not (the next runner joins it through its idempotency key); no model call or exec runs
twice, and both agents finish with the right answers.

The stepper's effect in flight is a step that marks its start in its box and then waits for
a file the test writes after the signal (the boxes live on serve's local worker, which goes on
serving them): the step is in flight at the signal, and ends within the drain, however slow
the machine is."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
from serve_process import Serve, Worker
from sqlalchemy import create_engine, text

from minimill.client.agents import Agents
from minimill.client.boxes import Boxes

pytestmark = pytest.mark.slow

LEASE_TTL_S = 120
DRAIN_S = 5
GATED_STEP = 2  # the stepper's step in flight at the signal

HARNESS = '''
async def main(ctx, task):
    if task["kind"] == "long":
        await ctx.log("long start")
        # Outlasts the runner's drain: it ends when the test writes `go` into the box.
        await ctx.box.exec("while [ ! -e go ]; do sleep 0.2; done; echo once >> long.txt")
        return (await ctx.box.exec("cat long.txt"))["stdout"]

    async def sub(c, item):
        text = await c.chat(f"Repeat the word {item}.", max_tokens=6)
        await c.box.exec(f"echo {item} >> seen.txt")
        return text

    await ctx.map(sub, task["items"], concurrency=3)
    await ctx.log("mapped")
    for i in range(task["steps"]):
        if i == task["gated"]:  # in flight at the signal
            await ctx.box.exec(f"touch started; while [ ! -e finish ]; do sleep 0.1; done; "
                               f"echo {i} >> steps.txt")
        else:
            await ctx.box.exec(f"echo {i} >> steps.txt")
    done = await ctx.box.exec("sort seen.txt; echo --; cat steps.txt")
    return {"out": done["stdout"], "spent": ctx.budget.spent_tokens}
'''


def start_runner(serve: Serve, name: str, **env: str) -> Worker:
    token = serve.cli("sites", "create", name, "--serves", "agents").stdout.strip().split()[-1]
    return Worker(serve.home, serve.base_url.removesuffix("/v1"), name, token, engine="none",
                  extra_args=("--agents", "4"), extra_env=env).start_and_wait()


def box_of(agents: Agents, agent_id: str) -> str:
    return str(next(e["value"] for e in agents.journal(agent_id) if e["kind"] == "box"))


def journal_rows(serve: Serve, agent_id: str) -> list[tuple[str, str, int, float]]:
    """(key, kind, epoch, created_at) of the agent's journal, read from the store itself."""
    engine = create_engine(serve.db_url())
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(
                "SELECT key, kind, epoch, created_at FROM agent_journal WHERE agent_id = :a "
                "ORDER BY created_at"), {"a": agent_id})]  # type: ignore[misc]
    finally:
        engine.dispose()


def test_sigterm_hands_agents_back_at_once(e2e_home: Path, tmp_path: Path) -> None:
    serve = Serve(e2e_home, extra_env={"MINIMILL_LEASE_TTL_S": str(LEASE_TTL_S)})
    serve.start_and_wait()
    harness = tmp_path / "harness.py"
    harness.write_text(HARNESS)
    items = ["amber", "basil", "coral", "dune"]
    steps = 8
    runners: list[Worker] = []
    boxes: Boxes | None = None
    try:
        runners.append(start_runner(serve, "hand-a", MINIMILL_WORKER_DRAIN_S=str(DRAIN_S)))
        with Agents(serve.base_url, serve.key) as agents:
            stepper = agents.run(harness, {"kind": "steps", "items": items, "steps": steps,
                                           "gated": GATED_STEP}, budget_tokens=100_000)
            long = agents.run(harness, {"kind": "long"})
            deadline = time.monotonic() + 300
            while ("mapped" not in agents.logs(stepper)
                   or "long start" not in agents.logs(long)):
                assert time.monotonic() < deadline, (agents.get(stepper), agents.get(long))
                time.sleep(0.2)
            # Nothing is queued: the second runner idles until the first hands back.
            runners.append(start_runner(serve, "hand-b"))
            boxes = Boxes(serve.base_url, serve.key)
            stepper_box = boxes.get(box_of(agents, stepper))
            while "started" not in {f["name"] for f in stepper_box.list_files()}:
                assert time.monotonic() < deadline, agents.get(stepper)
                time.sleep(0.2)
            assert agents.get(stepper)["status"] == "running"

            first = runners[0]
            stopped_at = time.time()
            first.popen.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            first.wait_for_log(r"stopping: handing back 2 agents", timeout=DRAIN_S)
            stepper_box.write("finish", "")  # the gated step ends within the drain
            assert first.popen.wait(timeout=DRAIN_S + 20) == 0  # type: ignore[union-attr]
            log = first.log_text()
            handed = re.search(r"handed back 2 agents \(([^)]*)\)", log)
            assert handed is not None, log[-3000:]
            assert set(handed.group(1).split(", ")) == {stepper, long}
            # The slow step ended within the drain and was journaled; the long exec was not.
            abandoned = re.search(r"abandoning the effects in flight of 1 agents: (\S+)", log)
            assert abandoned is not None and abandoned.group(1) == long, log[-3000:]

            second = runners[1]
            for agent_id in (stepper, long):
                second.wait_for_log(rf"agent {agent_id} \(epoch 2\) starts", timeout=30)
            taken_after = time.time() - stopped_at
            assert taken_after < LEASE_TTL_S / 4, taken_after
            # The new run of the long agent joins the abandoned exec, which is still running.
            assert agents.get(long)["status"] == "running"
            boxes.get(box_of(agents, long)).write("go", "")

            done = agents.wait(stepper, timeout_s=300)
            assert done["status"] == "succeeded", done
            seen, _, counted = done["result"]["out"].partition("--\n")
            assert seen.split() == sorted(items)  # each subagent's exec ran once
            assert counted.split() == [str(i) for i in range(steps)]  # each step once
            assert done["result"]["spent"] > 0
            assert done["restarts"] == 1 and done["repeated_effects"] == 0
            # Answered from the journal: each subagent whole, the box, the log, the steps
            # done (the one journaled during the hand-back at least).
            assert done["replayed_effects"] >= len(items) + 3
            rows = journal_rows(serve, stepper)
            assert len({r[0] for r in rows}) == len(rows)
            assert sum(r[1] == "chat" for r in rows) == len(items)
            # The step in flight at the signal was journaled by the stopping run (epoch 1),
            # and the next run went on from the step after it.
            late = [r for r in rows if r[2] == 1 and r[3] > stopped_at]
            assert [r[1] for r in late] == ["exec"], (stopped_at, rows)
            steps_by_epoch = [r[2] for r in rows if r[1] == "exec"][-steps - 1:-1]
            assert steps_by_epoch == [1] * (GATED_STEP + 1) + [2] * (steps - GATED_STEP - 1), rows

            finished = agents.wait(long, timeout_s=120)
            assert finished["status"] == "succeeded", finished
            assert finished["result"] == "once\n"  # the abandoned exec ran once, not twice
            assert finished["restarts"] == 1 and finished["repeated_effects"] == 0
            long_rows = journal_rows(serve, long)
            assert [(r[1], r[2]) for r in long_rows if r[1] == "exec"] == [
                ("exec", 2), ("exec", 2)]
    finally:
        if boxes is not None:
            boxes.close()
        for runner in runners:
            runner.stop()
        serve.stop()
