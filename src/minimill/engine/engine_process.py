"""`ProcessEngine`: the builtin engine's step loop in a child process.

A server or worker runs Python of its own (HTTP, checkpoints, JSON) beside the engine. In one
process that Python holds the GIL while the step loop wants it back after every kernel call,
and each hand-over can wait a whole switch interval; in a child process the step loop has an
interpreter to itself. Commands (add, abort, close) go down a pipe; each step's deltas come
back up it in one message, read by a thread that hands them to the callers' event loops.

The child dies with its parent (a parent-death signal, and a check of the parent's pid while
idle), and the parent fails every open stream if the child dies.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import defaultdict
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

# Only torch-free modules at the top: the parent never imports torch (the child does).
from minimill.engine.frontend import AddRequest, EngineLimits, Outcome, StreamFrontend
from minimill.engine.params import EngineDied, EngineError, InvalidRequestError

if TYPE_CHECKING:
    from minimill.engine.core import EngineCore

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.5
_START_TIMEOUT_S = 600.0


class ProcessEngine(StreamFrontend):
    """The builtin engine for servers and workers, its step loop in a child process."""

    def __init__(self, model: str, **config_overrides: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_child_main, args=(child_conn, model, config_overrides, os.getpid()),
            # A daemonic process may not start processes, and an engine with pipeline stages
            # starts one per stage; it dies with this process all the same (_child_main).
            name="minimill-engine",
            daemon=(int(config_overrides.get("pipeline_stages", 1)) <= 1
                    and int(config_overrides.get("expert_parallel", 1)) <= 1
                    and config_overrides.get("max_memory_gb") is None))
        self._process.start()
        child_conn.close()
        if not self._conn.poll(_START_TIMEOUT_S):
            self._process.kill()
            raise EngineError(f"the engine process did not start within {_START_TIMEOUT_S} s")
        try:
            message = self._conn.recv()
        except EOFError:
            self._process.join(5)
            raise EngineError(f"the engine process exited while starting (exit code "
                              f"{self._process.exitcode})") from None
        if message[0] == "error":
            self._process.join(5)
            raise _rebuild(message[1], message[2])
        _, tokenizer, limits, phases = message
        assert isinstance(limits, EngineLimits)
        # The child's start after its interpreter and the spawn, phase by phase.
        self.start_phases: list[tuple[str, float]] = list(phases)
        self._death_reason = ""  # what the child said of its end, if it could
        super().__init__(tokenizer, limits)
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="minimill-engine-reader",
                                        daemon=True)
        self._reader.start()

    def _submit(self, command: AddRequest | str) -> None:
        try:
            with self._send_lock:
                self._conn.send(command)
        except (OSError, ValueError):
            raise EngineError("the engine process is gone") from None

    def close(self) -> None:
        """Stop the child; unfinished requests' streams raise EngineError."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError, ValueError), self._send_lock:
            self._conn.send(None)
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._reader.join(5)
        self.fail_streams(EngineError("the engine was closed"))

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "died":  # the step loop's last word: why it stops
                self._death_reason = str(message[1])
                continue
            out, self._tok_s, self.step_counts = message
            self.deliver({request_id: [_rebuild(*item) if isinstance(item, tuple) else item
                                       for item in items]
                          for request_id, items in out.items()})
        if not self._closed:
            self._process.join(5)  # reaped, so that its exit code is known
            reason = f"the engine process died (exit code {self._process.exitcode})"
            if self._death_reason:
                reason += f": {self._death_reason}"
            log.error("%s", reason)
            self.died(reason)


def _portable(item: Outcome) -> Any:
    """Deltas cross the pipe as they are; exceptions as (kind, message)."""
    if isinstance(item, BaseException):
        return ("invalid" if isinstance(item, InvalidRequestError) else "engine", str(item))
    return item


def _rebuild(kind: str, message: str) -> BaseException:
    return InvalidRequestError(message) if kind == "invalid" else EngineError(message)


def _die_with_parent(parent_pid: int) -> None:
    if not hasattr(os, "getppid"):
        return
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


def _child_main(conn: Connection, model: str, overrides: dict[str, Any],
                parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    # The parent decides when to stop (a signal to the whole group must not cut streams its
    # handback still needs); it dies with the parent all the same.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # What a long first start does (dequantizing, building kernels) shows in the worker's
    # log: the child logs to the same stderr, as the worker does.
    logging.basicConfig(level=os.environ.get("MINIMILL_LOG_LEVEL", "INFO"),
                        format="%(asctime)s engine %(levelname)s %(message)s", stream=sys.stderr)
    # Where this start went, for the worker's start line (a restart is time a site does no
    # work); the rest of the child's start is the interpreter and the spawn's own imports.
    phases: list[tuple[str, float]] = []
    last = time.monotonic()

    def mark(phase: str) -> None:
        nonlocal last
        now = time.monotonic()
        phases.append((phase, now - last))
        last = now

    from minimill.engine.core import EngineCore
    from minimill.engine.loading import load_with_config

    mark("engine imports")
    try:
        loaded, config = load_with_config(model, overrides)
        mark("model load")
        core = EngineCore(loaded, config)
        mark("engine")
    except Exception as exc:
        conn.send(("error", *_portable(exc)))
        return
    conn.send(("ready", loaded.tokenizer, core.limits, phases))
    _yield_to_siblings()
    try:
        _step_loop(conn, core, parent_pid)
    finally:
        core.close()  # the KV tiers keep what the pool holds, for the next start


def _yield_to_siblings() -> None:
    """Once started, the step loop runs below the default priority (MINIMILL_ENGINE_NICE,
    default 5): on a machine it shares, a process that is starting (a restarted worker
    loading its engine) or that keeps leases alive (its own worker's heartbeats and
    checkpoints, a local control plane) gets the CPU first. Alone, the engine gets every
    cycle all the same: niceness only orders runnable threads."""
    with contextlib.suppress(ValueError, OSError, AttributeError):
        increment = int(os.environ.get("MINIMILL_ENGINE_NICE", "5"))
        if increment > 0:
            os.nice(increment)


def _step_loop(conn: Connection, core: EngineCore, parent_pid: int) -> None:
    from minimill.engine.step_loop import apply_command, step_into

    while True:
        out: dict[str, list[Outcome]] = defaultdict(list)
        # Idle: wait for work; running: take whatever commands arrived, then step.
        if not core.has_unfinished and not conn.poll(_IDLE_POLL_S):
            if os.getppid() != parent_pid:
                return
            continue
        while conn.poll():
            try:
                command = conn.recv()
            except EOFError:
                return
            if command is None:
                return
            apply_command(core, command, out)
        if core.has_unfinished:
            try:
                step_into(core, out)
            except EngineDied as exc:
                # Said before the exit, so that the parent's log names the cause.
                with contextlib.suppress(OSError, ValueError):
                    conn.send(("died", str(exc)))
                raise
        if out:
            conn.send(({request_id: [_portable(i) for i in items]
                        for request_id, items in out.items()}, core.recent_output_tok_s(),
                       (core.num_steps, core.num_step_seqs)))
