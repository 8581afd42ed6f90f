"""`serve --workers K`: K API processes on one listening socket and one PostgreSQL store.

serve binds the socket and serves on it itself; it starts K-1 more API processes
(`python -m minimill.serve.api_worker`) that inherit the socket, so the kernel hands each new
connection to whichever process accepts it first, as uvicorn's and gunicorn's workers do. They
share nothing but the store: a lease taken through one is heartbeated through another. The
local worker, the default tenant's key and the local site are serve's alone (started once, not
K times), and the janitor's ticks run in one process at a time (control/janitor_lock.py). An
API process that dies is started again; each dies with serve (lifetime.py).

SQLite is refused: its one writer would be the bottleneck K processes queue on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time

from minimill.lifetime import owned_env

log = logging.getLogger("minimill.serve")
WORKER_MODULE = "minimill.serve.api_worker"
DB_ENV = "MINIMILL_DB"  # api/settings.py's `db`
# Seconds an API process gets to finish its calls after SIGTERM before it is killed.
STOP_GRACE_S = 10.0
RESTART_BACKOFF_MAX_S = 30.0
CHECK_INTERVAL_S = 0.5


def check_workers(workers: int, db: str | None) -> None:
    """Refuse --workers on a store several processes cannot share well."""
    if workers < 1:
        raise SystemExit(f"error: --workers {workers}: at least 1")
    if workers > 1 and not (db or "").startswith(("postgresql", "postgres:")):
        raise SystemExit(f"error: --workers {workers} needs --db postgresql://...: on SQLite "
                         "every write queues on one lock, so more API processes add nothing "
                         "but contention (run one, or move the store to PostgreSQL)")


class ApiWorkers:
    """The API processes beside serve's own: started, restarted if they die, stopped."""

    def __init__(self, count: int, sock: socket.socket, db: str, model: str,
                 webhook_allow_private: bool) -> None:
        self.count = count
        self.sock = sock
        self.command = [sys.executable, "-m", WORKER_MODULE, "--fd", str(sock.fileno()),
                        "--model", model]
        # The store URL in the environment, not the command line that `ps` shows to every
        # user (it may hold a password).
        self.db = db
        if webhook_allow_private:
            self.command.append("--webhook-allow-private")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stopping = False

    def _start_one(self) -> subprocess.Popen[bytes]:
        # A session of their own: a terminal's Ctrl-C reaches serve alone, which stops them
        # after its local worker (whose last calls they may be answering).
        return subprocess.Popen(self.command, env=owned_env({**os.environ, DB_ENV: self.db}),
                                pass_fds=(self.sock.fileno(),), start_new_session=True)

    async def run(self) -> None:
        """Start them and keep them running until `stop` (on the main thread's loop: their
        parent-death signal follows the thread that started them)."""
        self.procs = [self._start_one() for _ in range(self.count)]
        delays = [1.0] * self.count
        started = [time.monotonic()] * self.count
        while not self.stopping:
            await asyncio.sleep(CHECK_INTERVAL_S)
            for i, proc in enumerate(self.procs):
                code = proc.poll()
                if code is None or self.stopping:
                    continue
                if time.monotonic() - started[i] > 60:
                    delays[i] = 1.0  # it ran a good while: this is a fresh failure
                log.warning("API process %d exited with status %s; starting another in %.0fs",
                            proc.pid, code, delays[i])
                await asyncio.sleep(delays[i])
                if self.stopping:
                    return
                delays[i] = min(delays[i] * 2, RESTART_BACKOFF_MAX_S)
                started[i] = time.monotonic()
                self.procs[i] = self._start_one()

    def stop(self) -> None:
        """SIGTERM each (uvicorn finishes the calls in flight), SIGKILL the slow ones."""
        self.stopping = True
        live = [p for p in self.procs if p.poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in live:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("API process %d did not stop in %.0fs; killing it", proc.pid,
                            STOP_GRACE_S)
                proc.kill()
                proc.wait()
