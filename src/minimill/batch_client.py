"""`minimill batch submit|status|results|cancel`: the Batch API for humans, over the openai client.

Every API failure becomes one clear line on stderr and exit status 1 (never a traceback):
connection refused, a rejected key, an unknown id, a rejected file.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import openai
from openai import OpenAI
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
POLL_S = 1.0
err_console = Console(stderr=True)


class BatchClientError(Exception):
    """A failure to show the user as one line."""


def _fail(message: str) -> NoReturn:
    err_console.print(f"[red]error:[/red] {message}", highlight=False)
    raise SystemExit(1)


def _message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    return str(exc.message)


@contextlib.contextmanager
def _api_errors(base_url: str, what: str) -> Iterator[None]:
    try:
        yield
    except openai.APIConnectionError:
        _fail(f"cannot reach {base_url} (is `minimill serve` running there?)")
    except openai.AuthenticationError:
        _fail("the API key was rejected (HTTP 401): check --api-key / MINIMILL_API_KEY or "
              "OPENAI_API_KEY (`minimill keys create --tenant NAME` makes one)")
    except openai.NotFoundError as exc:
        _fail(f"{what}: not found ({_message(exc)}; request {exc.request_id})")
    except openai.APIStatusError as exc:
        _fail(f"{what}: HTTP {exc.status_code}: {_message(exc)} (request {exc.request_id})")
    except BatchClientError as exc:
        _fail(str(exc))


def _client(base_url: str, api_key: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key=api_key, max_retries=2, timeout=120.0)


def _endpoint_of(file: Path) -> str:
    """The batch endpoint: the `url` of the first line (all lines must share it)."""
    with file.open("rb") as fh:
        for raw in fh:
            if raw.strip():
                try:
                    url = json.loads(raw).get("url")
                except (ValueError, AttributeError):
                    break
                if isinstance(url, str) and url:
                    return url
                break
    return "/v1/chat/completions"


def error_path(output: Path) -> Path:
    """Where the error file goes beside an output file."""
    return output.with_name(output.stem + ".errors" + (output.suffix or ".jsonl"))


def _download(client: OpenAI, file_id: str | None) -> bytes:
    if not file_id:
        return b""
    return client.files.content(file_id).read()


def _write_results(client: OpenAI, batch: Any, output: Path | None) -> None:
    out = _download(client, batch.output_file_id)
    errors = _download(client, batch.error_file_id)
    if output is None:
        sys.stdout.buffer.write(out + errors)
        sys.stdout.flush()
        return
    output.write_bytes(out)
    num_out, num_err = len(out.splitlines()), len(errors.splitlines())
    err_console.print(f"output ({num_out} lines): {output}", highlight=False)
    if batch.error_file_id:
        error_path(output).write_bytes(errors)
        err_console.print(f"errors ({num_err} lines): {error_path(output)}", highlight=False)


def _follow(client: OpenAI, batch_id: str) -> Any:
    """Show a live progress bar (completed + failed of total) until the batch ends."""
    columns = (TextColumn("[bold]{task.fields[status]}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=False) as bar:
        task = bar.add_task("batch", total=None, status="validating")
        while True:
            batch = client.batches.retrieve(batch_id)
            counts = batch.request_counts
            done = (counts.completed + counts.failed) if counts else 0
            total = counts.total if counts and counts.total else None
            bar.update(task, completed=done, total=total, status=batch.status)
            if batch.status in TERMINAL:
                return batch
            time.sleep(POLL_S)


def _summary(batch: Any) -> str:
    counts = batch.request_counts
    text = f"batch {batch.id}: {batch.status}"
    if counts:
        text += f" ({counts.completed} completed, {counts.failed} failed of {counts.total})"
    return text


def submit(file: Path, *, base_url: str, api_key: str, output: Path | None, wait: bool) -> None:
    """Upload FILE, create a batch, follow it, and download its results."""
    with _api_errors(base_url, f"batch of {file}"):
        client = _client(base_url, api_key)
        with file.open("rb") as fh:
            uploaded = client.files.create(file=(file.name, fh), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id,
            endpoint=_endpoint_of(file),  # type: ignore[arg-type]
            completion_window="24h")
        err_console.print(f"created batch {batch.id} from {file} (file {uploaded.id})",
                          highlight=False)
        if not wait:
            print(batch.id)
            return
        batch = _follow(client, batch.id)
        err_console.print(_summary(batch), highlight=False)
        if batch.status == "failed" and batch.errors and batch.errors.data:
            for error in batch.errors.data:
                where = f" (line {error.line})" if error.line else ""
                err_console.print(f"  {error.code}: {error.message}{where}", highlight=False)
            raise SystemExit(1)
        target = output or file.with_name(file.stem + ".results.jsonl")
        _write_results(client, batch, target)


def status(batch_id: str, *, base_url: str, api_key: str) -> None:
    """Print a batch's status, request counts and file ids."""
    with _api_errors(base_url, f"batch {batch_id}"):
        batch = _client(base_url, api_key).batches.retrieve(batch_id)
        print(_summary(batch))
        for name in ("input_file_id", "output_file_id", "error_file_id"):
            value = getattr(batch, name, None)
            if value:
                print(f"  {name}: {value}")
        if batch.errors and batch.errors.data:
            for error in batch.errors.data:
                print(f"  error {error.code}: {error.message}")


def results(batch_id: str, *, base_url: str, api_key: str, output: Path | None) -> None:
    """Write a batch's output lines (then its error lines) to OUTPUT or stdout."""
    with _api_errors(base_url, f"batch {batch_id}"):
        client = _client(base_url, api_key)
        batch = client.batches.retrieve(batch_id)
        if not batch.output_file_id and not batch.error_file_id:
            raise BatchClientError(f"batch {batch_id} has no results yet (status "
                                   f"{batch.status}); `minimill batch status {batch_id}`")
        _write_results(client, batch, output)


def cancel(batch_id: str, *, base_url: str, api_key: str) -> None:
    """Cancel a batch; the control plane keeps results that already finished."""
    with _api_errors(base_url, f"batch {batch_id}"):
        batch = _client(base_url, api_key).batches.cancel(batch_id)
        print(_summary(batch))
