"""The runner: a site's loop that pulls agents from the control plane and runs their
harnesses (runtime.py) until they finish, sleep, or their lease is revoked.

Each lease brings the harness code, the task, the journal so far and an API key of the
agent's tenant valid while the lease lives. Model calls and boxes go through the public API
with that key (the token factory's background tier by default); journal appends, which carry
the lease's epoch, go to the runner protocol with the site token. A journal append refused
for a stale epoch means another runner has the agent: this run stops.

Harness code runs in the runner's process: a runner trusts the tenants whose harnesses it
runs (their commands run in boxes, which are isolated).
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from typing import Any

import httpx

from minimill.agent_protocol import (
    AGENT_FLEET_PREFIX,
    AgentFinish,
    AgentLease,
    AgentPollRequest,
    AgentPollResponse,
    HeldAgent,
    JournalAppend,
    JournalAppended,
    JournalEntry,
)
from minimill.agents.runtime import Budget, Ctx, Effects, Run, Suspend, load_main
from minimill.fleet.client import Backoff, ControlPlaneUnavailable, SiteAuthError, sleep_backoff

log = logging.getLogger("minimill.agents")
POLL_WAIT_S = 2.0


class LeaseLost(RuntimeError):
    """The control plane refused this run's epoch: the agent is someone else's now."""


class EffectFailed(RuntimeError):
    """The API answered an effect with an error (shown to the harness as this exception)."""


class RunnerClient:
    def __init__(self, server: str, token: str) -> None:
        self.server = server.rstrip("/")
        self._fleet = httpx.AsyncClient(base_url=self.server + AGENT_FLEET_PREFIX,
                                        headers={"Authorization": f"Bearer {token}"},
                                        timeout=httpx.Timeout(60.0))

    async def _post(self, path: str, body: Any) -> httpx.Response:
        try:
            resp = await self._fleet.post(path, content=body.model_dump_json(),
                                          headers={"Content-Type": "application/json"})
        except httpx.HTTPError as exc:
            raise ControlPlaneUnavailable(f"{path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code in (401, 403):
            raise SiteAuthError(f"the control plane rejected this site's token: {resp.text}")
        if resp.status_code == 409:
            raise LeaseLost(resp.text[:300])
        if resp.status_code >= 400:
            raise ControlPlaneUnavailable(f"{path}: HTTP {resp.status_code}: {resp.text[:300]}")
        return resp

    async def poll(self, ask: AgentPollRequest) -> AgentPollResponse:
        return AgentPollResponse.model_validate_json((await self._post("/poll", ask)).content)

    async def append(self, agent_id: str, ask: JournalAppend) -> JournalAppended:
        resp = await self._post(f"/{agent_id}/journal", ask)
        return JournalAppended.model_validate_json(resp.content)

    async def finish(self, agent_id: str, done: AgentFinish) -> bool:
        resp = await self._post(f"/{agent_id}/finish", done)
        return bool(resp.json().get("accepted"))

    async def close(self) -> None:
        await self._fleet.aclose()


async def _retrying(call: Any, what: str) -> Any:
    backoff = Backoff()
    while True:
        try:
            return await call()
        except ControlPlaneUnavailable as exc:
            await sleep_backoff(backoff, what, exc)


class ApiEffects(Effects):
    """Effects through the public API with the lease's key; journal appends with the epoch."""

    def __init__(self, client: RunnerClient, lease: AgentLease, run_ref: list[Run]) -> None:
        self.client = client
        self.lease = lease
        self._run_ref = run_ref
        self._api = httpx.AsyncClient(base_url=client.server + "/v1",
                                      headers={"Authorization": f"Bearer {lease.api_key}"},
                                      timeout=httpx.Timeout(3600.0))

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        backoff = Backoff()
        while True:
            try:
                resp = await self._api.request(method, path, **kwargs)
            except httpx.HTTPError as exc:
                await sleep_backoff(backoff, path, ControlPlaneUnavailable(str(exc)))
                continue
            if resp.status_code == 401:
                raise LeaseLost("the lease's key was revoked: another runner has the agent")
            if resp.status_code >= 500 or resp.status_code == 429:
                await sleep_backoff(backoff, path, ControlPlaneUnavailable(resp.text[:200]))
                continue
            if resp.status_code >= 400:
                raise EffectFailed(resp.text[:500])
            return resp

    async def chat(self, body: dict[str, Any], key: str) -> dict[str, Any]:
        once = {"Idempotency-Key": f"{self.lease.agent_id}/{key}"}
        data = (await self._call("POST", "/chat/completions", json=body, headers=once)).json()
        return {"text": data["choices"][0]["message"].get("content") or "",
                "finish_reason": data["choices"][0].get("finish_reason"),
                "usage": data.get("usage") or {}}

    async def box_create(self) -> str:
        resp = await self._call("POST", "/boxes", json={"image": self.lease.box_image})
        return str(resp.json()["id"])

    async def box_call(self, box_id: str, op: str, args: dict[str, Any], key: str) -> Any:
        # The effect's key makes the call idempotent: if a lost runner's call still runs (or
        # ran) on the box, this one gets its result instead of running it again.
        once = {"Idempotency-Key": f"{self.lease.agent_id}/{key}"}
        if op == "exec":
            body = {k: v for k, v in args.items() if v is not None}
            return (await self._call("POST", f"/boxes/{box_id}/exec", json=body,
                                     headers=once)).json()
        if op == "write":
            await self._call("PUT", f"/boxes/{box_id}/files", params={"path": args["path"]},
                             content=str(args["content"]).encode(), headers=once)
            return None
        resp = await self._call("GET", f"/boxes/{box_id}/files/content",
                                params={"path": args["path"]})
        return resp.content.decode(errors="replace")

    async def journal(self, entry: JournalEntry) -> None:
        run = self._run_ref[0]
        replayed, run.replayed = run.replayed, 0
        answer = await _retrying(lambda: self.client.append(self.lease.agent_id, JournalAppend(
            epoch=self.lease.epoch, entries=[entry], replayed=replayed)), "journal append")
        if answer.duplicates:
            log.warning("agent %s: effect %s was journaled already", self.lease.agent_id,
                        entry.key)

    async def close(self) -> None:
        await self._api.aclose()


