"""What a runner sends over HTTP: the runner protocol with the site token (`RunnerClient`:
poll, journal, finish, release) and a harness's effects through the public API with its lease's
harness credential (`ApiEffects`: model calls and box operations, each with its journal key as
an `Idempotency-Key`, and journal appends at the lease's epoch)."""

from __future__ import annotations

import logging
from typing import Any

import httpx

from minimill.agents.runtime import EffectFailed
from minimill.transport.agent_protocol import (
    AGENT_FLEET_PREFIX,
    AgentFinish,
    AgentLease,
    AgentPollRequest,
    AgentPollResponse,
    AgentRelease,
    AgentReleased,
    JournalAppend,
    JournalAppended,
    JournalEntry,
)
from minimill.transport.client import (
    Backoff,
    ControlPlaneUnavailable,
    SiteAuthError,
    retrying,
    sleep_backoff,
)

log = logging.getLogger("minimill.agents")


class LeaseLost(RuntimeError):
    """The control plane refused this run's epoch: the agent is someone else's now."""


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

    async def release(self, ask: AgentRelease) -> AgentReleased:
        return AgentReleased.model_validate_json((await self._post("/release", ask)).content)

    async def close(self) -> None:
        await self._fleet.aclose()


class ApiEffects:
    """Effects through the public API with the lease's harness credential; journal appends
    with the epoch."""

    def __init__(self, client: RunnerClient, lease: AgentLease) -> None:
        self.client = client
        self.lease = lease
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
        message = data["choices"][0]["message"]
        answer = {"text": message.get("content") or "",
                  "finish_reason": data["choices"][0].get("finish_reason"),
                  "usage": data.get("usage") or {}}
        if message.get("tool_calls"):
            answer["tool_calls"] = message["tool_calls"]
        return answer

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

    async def journal(self, key: str, kind: str, value: Any, replayed: int) -> None:
        entry = JournalEntry(key=key, kind=kind, value=value)
        answer = await retrying(lambda: self.client.append(self.lease.agent_id, JournalAppend(
            epoch=self.lease.epoch, entries=[entry], replayed=replayed)), "journal append")
        if answer.duplicates:
            log.warning("agent %s: effect %s was journaled already", self.lease.agent_id, key)

    async def close(self) -> None:
        await self._api.aclose()
