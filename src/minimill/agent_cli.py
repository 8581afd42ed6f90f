"""`minimill agent ...`: run a durable harness, follow it, read its log, cancel it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer

from minimill.agents.client import TERMINAL, Agents
from minimill.box_cli import ApiKey, BaseUrl, api_errors
from minimill.cli_options import JsonOption, print_table

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
    if agent["status"] != "succeeded":
        _show_agent(agent)
        raise typer.Exit(1)
    typer.echo(json.dumps(agent["result"], indent=2))


def _show_agent(agent: dict[str, Any]) -> None:
    """The agent's record as JSON, its error's message (a traceback of the harness's own
    frames) printed as the text it is rather than one string of escaped newlines."""
    error = agent.get("error")
    shown = {**agent, "error": "(below)"} if isinstance(error, dict) else agent
    typer.echo(json.dumps(shown, indent=2))
    if isinstance(error, dict):
        typer.echo(f"error ({error.get('code') or 'unknown'}):")
        typer.echo(str(error.get("message") or "").rstrip())


@agent_app.command("status")
def status(agent_id: str, as_json: bool = JsonOption, base_url: str = BaseUrl,
           api_key: str = ApiKey) -> None:
    """The agent: status, restarts, journaled/replayed/repeated effects, result, and how a
    failed one failed."""
    with _agents(base_url, api_key) as agents:
        agent = agents.get(agent_id)
    if as_json:
        typer.echo(json.dumps(agent, indent=2))
    else:
        _show_agent(agent)


@agent_app.command("list")
def list_agents(status: str | None = typer.Option(
                    None, help="Only agents in this status: queued, running, sleeping, "
                    "succeeded, failed, cancelled."),
                limit: int = typer.Option(100, min=1, max=1000, help="At most this many."),
                base_url: str = BaseUrl, api_key: str = ApiKey) -> None:
    """Your agents, newest first: id, status, restarts, effects, created."""
    with _agents(base_url, api_key) as agents:
        listed = agents.list_agents(limit, status)
    if not listed:
        typer.echo("no agents" + (f" {status}" if status else ""))
        return
    rows = [(a["id"], a["status"], str(a["restarts"]), str(a["journaled_effects"]),
             time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(a["created_at"])), a["filename"])
            for a in listed]
    print_table("", ("id", "status", "restarts", "effects", "created", "file"), rows,
                left=("id", "status", "created", "file"))


@agent_app.command("logs")
def logs(agent_id: str, base_url: str = BaseUrl, api_key: str = ApiKey) -> None:
    """What the harness recorded with ctx.log, its box execs that failed (exit code, stderr
    tail) and, for a failed agent, its error."""
    with _agents(base_url, api_key) as agents:
        for line in agents.logs(agent_id):
            typer.echo(line)


@agent_app.command("cancel")
def cancel(agent_id: str, base_url: str = BaseUrl, api_key: str = ApiKey) -> None:
    """Cancel the agent; its runner stops it at its next poll."""
    with _agents(base_url, api_key) as agents:
        typer.echo(json.dumps(agents.cancel(agent_id), indent=2))
