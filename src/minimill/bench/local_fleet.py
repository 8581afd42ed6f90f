"""A throwaway local fleet for benchmarks: `minimill serve` and `minimill worker` subprocesses
on a temporary MINIMILL_HOME whose model cache links the user's pulled models (and their warm
weights cache files, models/warm_cache.py).

The benchmark owns these processes (lifetime.py): each runs in a process group of its own and
dies with the benchmark however that ends, and `close` stops them all, workers first.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import httpx

from minimill.lifetime import owned_env

READY_TIMEOUT_S = 600.0


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class BenchError(RuntimeError):
    """A benchmark's fleet did not start or misbehaved; the message says where to look."""


class LocalProcess:
    """A minimill subprocess in its own process group, logging to a file."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.args, self.env, self.log_path = args, env, log_path
        self.popen: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> None:
        self._log = self.log_path.open("ab")
        # owned_env in the starting thread: it says whether that is the main thread.
        self.popen = subprocess.Popen(self.args, env=owned_env(self.env), stdout=self._log,
                                      stderr=subprocess.STDOUT, start_new_session=True)

    def wait_for_log(self, pattern: str, timeout: float = READY_TIMEOUT_S,
                     start: int = 0) -> re.Match[str]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            match = re.search(pattern, self.log_path.read_text(errors="replace")[start:])
            if match:
                return match
            if self.popen is not None and self.popen.poll() is not None:
                raise BenchError(f"{self.args[3]} exited; see {self.log_path}")
            time.sleep(0.1)
        raise BenchError(f"no {pattern!r} after {timeout:.0f}s; see {self.log_path}")

    def wait_for_serve(self, server: str, timeout: float = READY_TIMEOUT_S) -> str:
        """For a `minimill serve` process: its API key (from its log), once `server` (its
        http://host:port) answers an authenticated /v1/models."""
        deadline = time.time() + timeout
        key = self.wait_for_log(r"OPENAI_API_KEY=(\S+)", timeout=timeout).group(1)
        while time.time() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(server + "/v1/models", timeout=2,
                             headers={"Authorization": f"Bearer {key}"}).is_success:
                    break
            time.sleep(0.1)
        return key

    def kill9(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()

    def terminate(self) -> None:
        """SIGTERM: the process stops gracefully (a worker hands back its leases)."""
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, up to `timeout` to end, then SIGKILL of its whole process group."""
        if self.popen is None:
            return
        self.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout)
        self.kill9()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)  # leftovers of the group
        if self._log is not None:
            self._log.close()
            self._log = None


class LocalFleet:
    """A serve (optionally without its local worker) plus extra workers, on a temp home."""

    def __init__(self, model: str, dtype: str, *, local_worker: bool = True,
                 env: dict[str, str] | None = None, serve_args: tuple[str, ...] = (),
                 home: Path | None = None) -> None:
        """`home`: a home an earlier fleet left (its store, tenants and keys), for a restart;
        the caller removes it. Otherwise a temp home of its own, removed on close."""
        from minimill.models.registry import KNOWN_MODELS, logged_progress, pull_model

        self.model, self.dtype = model, dtype
        self.owns_home = home is None
        self.home = Path(tempfile.mkdtemp(prefix="minimill-bench-")) if home is None else home
        (self.home / "models").mkdir(exist_ok=True)
        (self.home / "serve.log").unlink(missing_ok=True)  # waits read this start's lines
        if model in KNOWN_MODELS:
            source = pull_model(model, progress=logged_progress).parent
            link = self.home / "models" / source.name
            if not link.is_symlink():
                link.symlink_to(source)
        self.port = free_port()
        self.env = {**os.environ, "MINIMILL_HOME": str(self.home), **(env or {})}
        args = [sys.executable, "-m", "minimill.cli", "serve", "--port", str(self.port),
                "--model", model, "--dtype", dtype, *serve_args]
        if not local_worker:
            args.append("--no-local-worker")
        self.local_worker = local_worker
        self.serve = LocalProcess(args, self.env, self.home / "serve.log")
        self.workers: dict[str, LocalProcess] = {}
        self.key = ""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> LocalFleet:
        self.serve.start()
        self.key = self.serve.wait_for_serve(f"http://127.0.0.1:{self.port}")
        if self.local_worker:
            self.serve.wait_for_log(r"worker for site 'local' ready")
        return self

    def site_token(self, name: str, price_per_hour: float = 0.10) -> str:
        from minimill.control.records import ALL_SITE_SCOPES
        from minimill.control.sites import create_site
        from minimill.control.store import open_store

        store = open_store(f"sqlite:///{self.home / 'data' / 'minimill.db'}")
        try:
            return create_site(store, name, price_per_hour, replace=True,
                               serves=ALL_SITE_SCOPES)
        finally:
            store.close()

    def worker(self, site: str, token: str, *extra_args: str) -> LocalProcess:
        """A `minimill worker` process for `site` (started, not yet ready)."""
        args = [sys.executable, "-m", "minimill.cli", "worker", "--server",
                f"http://127.0.0.1:{self.port}", "--site", site, "--model", self.model,
                "--dtype", self.dtype, *extra_args]
        proc = LocalProcess(args, {**self.env, "MINIMILL_SITE_TOKEN": token},
                            self.home / f"worker-{site}.log")
        self.workers[site] = proc
        return proc

    def close(self) -> None:
        for proc in self.workers.values():  # all at once: each drains for a while
            proc.terminate()
        for proc in self.workers.values():
            proc.stop()
        self.serve.stop()
        if self.owns_home:
            shutil.rmtree(self.home, ignore_errors=True)
