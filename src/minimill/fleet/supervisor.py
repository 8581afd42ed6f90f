"""The local worker of `minimill serve`: an ordinary `minimill worker` process that this
process owns (lifetime.py), restarts with backoff when it dies unasked, and stops on exit.

It stays in serve's process group, so that whatever stops the group (a terminal's Ctrl-C, a
power-cut test's kill -9) stops both; and it dies with serve however serve ends.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time

from minimill.fleet.kv_options import KvOptions
from minimill.lifetime import owned_env

log = logging.getLogger("minimill.serve")
LOCAL_SITE = "local"
WORKER_STOP_GRACE_S = 25.0  # SIGTERM, then this long to hand back its work, then SIGKILL
RESTART_BACKOFF_MAX_S = 30.0


def worker_command(server: str, model: str, dtype: str, price_per_hour: float,
                   chip: str, kv: KvOptions | None = None, boxes: int = 0,
                   insecure_no_sandbox: bool = False, agents: int = 0) -> list[str]:
    command = [sys.executable, "-m", "minimill.cli", "worker",
               "--server", server, "--site", LOCAL_SITE,
               "--price-per-hour", str(price_per_hour), "--chip", chip,
               "--engine", "builtin", "--model", model, "--dtype", dtype,
               *(kv.argv() if kv is not None else ()),
               "--boxes", str(boxes), "--agents", str(agents)]
    return [*command, "--insecure-no-sandbox"] if insecure_no_sandbox else command


class WorkerSupervisor:
    """Runs the local worker process; restarts it with backoff when it dies unasked. Start
    `run` on the main thread's event loop (the worker's parent-death signal follows the
    thread that started it)."""

    def __init__(self, command: list[str], token: str) -> None:
        self.command = command
        self.env = {**owned_env(), "MINIMILL_SITE_TOKEN": token}
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopping = False

    async def run(self) -> None:
        delay = 1.0
        while not self.stopping:
            started = time.monotonic()
            self.proc = subprocess.Popen(self.command, env=self.env)
            code = await asyncio.to_thread(self.proc.wait)
            if self.stopping:
                return
            if time.monotonic() - started > 60:
                delay = 1.0  # it ran a good while: this is a fresh failure
            log.warning("local worker exited with status %s; restarting in %.0fs", code, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RESTART_BACKOFF_MAX_S)

    def hurry(self) -> None:
        """A second stop for a worker that is stopping: it skips the rest of its drain."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        self.stopping = True
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=WORKER_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning("local worker did not stop in %.0fs; killing it", WORKER_STOP_GRACE_S)
            proc.kill()
            proc.wait()
