"""A durable harness on real processes: a runner killed with -9 mid-run, the agent finishing on
a restarted one, its journal answering what was done (no model call or exec run twice)."""

from __future__ import annotations

import time
from pathlib import Path

from serve_process import Serve, Worker

from minimill.client.agents import Agents

HARNESS = '''
async def main(ctx, task):
    await ctx.log("start")
    await ctx.box.write("notes/plan.txt", "count to " + str(len(task["items"])))

    async def sub(c, item):
        text = await c.chat(f"Repeat the word {item}.", max_tokens=6)
        await c.box.exec(f"echo {item} >> seen.txt")
        return {"item": item, "text": text}

    found = await ctx.map(sub, task["items"], concurrency=3)
    await ctx.log(f"mapped {len(found)}")
    for _ in range(task["slow_steps"]):  # where the runner gets killed
        await ctx.box.exec("sleep 0.3; echo step >> steps.txt")
    seen = await ctx.box.exec("sort seen.txt; wc -l < steps.txt")
    await ctx.log("done")
    return {"seen": seen["stdout"].split(), "spent": ctx.budget.spent_tokens,
            "plan": await ctx.box.read("notes/plan.txt")}
'''


def start_runner(serve: Serve, name: str, slots: int = 4) -> Worker:
    """A runner site: `minimill worker --engine none --agents N`."""
    token = serve.cli("sites", "create", name, "--serves", "agents").stdout.strip().split()[-1]
    return Worker(serve.home, serve.base_url.removesuffix("/v1"), name, token, engine="none",
                  extra_args=("--agents", str(slots))).start_and_wait()


def test_runner_killed_mid_run(serve: Serve, tmp_path: Path) -> None:
    harness = tmp_path / "harness.py"
    harness.write_text(HARNESS)
    items = ["apple", "birch", "cedar", "delta", "ember", "fjord"]
    slow_steps = 12
    first = start_runner(serve, "runner-a")
    second = None
    try:
        with Agents(serve.base_url, serve.key) as agents:
            agent_id = agents.run(harness, {"items": items, "slow_steps": slow_steps},
                                  budget_tokens=100_000)
            # Kill it once the fan-out is journaled and the slow steps are under way: the
            # second of them (the context's own exec1; the subagents' keys have a prefix) is
            # journaled, ten more are to come.
            deadline = time.monotonic() + 300
            while not any(e["key"] == "exec1" for e in agents.journal(agent_id)):
                assert time.monotonic() < deadline, agents.get(agent_id)
                time.sleep(0.2)
            first.kill9()
            second = start_runner(serve, "runner-b")
            agent = agents.wait(agent_id, timeout_s=300)
            assert agent["status"] == "succeeded", agent
            result = agent["result"]
            # Every subagent's exec ran once: the box saw each item exactly once...
            assert result["seen"][:-1] == sorted(items)
            # ...and each slow step once, the one in flight at the kill included.
            assert int(result["seen"][-1]) == slow_steps
            assert result["plan"] == "count to 6"
            assert result["spent"] > 0  # charged from the journal on replay too
            assert agent["restarts"] == 1
            assert agent["repeated_effects"] == 0
            assert agent["replayed_effects"] >= len(items) + 2
            journal = agents.journal(agent_id)
            keys = [e["key"] for e in journal]
            assert len(keys) == len(set(keys))
            assert sum(e["kind"] == "chat" for e in journal) == len(items)
            assert agents.logs(agent_id) == ["start", "mapped 6", "done"]
    finally:
        first.stop()
        if second is not None:
            second.stop()


SLEEPER = '''
import time


async def main(ctx, task):
    if task == "sleep":
        wake = await ctx.box.exec("date +%s")  # journaled: the same wake time on every run
        await ctx.sleep_until(int(wake["stdout"]) + 2)
        return "woke"
    if task == "budget":
        await ctx.chat("Say hi.", max_tokens=4)
        try:
            await ctx.chat("Say hi again.", max_tokens=4)
        except Exception as exc:
            return type(exc).__name__
        return "no limit"
    for _ in range(600):
        await ctx.box.exec("sleep 0.5")
'''


def test_sleep_budget_cancel(serve: Serve, tmp_path: Path) -> None:
    harness = tmp_path / "sleeper.py"
    harness.write_text(SLEEPER)
    runner = start_runner(serve, "runner-c")
    try:
        with Agents(serve.base_url, serve.key) as agents:
            sleeper = agents.run(harness, "sleep")
            budgeted = agents.run(harness, "budget", budget_tokens=1)
            forever = agents.run(harness, "forever")
            seen = set()
            deadline = time.monotonic() + 120
            while agents.get(sleeper)["status"] != "succeeded":
                seen.add(agents.get(sleeper)["status"])
                assert time.monotonic() < deadline, agents.get(sleeper)
                time.sleep(0.1)
            assert "sleeping" in seen  # it left the runner while it waited
            assert agents.get(sleeper)["result"] == "woke"
            assert agents.wait(budgeted, timeout_s=120)["result"] == "BudgetExceeded"
            while agents.get(forever)["journaled_effects"] < 3:
                time.sleep(0.1)
            assert agents.cancel(forever)["status"] == "cancelled"
            runner.wait_for_log(r"agent \S+: lease lost or revoked", timeout=30)
            # The tenant's agents, newest first, each with its journal count; by status too.
            listed = agents.list_agents()
            assert [a["id"] for a in listed][:3] == [forever, budgeted, sleeper]
            assert next(a for a in listed if a["id"] == forever)["journaled_effects"] >= 3
            assert [a["id"] for a in agents.list_agents(status="cancelled")] == [forever]
            assert [a["id"] for a in agents.list_agents(limit=1)] == [forever]
    finally:
        runner.stop()
