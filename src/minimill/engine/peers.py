"""Stage 0's peers: the pipeline stages (pipeline_runner.py) or expert-parallel ranks
(expert_parallel.py) after the first, started here as spawned processes or joined from other
hosts (stage_hosts.py), watched until one ends and stopped together."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from minimill.engine import stage_hosts
from minimill.engine.params import EngineError
from minimill.engine.stage_hosts import RemoteStages


def start_local(count: int, target: Callable[..., None],
                args_of: Callable[[int, Connection], tuple[Any, ...]], name: str, noun: str,
                timeout_s: float, stop_s: float
                ) -> tuple[list[Any], list[Connection], list[Any]]:
    """Spawn peers 1..count-1 (`target(*args_of(rank, their end of a pipe))`) and wait for
    each to say ready on its pipe: (processes, our pipe ends, each one's ready message
    after "ready"). EngineError naming the first that did not start, and why; whatever was
    started is stopped then."""
    context = multiprocessing.get_context("spawn")
    processes: list[Any] = []
    conns: list[Connection] = []
    try:
        for rank in range(1, count):
            ours, theirs = context.Pipe()
            process = context.Process(target=target, name=f"{name}-{rank}", daemon=True,
                                      args=args_of(rank, theirs))
            process.start()
            theirs.close()
            processes.append(process)
            conns.append(ours)
        messages = []
        for rank, (process, conn) in enumerate(zip(processes, conns, strict=True), 1):
            ready = wait([conn, process.sentinel], timeout_s)
            message = conn.recv() if conn in ready and conn.poll() else None
            if not message or message[0] != "ready":
                why = _why_not_ready(process, message, bool(ready), timeout_s, stop_s)
                raise EngineError(f"{noun} {rank} did not start: {why}")
            messages.append(message[1:])
    except BaseException:
        stop(processes, None, threading.Event(), stop_s)
        raise
    return processes, conns, messages


# Peer processes are joined one thread at a time. Joined at once (the watch, a failed step,
# the stop), one thread's waitpid took a killed peer's status while another's found no child
# and read no exit code ("exit code None", seen in CI), and a process could be seen alive
# after its death was reported.
_REAPING = threading.Lock()


def reap(process: Any, join_s: float) -> int | None:
    """Join a peer process (up to `join_s`) and return its exit code (None: still running)."""
    with _REAPING:
        process.join(join_s)
        return process.exitcode


def exit_with_parent(conn: Connection, name: str) -> None:
    """In a spawned peer: exit when stage 0's process is gone (its end of `conn` closes,
    however it ended), even while this process waits in a receive or loads."""

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            conn.recv()
        os._exit(1)

    threading.Thread(target=watch, name=name, daemon=True).start()


def _why_not_ready(process: Any, message: Any, woke: bool, timeout_s: float,
                   stop_s: float) -> str:
    if message:
        return str(message[1])
    if not woke:
        return f"it did not load within {timeout_s:.0f} s"
    code = reap(process, stop_s)  # ended: reaped for its exit code
    if code is not None and code < 0:
        return f"it was killed by signal {-code} while loading (out of memory?)"
    return f"it exited with status {code} while loading (its traceback is in this log)"


def watch(noun: str, processes: list[Any], remote: RemoteStages | None,
                stopped: threading.Event, wake: Any, closing: Callable[[], bool],
                die: Callable[[str], None], join_s: float) -> None:
    """Stage 0's watch over its peers (pipeline stages, expert-parallel ranks; `noun` names
    one): end the engine (`die`) with the first of `processes` to end unasked, or with the
    first peer on another host whose beat stops; return when `wake` is signalled or
    `stopped` set (the engine closing)."""
    if remote is not None:
        hosts = remote.hosts
        remote.watch(stopped, lambda rank: die(
            f"{noun} {rank} on {hosts[rank - 1]} has not been heard from for "
            f"{stage_hosts.SILENCE_S:.0f} s"))
        return
    sentinels = {p.sentinel: rank for rank, p in enumerate(processes, 1)}
    ready = wait([*sentinels, wake])
    if closing():
        return
    rank = next((sentinels[s] for s in ready if s in sentinels), None)
    if rank is not None:
        code = reap(processes[rank - 1], join_s)  # its exit code is read when it is reaped
        die(f"{noun} {rank} ended (exit code {code})")


def stop(processes: list[Any], remote: RemoteStages | None, stopped: threading.Event,
               join_s: float) -> None:
    """Stop stage 0's peers: kill its peer processes (and reap them), tell those on other
    hosts to leave, end the watch (`stopped`)."""
    stopped.set()
    if remote is not None:
        remote.stop()
    with _REAPING:
        for process in processes:
            if process.is_alive():
                process.kill()
    for process in processes:
        reap(process, join_s)
