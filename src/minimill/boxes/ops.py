"""What a box host does for each operation (box_protocol.OpKind), on a box's workspace.

Blocking functions, run in a thread per operation. Each returns the result dict the control
plane hands to the tenant, or raises OpError with the code the tenant sees.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minimill.boxes import sandbox, workspace
from minimill.boxes.layers import network_problem
from minimill.transport.box_protocol import BoxLimits

MAX_READ_BYTES = 16 * 1024 * 1024
# The quota check walks the workspace: not more often than this while an exec runs.
QUOTA_CHECK_EVERY_S = 0.5


class OpError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Workspace:
    """A box's workspace on this host and what an exec there may use."""

    path: Path
    limits: BoxLimits
    network: bool
    insecure: bool
    # The host uid its files and processes belong to (None: the host's own, not root).
    owner: int | None = None
    cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def quota_bytes(self) -> int:
        return self.limits.disk_mb * 1024 * 1024

    def over_quota_checker(self, used_at_start: int) -> Callable[[], bool]:
        """True once the workspace holds more than its quota and more than when the exec
        started (an exec that frees space in a full box is not stopped)."""
        ceiling = max(self.quota_bytes, used_at_start)
        last = [time.monotonic(), 0.0]

        def over() -> bool:
            now = time.monotonic()
            if now - last[0] >= QUOTA_CHECK_EVERY_S:
                last[0] = now
                last[1] = float(workspace.usage_bytes(self.path) > ceiling)
            return bool(last[1])

        return over


def run_exec(ws: Workspace, args: dict[str, Any],
             on_output: sandbox.OnOutput | None = None) -> dict[str, Any]:
    command = [str(a) for a in args.get("command") or []]
    if not command:
        raise OpError("invalid_command", "command must not be empty")
    env = {str(k): str(v) for k, v in (args.get("env") or {}).items()}
    problem = network_problem() if ws.network and not ws.insecure else None
    if problem is not None:
        raise OpError("network_unavailable", f"this box has network, and its host cannot "
                      f"give it: {problem}")
    limits = sandbox.Limits(cpu_s=ws.limits.cpu_s, memory_mb=ws.limits.memory_mb,
                            max_processes=ws.limits.max_processes, disk_mb=ws.limits.disk_mb,
                            timeout_s=float(args.get("timeout_s") or ws.limits.timeout_s))
    used = workspace.usage_bytes(ws.path)
    result = sandbox.run_exec(ws.path, command, stdin=str(args.get("stdin") or "").encode(),
                              env=env, limits=limits, network=ws.network, insecure=ws.insecure,
                              disk_free_bytes=ws.quota_bytes - used,
                              over_quota=ws.over_quota_checker(used),
                              cancel=ws.cancel, on_output=on_output, uid=ws.owner)
    if result.error == "cancelled":
        raise OpError("box_host_lost", "the box's host stopped it while this ran")
    error = result.error
    if error is None and workspace.usage_bytes(ws.path) > max(ws.quota_bytes, used):
        error = "disk_quota_exceeded"  # it grew past the quota between two checks
    return {"exit_code": result.exit_code, "stdout": result.stdout.decode(errors="replace"),
            "stderr": result.stderr.decode(errors="replace"),
            "duration_s": round(result.duration_s, 3), "timed_out": result.timed_out,
            "error": error, "output_truncated": result.output_truncated}


def write(ws: Workspace, args: dict[str, Any]) -> dict[str, Any]:
    data = base64.b64decode(str(args.get("content_b64") or ""))
    used = workspace.usage_bytes(ws.path)
    if used + len(data) > ws.quota_bytes:
        raise OpError("disk_quota_exceeded",
                      f"writing {len(data)} bytes would exceed the box's disk quota of "
                      f"{ws.limits.disk_mb} MiB ({used} bytes used)")
    size = workspace.write_file(ws.path, str(args.get("path") or ""), data, owner=ws.owner)
    return {"bytes": size}


def read(ws: Workspace, args: dict[str, Any]) -> dict[str, Any]:
    data = workspace.read_file(ws.path, str(args.get("path") or ""), MAX_READ_BYTES)
    return {"content_b64": base64.b64encode(data).decode()}


def listing(ws: Workspace, args: dict[str, Any]) -> dict[str, Any]:
    entries = workspace.list_dir(ws.path, str(args.get("path") or "."))
    return {"entries": [{"name": e.name, "type": e.kind, "bytes": e.bytes} for e in entries]}


# Operations that may change the workspace (the next automatic snapshot is due after them).
MUTATING = frozenset({"exec", "write"})
HANDLERS = {"exec": run_exec, "write": write, "read": read, "list": listing}


def run_op(ws: Workspace, kind: str, args: dict[str, Any],
           on_output: sandbox.OnOutput | None = None) -> dict[str, Any]:
    """Run one operation; an exec's output also goes to `on_output` as it comes."""
    handler = HANDLERS.get(kind)
    if handler is None:
        raise OpError("unknown_operation", f"unknown box operation {kind!r}")
    try:
        if kind == "exec":
            return run_exec(ws, args, on_output)
        return handler(ws, args)
    except workspace.PathError as exc:
        raise OpError(exc.code, str(exc)) from None
