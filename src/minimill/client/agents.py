"""Start, follow and cancel durable agents over `/v1/agents`.

    from minimill.client.agents import Agents
    agents = Agents("http://127.0.0.1:8000/v1", api_key)
    agent_id = agents.run("harness.py", task={"question": "..."}, box_image="./corpus")
    print(agents.wait(agent_id)["result"])
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from minimill.client.boxes import Boxes

TERMINAL = ("succeeded", "failed", "cancelled")


class Agents:
    def __init__(self, base_url: str | None = None, api_key: str | None = None) -> None:
        # The box SDK's HTTP client and errors serve agents too: one API, one error shape.
        self._api = Boxes(base_url, api_key)

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._api.request(method, path, prefix="/agents", **kwargs).json()

    def run(self, file: str | os.PathLike[str], task: Any = None, *,
            box_image: str | os.PathLike[str] | None = None, budget_tokens: int | None = None,
            model: str | None = None) -> str:
        """Start the harness in `file` (`async def main(ctx, task)`); returns the agent id."""
        path = Path(file)
        image_id = self._api.upload_image(box_image) if box_image is not None else None
        body = {"code": path.read_text(), "filename": path.name, "task": task,
                "budget_tokens": budget_tokens, "model": model, "box_image": image_id}
        return str(self._request("POST", "", json=body)["id"])

    def get(self, agent_id: str) -> dict[str, Any]:
        data: dict[str, Any] = self._request("GET", f"/{agent_id}")
        return data

    def list_agents(self, limit: int = 100, status: str | None = None) -> list[dict[str, Any]]:
        """Your agents, newest first (optionally only those in `status`)."""
        params: dict[str, Any] = {"limit": limit}
        if status is not None:
            params["status"] = status
        data: list[dict[str, Any]] = self._request("GET", "", params=params)["data"]
        return data

    def logs(self, agent_id: str) -> list[str]:
        return [e["message"] for e in self._request("GET", f"/{agent_id}/logs")["data"]]

    def journal(self, agent_id: str) -> list[dict[str, Any]]:
        data: list[dict[str, Any]] = self._request("GET", f"/{agent_id}/journal")["data"]
        return data

    def cancel(self, agent_id: str) -> dict[str, Any]:
        data: dict[str, Any] = self._request("POST", f"/{agent_id}/cancel")
        return data

    def wait(self, agent_id: str, timeout_s: float | None = None,
             poll_s: float = 0.5) -> dict[str, Any]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            agent = self.get(agent_id)
            if agent["status"] in TERMINAL:
                return agent
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"agent {agent_id} is still {agent['status']}")
            time.sleep(poll_s)

    def close(self) -> None:
        self._api.close()

    def __enter__(self) -> Agents:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
