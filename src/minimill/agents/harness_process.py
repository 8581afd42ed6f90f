"""A harness run in a process of its own, sandboxed: the runner's side of harness_child.py.

A harness is a tenant's code. The runner that runs it holds the site token and the leases of
other tenants' agents, so the harness never runs in the runner's process: it runs in a
bubblewrap sandbox (boxes/sandbox.py) that sees a read-only system, the Python interpreter and
the `minimill` package, a private /tmp, and nothing else of the host: no network, no store, no
environment. A seccomp filter (boxes/seccomp.py) forbids it to start processes (its commands
belong in its box), and its address space is limited. Where bubblewrap is unavailable the
operator may opt out (`--insecure-no-sandbox`): the harness then runs in a plain child
process with an empty environment.

The harness asks for effects over its stdout and this side performs them with the lease's
key (`api_effects.ApiEffects`), journaling each with the lease's epoch; its results go back
over its stdin.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import minimill
from minimill.agents.runtime import EffectFailed
from minimill.boxes import sandbox
from minimill.boxes.seccomp import no_fork_filter

log = logging.getLogger("minimill.agents")
# Where the sandbox sees the `minimill` package.
PACKAGE_MOUNT = "/opt/minimill"
# A harness process's address space: the interpreter, its journal and whatever it keeps.
HARNESS_MEMORY_MB = int(os.environ.get("MINIMILL_HARNESS_MEMORY_MB", "2048"))
# The longest message a harness may send (an effect's arguments, its result).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
STDERR_TAIL_LINES = 20
OUTCOMES = ("succeeded", "sleeping", "failed")
BOX_CALLS = ("exec", "write", "read")


class Performer(Protocol):
    """What performs a harness's effects (api_effects.ApiEffects)."""

    async def chat(self, body: dict[str, Any], key: str) -> dict[str, Any]: ...

    async def box_create(self) -> str: ...

    async def box_call(self, box_id: str, op: str, args: dict[str, Any], key: str) -> Any: ...

    async def journal(self, key: str, kind: str, value: Any, replayed: int) -> None: ...


@dataclass(frozen=True, slots=True)
class HarnessStart:
    """What a harness process starts with."""

    code: str
    filename: str
    task: Any
    model: str
    budget_tokens: int | None
    journal: list[tuple[str, str, Any]]  # key, kind, value


def _boot(package_parent: str) -> str:
    return (f"import sys; sys.path.insert(0, {package_parent!r}); "
            "from minimill.agents.harness_child import main; main()")


def _interpreter() -> Path:
    """The real interpreter (a venv's python is a link to it); the venv's packages are not
    what a harness may import."""
    return Path(os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable))


def harness_argv(insecure: bool, seccomp_fd: int | None) -> list[str]:
    """The command that runs a harness process."""
    package = Path(minimill.__file__).resolve().parent
    python = str(_interpreter())
    if insecure:
        return [python, "-I", "-B", "-c", _boot(str(package.parent))]
    binds = ["--ro-bind", str(package), f"{PACKAGE_MOUNT}/minimill"]
    prefix = Path(os.path.realpath(sys.base_prefix))
    if not prefix.is_relative_to("/usr"):
        binds += ["--ro-bind", str(prefix), str(prefix)]
    if seccomp_fd is not None:
        binds += ["--seccomp", str(seccomp_fd)]
    bwrap = sandbox.bwrap_args(None, network=False, extra=binds)
    env = ["--setenv", "PATH", sandbox.DEFAULT_PATH, "--setenv", "HOME", "/tmp",
           "--setenv", "LANG", "C.UTF-8"]
    memory = HARNESS_MEMORY_MB * 1024 * 1024
    return ["prlimit", f"--as={memory}", "--core=0", "--", *bwrap[:-1], *env, "--",
            python, "-I", "-B", "-c", _boot(PACKAGE_MOUNT)]


def check_harness_isolation() -> None:
    """Raise IsolationUnavailable unless a harness process can start in its sandbox here:
    bubblewrap works and the interpreter and the package are where the sandbox mounts them."""
    if sandbox.bwrap_path() is None:
        raise sandbox.IsolationUnavailable(
            "bubblewrap (bwrap) is not installed: install the Debian package 'bubblewrap', or "
            "pass --insecure-no-sandbox to run harnesses without isolation")
    probe = "import minimill.agents.harness_child; print('ok')"
    argv = harness_argv(insecure=False, seccomp_fd=None)
    argv[-1] = f"import sys; sys.path.insert(0, {PACKAGE_MOUNT!r}); {probe}"
    try:
        result = subprocess.run(argv, capture_output=True, timeout=60, cwd="/",
                                env={"PATH": sandbox.DEFAULT_PATH})
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise sandbox.IsolationUnavailable(f"a sandboxed harness cannot start ({exc})") from exc
    if result.returncode != 0 or result.stdout.strip() != b"ok":
        detail = result.stderr.decode(errors="replace").strip()[-300:]
        raise sandbox.IsolationUnavailable(
            f"a sandboxed harness cannot start here ({detail or result.returncode}); or pass "
            "--insecure-no-sandbox to run harnesses without isolation")


