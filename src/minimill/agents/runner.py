"""The runner: a site's loop that pulls agents from the control plane and runs their
harnesses (runtime.py) until they finish, sleep, or their lease is revoked.

Each lease brings the harness code, the task, the journal so far and a harness credential
valid while the lease lives, for that agent only. Model calls and its box go through the public
API with it (the token factory's background tier by default); journal appends, which carry
the lease's epoch, go to the runner protocol with the site token. A journal append refused
for a stale epoch means another runner has the agent: this run stops. A stopping runner
hands its agents back (`AgentRunner.stop`) instead of letting their leases expire.

Harness code is a tenant's: it never runs in the runner's process, which holds the site token,
but in a sandboxed process of its own that asks the runner for its effects
(harness_process.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from minimill.agent_protocol import (
    AgentFinish,
    AgentLease,
    AgentPollRequest,
    AgentRelease,
    AgentReleased,
    HeldAgent,
    JournalAppend,
    ReleasedAgent,
)
from minimill.agents.api_effects import ApiEffects, LeaseLost, RunnerClient
from minimill.agents.harness_process import (
    HarnessProcess,
    HarnessStart,
    check_harness_isolation,
)
from minimill.boxes.sandbox import IsolationUnavailable
from minimill.fleet.client import Backoff, ControlPlaneUnavailable, retrying, sleep_backoff
from minimill.fleet.shutdown import send_within

log = logging.getLogger("minimill.agents")
POLL_WAIT_S = 2.0
HAND_BACK_BEAT_S = 1.0  # how often a hand-back that waits for effects extends the leases


class RunnerStartError(RuntimeError):
    """This site cannot run harnesses (no sandbox, and the operator did not opt out)."""


@dataclass
class HeldRun:
    """An agent this runner holds: its lease, its run and the task that runs it."""

    lease: AgentLease
    process: HarnessProcess
    effects: ApiEffects
    task: asyncio.Task[None] | None = None
    finishing: bool = False  # the harness ended: its outcome is on the way to the store

    @property
    def settled(self) -> bool:
        """Handed back with nothing left to journal or report: safe to cancel and release."""
        return self.process.quiet and not self.finishing


class AgentRunner:
    """Polls for agents and runs them, `slots` at once.

    `stop()` hands every agent back: no new effect starts, the ones in flight get `drain_s`
    to be journaled, and then each agent is released at its epoch (runs still in an effect
    then are abandoned: their calls carry idempotency keys, so the next runner gets their
    results instead of doing them again). A second `stop()` skips the wait."""

    def __init__(self, client: RunnerClient, slots: int, drain_s: float | None = None,
                 insecure: bool = False) -> None:
        self.client = client
        self.slots = slots
        self.insecure = insecure  # harnesses without a sandbox (the operator opted out)
        self.drain_s = (float(os.environ.get("MINIMILL_WORKER_DRAIN_S", "10"))
                        if drain_s is None else drain_s)
        self.running: dict[str, HeldRun] = {}
        self.stopping = asyncio.Event()
        self.hurry = asyncio.Event()
        self._handed: list[HeldRun] = []  # cancelled by the hand-back, to release
        self._unstarted: list[ReleasedAgent] = []  # granted as the stop came, never run
        self.stats = {"agents": 0, "finished": 0, "revoked": 0, "released": 0}

    def stop(self) -> None:
        if not self.stopping.is_set():
            log.info("stopping: handing back %d agents once their effects in flight are "
                     "journaled", len(self.running))
            self.stopping.set()
            # At once, not when the poll in flight returns: no effect may start meanwhile.
            for held in self.running.values():
                held.process.hand_back()
        elif not self.hurry.is_set():
            log.info("stopping now: abandoning the effects still in flight")
            self.hurry.set()

    def _held(self) -> list[HeldAgent]:
        return [HeldAgent(agent_id=a, epoch=held.lease.epoch)
                for a, held in self.running.items()]

    def _revoke(self, agent_ids: list[str]) -> None:
        for agent_id in agent_ids:
            held = self.running.pop(agent_id, None)
            if held is not None and held.task is not None:
                self.stats["revoked"] += 1
                held.task.cancel()

    async def run(self) -> None:
        backoff = Backoff()
        while not self.stopping.is_set():
            # A poll in flight when the stop comes is answered (within POLL_WAIT_S), not
            # dropped: the control plane may grant agents to it, and those are handed back
            # below rather than left to wait out their leases.
            ask = AgentPollRequest(capacity=max(0, self.slots - len(self.running)),
                                   wait_s=POLL_WAIT_S, held=self._held())
            try:
                answer = await self.client.poll(ask)
            except ControlPlaneUnavailable as exc:
                await sleep_backoff(backoff, "agent poll", exc)
                continue
            backoff.reset()
            self._revoke(answer.revoked)
            for lease in answer.leases:
                if self.stopping.is_set():
                    self._unstarted.append(ReleasedAgent(agent_id=lease.agent_id,
                                                         epoch=lease.epoch, replayed=0))
                else:
                    self._start(lease)
        await self._hand_back()

    def _start(self, lease: AgentLease) -> None:
        self.stats["agents"] += 1
        effects = ApiEffects(self.client, lease)
        start = HarnessStart(code=lease.code, filename=lease.filename, task=lease.task,
                             model=lease.model, budget_tokens=lease.budget_tokens,
                             journal=[(e.key, e.kind, e.value) for e in lease.journal])
        process = HarnessProcess(lease.agent_id, start, effects, insecure=self.insecure)
        held = HeldRun(lease=lease, process=process, effects=effects)
        self.running[lease.agent_id] = held
        held.task = asyncio.create_task(self._run_agent(held))

    async def _hand_back(self) -> None:
        """Park every run at its next effect, let the effects in flight be journaled (the
        leases kept alive meanwhile), then cancel the runs and release their agents."""
        deadline = time.monotonic() + self.drain_s
        next_beat = 0.0
        while self.running and not self.hurry.is_set() and time.monotonic() < deadline:
            if all(h.settled for h in self.running.values()):
                break
            if time.monotonic() >= next_beat:  # the leases outlive a drain longer than a TTL
                next_beat = time.monotonic() + HAND_BACK_BEAT_S
                with contextlib.suppress(ControlPlaneUnavailable, TimeoutError):
                    beat = await asyncio.wait_for(self.client.poll(AgentPollRequest(
                        capacity=0, held=self._held(), wait_s=0.0)), HAND_BACK_BEAT_S)
                    self._revoke(beat.revoked)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.hurry.wait(), 0.05)
        busy = [a for a, h in self.running.items() if not h.settled]
        if busy:
            log.warning("abandoning the effects in flight of %d agents: %s", len(busy),
                        ", ".join(busy))
        tasks = [h.task for h in self.running.values() if h.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        handed = [ReleasedAgent(agent_id=h.lease.agent_id, epoch=h.lease.epoch,
                                replayed=h.process.replayed) for h in self._handed]
        handed += self._unstarted
        self._handed, self._unstarted = [], []
        if not handed:
            return
        ask = AgentRelease(agents=handed)
        answer: list[AgentReleased] = []

        async def send() -> None:
            answer.append(await self.client.release(ask))

        await send_within(send, "agent release")
        if answer:
            self.stats["released"] += len(answer[0].released)
            log.info("handed back %d agents (%s)%s", len(answer[0].released),
                     ", ".join(answer[0].released),
                     f"; not ours any more: {', '.join(answer[0].rejected)}"
                     if answer[0].rejected else "")
        else:
            log.warning("%d agents not handed back; their leases will expire", len(handed))

    async def _run_agent(self, held: HeldRun) -> None:
        lease, process, effects = held.lease, held.process, held.effects
        log.info("agent %s (epoch %d) starts; %d effects journaled", lease.agent_id,
                 lease.epoch, len(lease.journal))
        try:
            try:
                await process.start()
                outcome = await process.wait()
            except OSError as exc:  # the harness process could not start
                outcome = {"outcome": "failed", "performed": 0,
                           "message": f"the harness process could not start: {exc}"}
            done = _finish(lease.epoch, outcome)
            held.finishing = True
            if process.replayed:  # count what this run answered from the journal
                await retrying(lambda: self.client.append(lease.agent_id, JournalAppend(
                    epoch=lease.epoch, entries=[], replayed=process.replayed)),
                    "journal append")
            accepted = await retrying(lambda: self.client.finish(lease.agent_id, done),
                                      "agent finish")
            if not accepted:  # cancelled meanwhile (its box deleted with it), or taken over
                log.info("agent %s: lease lost or revoked; its end (%s) was not recorded",
                         lease.agent_id, done.outcome)
                return
            self.stats["finished"] += 1
            log.info("agent %s %s (%d effects run, %d from the journal)", lease.agent_id,
                     done.outcome, outcome["performed"], len(lease.journal))
        except (LeaseLost, asyncio.CancelledError):
            mine = self.running.get(lease.agent_id) is held
            if mine and process.handing_back:  # cancelled by the hand-back, not revoked
                self._handed.append(held)
            else:
                log.info("agent %s: lease lost or revoked; stopping this run", lease.agent_id)
        finally:
            if self.running.get(lease.agent_id) is held:
                del self.running[lease.agent_id]
            await process.close()
            await effects.close()


def open_runner(server: str, token: str, slots: int, insecure: bool) -> AgentRunner:
    """A runner for `slots` agents at once; refuses to start where harnesses cannot be
    sandboxed, unless the operator opted out (`insecure`)."""
    if insecure:
        log.warning("harnesses run WITHOUT a sandbox (--insecure-no-sandbox): a tenant's "
                    "code can read what this process's user can read")
    else:
        try:
            check_harness_isolation()
        except IsolationUnavailable as exc:
            raise RunnerStartError(f"cannot run agents: {exc}") from None
    return AgentRunner(RunnerClient(server, token), slots, insecure=insecure)


def _finish(epoch: int, outcome: dict[str, Any]) -> AgentFinish:
    """The store's record of how a harness process ended."""
    if outcome["outcome"] == "succeeded":
        # JSON from the harness process: stored as it came.
        return AgentFinish(epoch=epoch, outcome="succeeded", result=outcome.get("result"))
    if outcome["outcome"] == "sleeping":
        return AgentFinish(epoch=epoch, outcome="sleeping", wake_at=float(outcome["wake_at"]))
    return AgentFinish(epoch=epoch, outcome="failed",
                       error={"code": "harness_error",
                              "message": str(outcome.get("message") or "")[-4000:]})

