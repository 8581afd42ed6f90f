"""`minimill agent ...`: run a durable harness, follow it, read its log, cancel it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer

from minimill.cli.box import ApiKey, BaseUrl, api_errors
from minimill.client.agents import TERMINAL, Agents

agent_app = typer.Typer(help="Durable agents: harnesses that survive the loss of their "
                        "runner.", no_args_is_help=True)


@contextmanager
def _agents(base_url: str, api_key: str) -> Iterator[Agents]:
    with api_errors(), Agents(base_url, api_key) as agents:
        yield agents


def _task(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text  # a plain string task


@agent_app.command("run")
def run(file: Path = typer.Argument(..., exists=True, dir_okay=False,
                                    help="Python file with `async def main(ctx, task)`."),
        task: str | None = typer.Option(None, help="The task: JSON, or a plain string."),
        box_image: Path | None = typer.Option(None, help="Directory or archive the agent's "
                                              "box starts from."),
        budget_tokens: int | None = typer.Option(None, help="Tokens the agent may spend."),
        wait: bool = typer.Option(True, help="Follow its log until it ends."),
        base_url: str = BaseUrl, api_key: str = ApiKey) -> None:
    """Start a harness; with --wait (default) show its log as it goes and print its result."""
    with _agents(base_url, api_key) as agents:
        agent_id = agents.run(file, _task(task), box_image=box_image,
                              budget_tokens=budget_tokens)
        typer.echo(f"agent {agent_id}", err=True)
        if not wait:
            typer.echo(agent_id)
            return
        shown = 0
        while True:
            agent = agents.get(agent_id)
            lines = agents.logs(agent_id)
            for line in lines[shown:]:
                typer.echo(f"[log] {line}", err=True)
            shown = len(lines)
            if agent["status"] in TERMINAL:
                break
            time.sleep(1.0)
    typer.echo(json.dumps(agent["result"] if agent["status"] == "succeeded" else agent,
                          indent=2))
    if agent["status"] != "succeeded":
        raise typer.Exit(1)


@agent_app.command("status")
def status(agent_id: str, base_url: str = BaseUrl, api_key: str = ApiKey) -> None:
    """The agent: status, restarts, journaled/replayed/repeated effects, result."""
    with _agents(base_url, api_key) as agents:
        typer.echo(json.dumps(agents.get(agent_id), indent=2))


@agent_app.command("list")
def list_agents(status: str | None = typer.Option(
                    None, help="Only agents in this status: queued, running, sleeping, "
                    "succeeded, failed, cancelled."),
                limit: int = typer.Option(100, min=1, max=1000, help="At most this many."),
                base_url: str = BaseUrl, api_key: str = ApiKey) -> None:
    """Your agents, newest first: id, status, restarts, effects, created."""
    with _agents(base_url, api_key) as agents:
        for a in agents.list_agents(limit, status):
            created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(a["created_at"]))
            typer.echo(f"{a['id']}  {a['status']:<9}  restarts {a['restarts']}  effects "
                       f"{a['journaled_effects']}  {created}Z  {a['filename']}")


@agent_app.command("logs")
def logs(agent_id: str, base_url: str = BaseUrl, api_key: str = ApiKey) -> None:
    """What the harness recorded with ctx.log."""
    with _agents(base_url, api_key) as agents:
        for line in agents.logs(agent_id):
            typer.echo(line)


@agent_app.command("cancel")
def cancel(agent_id: str, base_url: str = BaseUrl, api_key: str = ApiKey) -> None:
    """Cancel the agent; its runner stops it at its next poll."""
    with _agents(base_url, api_key) as agents:
        typer.echo(json.dumps(agents.cancel(agent_id), indent=2))