class AgentRunner:
    def __init__(self, client: RunnerClient, slots: int) -> None:
        self.client = client
        self.slots = slots
        self.running: dict[str, tuple[AgentLease, asyncio.Task[None]]] = {}
        self.stopping = asyncio.Event()
        self.stats = {"agents": 0, "finished": 0, "revoked": 0}

    def stop(self) -> None:
        self.stopping.set()

    async def run(self) -> None:
        backoff = Backoff()
        while not self.stopping.is_set():
            ask = AgentPollRequest(
                capacity=max(0, self.slots - len(self.running)), wait_s=POLL_WAIT_S,
                held=[HeldAgent(agent_id=a, epoch=lease.epoch)
                      for a, (lease, _) in self.running.items()])
            try:
                answer = await self.client.poll(ask)
            except ControlPlaneUnavailable as exc:
                await sleep_backoff(backoff, "agent poll", exc)
                continue
            backoff.reset()
            for agent_id in answer.revoked:
                held = self.running.pop(agent_id, None)
                if held is not None:
                    self.stats["revoked"] += 1
                    held[1].cancel()
            for lease in answer.leases:
                self.stats["agents"] += 1
                task = asyncio.create_task(self._run_agent(lease))
                self.running[lease.agent_id] = (lease, task)
        for _, task in self.running.values():
            task.cancel()  # their leases lapse; the agents continue elsewhere from the journal
        await asyncio.gather(*(t for _, t in self.running.values()), return_exceptions=True)

    async def _run_agent(self, lease: AgentLease) -> None:
        run_ref: list[Run] = []
        effects = ApiEffects(self.client, lease, run_ref)
        journal = {e.key: e.value for e in lease.journal}
        run = Run(effects=effects, journal=journal, model=lease.model,
                  budget=Budget.from_journal(lease.budget_tokens, lease.journal))
        run_ref.append(run)
        log.info("agent %s (epoch %d) starts; %d effects journaled", lease.agent_id,
                 lease.epoch, len(journal))
        done: AgentFinish
        try:
            main = load_main(lease.code, lease.filename)
            result = await main(Ctx(run), lease.task)
            done = AgentFinish(epoch=lease.epoch, outcome="succeeded", result=_jsonable(result))
        except Suspend as sleep:
            done = AgentFinish(epoch=lease.epoch, outcome="sleeping", wake_at=sleep.wake_at)
        except (LeaseLost, asyncio.CancelledError):
            log.info("agent %s: lease lost or revoked; stopping this run", lease.agent_id)
            self.running.pop(lease.agent_id, None)
            await effects.close()
            return
        except Exception as exc:
            tail = "".join(traceback.format_exception(exc)[-6:])[-4000:]
            done = AgentFinish(epoch=lease.epoch, outcome="failed",
                               error={"code": "harness_error", "message": tail})
        try:
            if run.replayed:  # count what this run answered from the journal
                await _retrying(lambda: self.client.append(lease.agent_id, JournalAppend(
                    epoch=lease.epoch, entries=[], replayed=run.replayed)), "journal append")
            await _retrying(lambda: self.client.finish(lease.agent_id, done), "agent finish")
            self.stats["finished"] += 1
            log.info("agent %s %s (%d effects run, %d from the journal)", lease.agent_id,
                     done.outcome, run.performed, len(journal))
        except LeaseLost:
            pass
        finally:
            self.running.pop(lease.agent_id, None)
            await effects.close()


def _jsonable(value: Any) -> Any:
    import json

    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)
