"""`minimill box ...`: boxes from the command line, over the SDK (boxes/client.py)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import httpx
import typer

from minimill.boxes.client import Box, BoxError, Boxes, ExecEvent, ExecResult
from minimill.cli_options import ApiKeyOption, BaseUrlOption, error_line

box_app = typer.Typer(help="Boxes: sandboxes without a lifetime limit (exec, files, "
                      "snapshots).", no_args_is_help=True)
BaseUrl = BaseUrlOption
ApiKey = ApiKeyOption
WaitOption = typer.Option(60.0, "--wait-s", help="How long to wait for a host slot when "
                          "the box is pending.")
# What a pending box waits for: every box host's slots are held by other boxes (or no host
# is connected yet).
NO_ROOM = "pending: no box host has room"
PLACED_POLL_S = 0.5


@contextmanager
def api_errors() -> Iterator[None]:
    """API errors and unreachable servers (or missing local files) end a command with a
    message, not a traceback (shared with `minimill agent`)."""
    try:
        yield
    except BoxError as exc:
        typer.echo(f"error: {error_line(exc.message, exc.status, exc.code, exc.request_id)}",
                   err=True)
        raise typer.Exit(1) from None
    except (OSError, httpx.TransportError) as exc:  # unreachable server, missing image
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


@contextmanager
def _boxes(base_url: str, api_key: str) -> Iterator[Boxes]:
    with api_errors(), Boxes(base_url, api_key) as boxes:
        yield boxes


def _show(data: dict[str, Any]) -> None:
    typer.echo(json.dumps(data, indent=2))


@box_app.command("create")
def create(image: Path | None = typer.Option(None, help="A directory or archive to start "
                                             "from."),
           snapshot: str | None = typer.Option(None, help="A snapshot to restore."),
           network: bool = typer.Option(False, help="Let the box reach the network."),
           disk_mb: int = typer.Option(1024, help="Workspace quota, MiB."),
           timeout_s: float = typer.Option(60.0, help="Default wall clock per exec."),
           idle_timeout: str | None = typer.Option(
               None, "--idle-timeout", metavar="SECONDS|never",
               help="Pause the box after this many seconds without an operation (it is "
               "snapshotted and leaves its host; its next exec or file operation resumes it, "
               "same id, same files). 'never': no idle pause. Default: the server's "
               "(MINIMILL_BOX_IDLE_TIMEOUT_S)."),
           wait_s: float = typer.Option(10.0, "--wait-s", help="How long to wait for a host "
                                        "to take the box before printing it."),
           base_url: str = BaseUrl, api_key: str = ApiKey) -> None:
    """Create a box; prints it (its id is what the other commands take)."""
    idle: float | Literal["default"] | None = (
        "default" if idle_timeout is None else _idle_seconds(idle_timeout))
    with _boxes(base_url, api_key) as boxes:
        box = boxes.create(image, snapshot=snapshot, network=network,
                           limits={"disk_mb": disk_mb, "timeout_s": timeout_s},
                           idle_timeout_s=idle)
        deadline = time.monotonic() + wait_s
        while box.status == "pending" and time.monotonic() < deadline:
            time.sleep(PLACED_POLL_S)
            box = boxes.get(box.id)
        _show(box.data)
        if box.status == "pending":
            typer.echo(f"{box.id}: {NO_ROOM} yet; it starts once a host frees a slot "
                       "(minimill box list shows which boxes hold one)", err=True)


def _idle_seconds(text: str) -> float | None:
    if text.strip().lower() == "never":
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise typer.BadParameter(f"{text!r} is neither a number of seconds > 0 nor 'never'",
                                 param_hint="--idle-timeout")
    return seconds


@box_app.command("list")
def list_boxes(base_url: str = BaseUrl, api_key: str = ApiKey) -> None:
    """The tenant's boxes, one per line: id, status, whether it holds a host slot, latest
    snapshot."""
    with _boxes(base_url, api_key) as boxes:
        listed = boxes.list()
    if not listed:
        typer.echo("no boxes")
        return
    typer.echo("ID\tSTATUS\tHOST SLOT\tLATEST SNAPSHOT")
    for box in listed:
        slot = {"running": "held", "pending": "waiting"}.get(box.status, "-")
        typer.echo(f"{box.id}\t{box.status}\t{slot}\t{box.data.get('latest_snapshot') or '-'}")


@box_app.command("exec", context_settings={"allow_interspersed_args": False})
def exec_(box_id: str = typer.Argument(..., help="The box."),
          command: list[str] = typer.Argument(..., help="One argument: a shell command line "
                                              "(run by /bin/sh -c). Several, or any after "
                                              "--: the program and its arguments."),
          timeout_s: float | None = typer.Option(None, help="Wall clock for this exec."),
          stdin: bool = typer.Option(False, "--stdin", help="Send this program's stdin."),
          stream: bool = typer.Option(False, "--stream", help="Print the command's output "
                                      "as it comes, not once it has ended."),
          wait_s: float = WaitOption,
          base_url: str = BaseUrl, api_key: str = ApiKey) -> None:
    """Run a command in the box; its output and exit code become this command's.

    minimill box exec BOX "ls -l && cat notes.txt"   (a shell command line)

    minimill box exec BOX -- python3 -c "print(1)"   (argv, no shell)"""
    argv = exec_command(command)
    with _boxes(base_url, api_key) as boxes:
        box = boxes.get(box_id)
        if box.status == "pending":
            box = _wait_placed(boxes, box_id, wait_s)
        data = sys.stdin.read() if stdin else ""
        if stream:
            result = _print_stream(box.exec_stream(argv, timeout_s=timeout_s, stdin=data))
        else:
            result = box.exec(argv, timeout_s=timeout_s, stdin=data)
            sys.stdout.write(result.stdout)
            sys.stderr.write(result.stderr)
    if result.error:
        typer.echo(f"error: {result.error}", err=True)
    raise typer.Exit(result.exit_code)


def exec_command(words: list[str]) -> str | list[str]:
    """The command as the API takes it: one word is a shell command line (a string, run by
    /bin/sh -c, as the SDK's box.exec("...") does); several words, or any after `--`, are
    argv. Click leaves `--` in place once options end, so it is taken out here."""
    if words and words[0] == "--":
        if len(words) == 1:
            raise typer.BadParameter("no command after --", param_hint="COMMAND")
        return words[1:]
    return words[0] if len(words) == 1 else words


def _wait_placed(boxes: Boxes, box_id: str, wait_s: float) -> Box:
    """Wait (saying so) for a pending box to be taken by a host, at most `wait_s`."""
    typer.echo(f"{box_id} is {NO_ROOM}; waiting up to {wait_s:g} s for a host slot "
               "(minimill box list shows which boxes hold one)", err=True)
    deadline = time.monotonic() + wait_s
    while True:
        box = boxes.get(box_id)
        if box.status != "pending":
            return box
        if time.monotonic() >= deadline:
            typer.echo(f"error: {box_id} is still {NO_ROOM} after {wait_s:g} s; free a slot "
                       "with `minimill box rm ID` or `minimill box pause ID`, or try later",
                       err=True)
            raise typer.Exit(1)
        time.sleep(PLACED_POLL_S)


def _print_stream(events: Iterator[ExecEvent]) -> ExecResult:
    for event in events:
        if event.type in ("stdout", "stderr"):
            out = sys.stdout if event.type == "stdout" else sys.stderr
            out.write(event.data)
            out.flush()
        elif event.type == "restart":
            typer.echo("\n[its host stopped before the command ended: it runs again from "
                       "the start]", err=True)
        elif event.result is not None:
            return event.result
    raise BoxError(502, "the stream ended before the exec did", "stream_incomplete")


def _one(verb: Callable[[Boxes], Any], base_url: str, api_key: str) -> Any:
    with _boxes(base_url, api_key) as boxes:
        return verb(boxes)


@box_app.command("write")
def write(box_id: str, path: str = typer.Argument(..., help="Path in the workspace."),
          source: Path | None = typer.Option(None, "--from", help="Local file (default: "
                                             "stdin)."),
          base_url: str = BaseUrl, api_key: str = ApiKey) -> None:
    """Write a file of the box from a local file or stdin."""
    data = source.read_bytes() if source else sys.stdin.buffer.read()
    size = _one(lambda b: b.get(box_id).write(path, data), base_url, api_key)
    typer.echo(f"wrote {size} bytes to {path}")


@box_app.command("read")
def read(box_id: str, path: str = typer.Argument(..., help="Path in the workspace."),
         base_url: str = BaseUrl, api_key: str = ApiKey) -> None:
    """Print a file of the box."""
    sys.stdout.buffer.write(_one(lambda b: b.get(box_id).read(path), base_url, api_key))


@box_app.command("ls")
def ls(box_id: str, path: str = typer.Argument(".", help="Directory in the workspace."),
       base_url: str = BaseUrl, api_key: str = ApiKey) -> None:
    """List a directory of the box: type, size, name."""
    entries = _one(lambda b: b.get(box_id).list_files(path), base_url, api_key)
    if not entries:
        typer.echo(f"{path}: empty")
        return
    typer.echo(f"{'TYPE':<8}{'BYTES':>12}  NAME")
    for entry in entries:
        typer.echo(f"{entry['type']:<8}{entry['bytes']:>12}  {entry['name']}")


@box_app.command("snapshot")
def snapshot(box_id: str, base_url: str = BaseUrl, api_key: str = ApiKey) -> None:
    """Snapshot the box now; prints the snapshot id (restore: create --snapshot ID)."""
    typer.echo(_one(lambda b: b.get(box_id).snapshot(), base_url, api_key))


@box_app.command("pause")
def pause(box_id: str, base_url: str = BaseUrl, api_key: str = ApiKey) -> None:
    """Snapshot the box and take it off its host until resumed."""
    _show(_one(lambda b: b.get(box_id).pause().data, base_url, api_key))


@box_app.command("resume")
def resume(box_id: str, base_url: str = BaseUrl, api_key: str = ApiKey) -> None:
    """Bring a paused box back (on any host, from its snapshot)."""
    _show(_one(lambda b: b.get(box_id).resume().data, base_url, api_key))


@box_app.command("rm")
def rm(box_id: str, base_url: str = BaseUrl, api_key: str = ApiKey) -> None:
    """Delete the box (its manual snapshots stay restorable)."""
    _one(lambda b: b.get(box_id).delete(), base_url, api_key)
    typer.echo(f"deleted {box_id}")