class HarnessProcess:
    """One run of a harness in its own process."""

    def __init__(self, agent_id: str, start: HarnessStart, performer: Performer,
                 insecure: bool) -> None:
        self.agent_id = agent_id
        self._start = start
        self._performer = performer
        self._insecure = insecure
        self._proc: asyncio.subprocess.Process | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self._done: dict[str, Any] | None = None
        self._lost: BaseException | None = None
        self._ended = asyncio.Event()
        self._stderr_reader: asyncio.Future[None] | None = None
        self.handing_back = False
        self.quiet = False  # handed back, and nothing of it in flight
        self.replayed = 0  # effects answered from the journal and not yet reported

    async def start(self) -> None:
        seccomp = None if self._insecure else no_fork_filter()
        read_fd = write_fd = None
        if seccomp is not None:
            read_fd, write_fd = os.pipe()
            os.write(write_fd, seccomp)  # a few hundred bytes: never fills the pipe
            os.close(write_fd)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *harness_argv(self._insecure, read_fd),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env={"PATH": sandbox.DEFAULT_PATH},
                cwd="/", start_new_session=True, limit=MAX_MESSAGE_BYTES,
                pass_fds=() if read_fd is None else (read_fd,))
        finally:
            if read_fd is not None:
                os.close(read_fd)
        start = self._start
        self._send({"code": start.code, "filename": start.filename, "task": start.task,
                    "model": start.model, "budget_tokens": start.budget_tokens,
                    "journal": start.journal})
        if self.handing_back:
            self._send({"op": "hand_back"})
        self._stderr_reader = asyncio.ensure_future(self._read_stderr())
        self._tasks.add(self._stderr_reader)
        self._spawn(self._read_messages())

    def hand_back(self) -> None:
        """Ask the harness to start no new effect; `quiet` turns true once the effects in
        flight are journaled."""
        if self.handing_back:
            return
        self.handing_back = True
        if self._proc is not None:
            self._send({"op": "hand_back"})

    async def wait(self) -> dict[str, Any]:
        """The harness's outcome: {"outcome", "result" | "wake_at" | "message", "performed"}.
        Raises what lost the lease (runner.LeaseLost) if that ended the run."""
        await self._ended.wait()
        if self._lost is not None:
            raise self._lost
        assert self._done is not None
        return self._done

    async def close(self) -> None:
        """Kill the process (if it still runs) and stop serving it."""
        await self.close_process()
        if self._proc is not None:
            await self._proc.wait()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _send(self, message: dict[str, Any]) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdin.is_closing():
            return
        proc.stdin.write((json.dumps(message) + "\n").encode())

    def _end(self, done: dict[str, Any] | None = None, lost: BaseException | None = None) -> None:
        if self._ended.is_set():
            return
        self._done, self._lost = done, lost
        self._ended.set()

    def _failed(self, why: str) -> None:
        tail = "\n".join(self._stderr_tail)
        self._end({"outcome": "failed", "message": why + (f"\n{tail}" if tail else ""),
                   "performed": 0})

    async def _read_stderr(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        while line := await self._proc.stderr.readline():
            text = line.decode(errors="replace").rstrip()[:2000]
            self._stderr_tail.append(text)
            log.info("agent %s: %s", self.agent_id, text)

    async def _read_messages(self) -> None:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        try:
            while line := await proc.stdout.readline():
                message = json.loads(line)
                if not isinstance(message, dict):
                    raise ValueError("not an object")
                self._on_message(message)
                if self._ended.is_set():
                    return
        except (ValueError, asyncio.LimitOverrunError) as exc:
            await self.close_process()
            self._failed(f"the harness process sent a bad message ({exc})")
            return
        code = await proc.wait()
        if self._stderr_reader is not None:  # its last lines say why
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._stderr_reader), 2.0)
        self._failed(f"the harness process ended with exit code {code} and no outcome")

    async def close_process(self) -> None:
        """Kill the process and everything in its session (a sandbox's whole tree)."""
        proc = self._proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    def _on_message(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "quiet":
            self.replayed = _count(message.get("replayed"))
            self.quiet = True
        elif op == "done":
            self.replayed = _count(message.get("replayed"))
            outcome = message.get("outcome")
            if outcome not in OUTCOMES:
                raise ValueError(f"unknown outcome {outcome!r}")
            wake_at = message.get("wake_at")
            if outcome == "sleeping" and not isinstance(wake_at, (int, float)):
                raise ValueError(f"a wake time that is no number: {wake_at!r}")
            self._end({**message, "performed": _count(message.get("performed"))})
        elif "id" in message:
            self._spawn(self._perform(message))
        else:
            raise ValueError(f"unknown message {op!r}")

    async def _perform(self, message: dict[str, Any]) -> None:
        answer: dict[str, Any] = {"id": message["id"]}
        try:
            answer["value"] = await self._effect(message)
        except EffectFailed as exc:
            answer["error"] = {"type": "EffectFailed", "message": str(exc)}
        except (ValueError, TypeError, KeyError) as exc:
            answer["error"] = {"type": "EffectFailed", "message": f"bad request: {exc}"}
        except Exception as exc:  # the lease is lost (or the effects failed for good)
            self._end(lost=exc)
            return
        self._send(answer)

    async def _effect(self, message: dict[str, Any]) -> Any:
        op = message.get("op")
        performer = self._performer
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "chat": lambda: performer.chat(_dict(message["body"]), _str(message["key"])),
            "box_create": performer.box_create,
            "box_call": lambda: performer.box_call(
                _str(message["box_id"]), _box_call(message["call"]), _dict(message["args"]),
                _str(message["key"])),
            "journal": lambda: performer.journal(
                _str(message["key"]), _str(message["kind"]), message.get("value"),
                _count(message.get("replayed"))),
        }
        call = calls.get(str(op))
        if call is None:
            raise ValueError(f"unknown effect {op!r}")
        return await call()


def _dict(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError("expected an object")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("expected a string")
    return value


def _count(value: Any) -> int:
    return value if isinstance(value, int) and 0 <= value < 2**31 else 0


def _box_call(value: Any) -> str:
    if value not in BOX_CALLS:
        raise ValueError(f"unknown box call {value!r}")
    return str(value)
