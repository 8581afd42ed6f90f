"""Processes die with their parent: the two halves of minimill's process ownership.

A command that starts minimill processes (`serve` and its local worker, the benchmarks' local
fleets, the tests' helpers) owns them: it names itself in the child's environment
(`owned_env`), starts it in a process group of its own (so that a stop reaches everything the
child started) and stops the group when it ends. The child (`die_with_parent`, called first
thing by `serve` and `worker`) makes sure it never outlives that parent, however the parent
ends, SIGKILL included:

- on Linux, `prctl(PR_SET_PDEATHSIG, SIGHUP)`: the kernel signals the child the moment the
  *thread* that started it exits. So it is asked for only by a child its parent started from
  the main thread (`owned_env` says so): a helper thread that ends would set it off early;
- everywhere, a watchdog thread that checks every half second whether the parent pid is still
  its parent (a reparented child sees another ppid), whichever thread started it;
- either way the child gets SIGHUP ("the process I answer to is gone", as a terminal's hangup
  says), which `serve` and `worker` handle as a graceful stop (STOP_SIGNALS), and the watchdog
  ends it for good (`os._exit`) if it is still there `ORPHAN_GRACE_S` later.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping

log = logging.getLogger("minimill.lifetime")

PARENT_PID_ENV = "MINIMILL_PARENT_PID"
# "1": the parent started this child from its main thread, so the kernel's signal is safe.
DEATH_SIGNAL_ENV = "MINIMILL_PARENT_DEATH_SIGNAL"
PARENT_DEATH_SIGNAL = signal.SIGHUP
# Signals that stop minimill's long-running processes gracefully.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, PARENT_DEATH_SIGNAL)
WATCH_INTERVAL_S = 0.5
# An orphan gets this long to stop gracefully (checkpoint, hand back its leases).
ORPHAN_GRACE_S = 30.0
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def owned_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child this process owns: it names this process as its parent.
    Call it in the thread that starts the child."""
    main = threading.current_thread() is threading.main_thread()
    return {**(os.environ if env is None else env), PARENT_PID_ENV: str(os.getpid()),
            DEATH_SIGNAL_ENV: "1" if main else "0"}


def stop_reason(signum: int) -> str:
    """How a stop signal reads in a log line."""
    if signum == PARENT_DEATH_SIGNAL:
        return "parent process gone (SIGHUP)"
    return signal.Signals(signum).name


def set_parent_death_signal(sig: int = PARENT_DEATH_SIGNAL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _orphaned(parent: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(os.getpid(), PARENT_DEATH_SIGNAL)
    time.sleep(ORPHAN_GRACE_S)
    log.error("still running %.0f s after parent process %d died; exiting now",
              ORPHAN_GRACE_S, parent)
    os._exit(1)


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL_S)
    _orphaned(parent)


def die_with_parent() -> int | None:
    """Tie this process's life to the parent named in MINIMILL_PARENT_PID; returns its pid.

    Without the variable this does nothing (a process started by hand lives on its own). The
    variable is removed from this process's environment, so that a process it starts is not
    taken for its parent's child. A parent that is already gone means SIGHUP at once. Install
    handlers for STOP_SIGNALS first.
    """
    value = os.environ.pop(PARENT_PID_ENV, None)
    kernel_signal = os.environ.pop(DEATH_SIGNAL_ENV, "0") == "1"
    if not value:
        return None
    try:
        parent = int(value)
    except ValueError:
        log.warning("ignoring %s=%r: not a pid", PARENT_PID_ENV, value)
        return None
    if kernel_signal:
        set_parent_death_signal()
    # Started after prctl and checking at once: a parent that died before it never signals.
    threading.Thread(target=_watch, args=(parent,), name="minimill-parent-watch",
                     daemon=True).start()
    return parent


def exit_on_sigterm() -> None:
    """Make SIGTERM (and SIGHUP, the parent's death) end this process as SystemExit does, so
    that its `finally` blocks stop the processes it owns (Python's default is to die on the
    spot). Call from the main thread."""

    def handler(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(PARENT_DEATH_SIGNAL, handler)
