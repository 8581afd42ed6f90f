"""The Python SDK for boxes: `Boxes(base_url, api_key)` over `/v1/boxes`.

    from minimill.boxes.client import Boxes
    boxes = Boxes("http://127.0.0.1:8000/v1", api_key)
    box = boxes.create(image="./project")        # a directory, a .tar/.tar.gz, or nothing
    box.write("hello.py", "print('hi')")
    print(box.exec("python3 hello.py").stdout)   # hi
    for event in box.exec_stream("make test"):   # output as it comes
        print(event.type, event.data or event.result)
    snap = box.snapshot()
    twin = boxes.create(snapshot=snap)           # a new box with the same files

Errors are raised as `BoxError` carrying the OpenAI-style error object's message, code and
HTTP status. An exec that ran is never an error: look at `exit_code`, `timed_out`, `error`.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from minimill import client_env

DEFAULT_TIMEOUT_S = 600.0


class BoxError(RuntimeError):
    def __init__(self, status: int, message: str, code: str | None,
                 request_id: str | None = None) -> None:
        super().__init__(f"{message} (HTTP {status}, {code})")
        self.status = status
        self.message = message
        self.code = code
        self.request_id = request_id  # the answer's x-request-id: name it when reporting


@dataclass(frozen=True, slots=True)
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool
    error: str | None
    output_truncated: bool

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.error is None


@dataclass(frozen=True, slots=True)
class ExecEvent:
    """One event of a streamed exec (`Box.exec_stream`)."""

    type: str  # "stdout" | "stderr" | "exit" | "restart" (run again from the start)
    data: str = ""  # output, for stdout and stderr
    # The position after this event: to resume a lost stream, call exec_stream again with the
    # same idempotency_key and this as last_event_id.
    id: str | None = None
    # On exit: the whole result, its output put together from this call's events.
    result: ExecResult | None = None


def _error(status: int, body: bytes, request_id: str | None = None) -> BoxError:
    try:
        error = json.loads(body)["error"]
        return BoxError(status, str(error.get("message")), error.get("code"), request_id)
    except (ValueError, KeyError, TypeError, AttributeError):
        return BoxError(status, body[:500].decode(errors="replace"), None, request_id)


def _archive(image: str | os.PathLike[str]) -> bytes:
    """A directory becomes a gzipped tar of its contents; an archive file is sent as it is."""
    path = Path(image)
    if path.is_file():
        return path.read_bytes()
    if not path.is_dir():
        raise FileNotFoundError(f"image {path} is neither a directory nor an archive")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for child in sorted(path.iterdir()):
            tar.add(child, arcname=child.name)
    return buf.getvalue()


class Boxes:
    def __init__(self, base_url: str | None = None, api_key: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        base_url = base_url or client_env.base_url()
        api_key = api_key or client_env.api_key()
        self._http = httpx.Client(base_url=base_url.rstrip("/"),
                                  headers={"Authorization": f"Bearer {api_key}"},
                                  timeout=httpx.Timeout(timeout_s))

    def request(self, method: str, path: str, prefix: str = "/boxes",
                **kwargs: Any) -> httpx.Response:
        resp = self._http.request(method, prefix + path, **kwargs)
        if resp.status_code >= 400:
            raise _error(resp.status_code, resp.content, resp.headers.get("x-request-id"))
        return resp

    def events(self, method: str, path: str, prefix: str = "/boxes",
               **kwargs: Any) -> Iterator[tuple[str | None, dict[str, Any]]]:
        """(id, JSON payload) of each server-sent event of the answer, until [DONE]."""
        with self._http.stream(method, prefix + path, **kwargs) as resp:
            if resp.status_code >= 400:
                raise _error(resp.status_code, resp.read(), resp.headers.get("x-request-id"))
            event_id: str | None = None
            data: list[str] = []
            for line in resp.iter_lines():
                if line.startswith("id:"):
                    event_id = line[3:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
                elif not line and data:
                    payload = "\n".join(data)
                    if payload == "[DONE]":
                        return
                    yield event_id, json.loads(payload)
                    event_id, data = None, []

    def upload_image(self, image: str | os.PathLike[str]) -> str:
        """Upload a directory or archive; returns the image id to create boxes from."""
        resp = self.request("POST", "/images", content=_archive(image),
                            headers={"Content-Type": "application/octet-stream"})
        return str(resp.json()["id"])

    def create(self, image: str | os.PathLike[str] | None = None, *,
               image_id: str | None = None, snapshot: str | None = None,
               network: bool = False,
               limits: dict[str, Any] | None = None,
               metadata: dict[str, str] | None = None,
               idle_timeout_s: float | Literal["default"] | None = "default",
               idle_action: Literal["pause"] = "pause") -> Box:
        """A new box: from a directory or archive (`image`), an uploaded image (`image_id`),
        a snapshot (restore), or empty.

        `idle_timeout_s`: after that many seconds without an operation the box is paused
        (snapshotted, off its host) and its next exec or file operation resumes it, same id,
        same files; None: never; "default": the server's default."""
        if image is not None:
            image_id = self.upload_image(image)
        body: dict[str, Any] = {"image": image_id, "snapshot": snapshot, "network": network,
                                "metadata": metadata, "idle_action": idle_action}
        if limits:
            body["limits"] = limits
        if idle_timeout_s != "default":
            body["idle_timeout_s"] = idle_timeout_s
        return Box(self, self.request("POST", "", json=body).json())

    def get(self, box_id: str) -> Box:
        return Box(self, self.request("GET", f"/{box_id}").json())

    def list(self) -> list[Box]:
        return [Box(self, b) for b in self.request("GET", "").json()["data"]]

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Boxes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Box:
    def __init__(self, boxes: Boxes, data: dict[str, Any]) -> None:
        self._boxes = boxes
        self.data = data

    @property
    def id(self) -> str:
        return str(self.data["id"])

    @property
    def status(self) -> str:
        return str(self.data["status"])

    @property
    def pause_reason(self) -> str | None:
        """For a paused box: "idle" (its next operation resumes it) or "request"."""
        reason = self.data.get("pause_reason")
        return str(reason) if reason is not None else None

    def refresh(self) -> Box:
        self.data = self._boxes.request("GET", f"/{self.id}").json()
        return self

    def exec(self, command: str | list[str], *, stdin: str = "",
             env: dict[str, str] | None = None, timeout_s: float | None = None) -> ExecResult:
        """Run `command` (argv, or a string for /bin/sh -c) and wait for it."""
        body = {"command": command, "stdin": stdin, "env": env or {}, "timeout_s": timeout_s}
        data = self._boxes.request("POST", f"/{self.id}/exec", json=body).json()
        return ExecResult(exit_code=data["exit_code"], stdout=data["stdout"],
                          stderr=data["stderr"], duration_s=data["duration_s"],
                          timed_out=data["timed_out"], error=data.get("error"),
                          output_truncated=data.get("output_truncated", False))

    def exec_stream(self, command: str | list[str], *, stdin: str = "",
                    env: dict[str, str] | None = None, timeout_s: float | None = None,
                    idempotency_key: str | None = None,
                    last_event_id: str | None = None) -> Iterator[ExecEvent]:
        """Run `command` as `exec` does, yielding its stdout and stderr as they come, then an
        "exit" event carrying the whole ExecResult. An exec that could not run or end (its
        host was lost, the box was deleted) raises BoxError, as `exec` does.

        A stream that broke can be resumed: call again with the same `idempotency_key` and the
        last event's `id` as `last_event_id`; what follows comes, each piece once (the exit's
        result then holds the output of the resumed call only)."""
        body = {"command": command, "stdin": stdin, "env": env or {}, "timeout_s": timeout_s,
                "stream": True}
        headers = {"Accept": "text/event-stream"}
        if idempotency_key is not None:
            headers["Idempotency-Key"] = idempotency_key
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        output: dict[str, list[str]] = {"stdout": [], "stderr": []}
        for event_id, event in self._boxes.events("POST", f"/{self.id}/exec", json=body,
                                                  headers=headers):
            kind = str(event.get("type"))
            if kind in output:
                text = str(event.get("data") or "")
                output[kind].append(text)
                yield ExecEvent(type=kind, data=text, id=event_id)
            elif kind == "restart":
                output = {"stdout": [], "stderr": []}
                yield ExecEvent(type=kind)
            elif kind == "exit":
                yield ExecEvent(type=kind, id=event_id, result=ExecResult(
                    exit_code=event["exit_code"], stdout="".join(output["stdout"]),
                    stderr="".join(output["stderr"]), duration_s=event["duration_s"],
                    timed_out=event["timed_out"], error=event.get("error"),
                    output_truncated=event.get("output_truncated", False)))
                return
            elif kind == "error":
                error = event.get("error") or {}
                raise BoxError(int(event.get("status") or 500),
                               str(error.get("message")), error.get("code"))
        raise BoxError(502, "the stream ended before the exec did", "stream_incomplete")

    def write(self, path: str, content: str | bytes) -> int:
        data = content.encode() if isinstance(content, str) else content
        resp = self._boxes.request("PUT", f"/{self.id}/files", params={"path": path},
                                   content=data,
                                   headers={"Content-Type": "application/octet-stream"})
        return int(resp.json()["bytes"])

    def read(self, path: str) -> bytes:
        return self._boxes.request("GET", f"/{self.id}/files/content",
                                   params={"path": path}).content

    def read_text(self, path: str) -> str:
        return self.read(path).decode()

    def list_files(self, path: str = ".") -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = self._boxes.request(
            "GET", f"/{self.id}/files", params={"path": path}).json()["data"]
        return entries

    def snapshot(self) -> str:
        """Archive the workspace now; returns the snapshot id (restore: Boxes.create(snapshot=))."""
        return str(self._boxes.request("POST", f"/{self.id}/snapshots").json()["id"])

    def snapshots(self) -> list[dict[str, Any]]:
        data: list[dict[str, Any]] = self._boxes.request(
            "GET", f"/{self.id}/snapshots").json()["data"]
        return data

    def pause(self) -> Box:
        self.data = self._boxes.request("POST", f"/{self.id}/pause").json()
        return self

    def resume(self) -> Box:
        self.data = self._boxes.request("POST", f"/{self.id}/resume").json()
        return self

    def delete(self) -> None:
        self._boxes.request("DELETE", f"/{self.id}")
