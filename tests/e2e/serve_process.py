"""Real `minimill serve` / `minimill worker` processes for end-to-end and fleet tests.

Each process runs in its own session (process group), so a test can kill -9 a whole serve:
the control plane and its local worker together, as a power cut would. The test process owns
them (minimill.lifetime): a test run that is killed leaves none of them behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import httpx
from openai import OpenAI

from minimill.lifetime import owned_env

MODEL = "smollm2-135m"
# Short leases and frequent checkpoints keep failure tests quick.
FAST_ENV = {
    "MINIMILL_LEASE_TTL_S": "4",
    "MINIMILL_CHECKPOINT_INTERVAL_S": "0.5",
    "MINIMILL_JANITOR_INTERVAL_S": "0.2",
    "MINIMILL_WORKER_DRAIN_S": "5",
    "MINIMILL_LOG_LEVEL": "INFO",
    # Agents run on the runners a test starts, never on a serve's local worker.
    "MINIMILL_LOCAL_AGENTS": "0",
}


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_home(root: Path, source_models: Path) -> Path:
    """A fresh MINIMILL_HOME whose model cache links the already-pulled models."""
    home = root / "home"
    (home / "models").mkdir(parents=True)
    for entry in source_models.iterdir():
        (home / "models" / entry.name).symlink_to(entry)
    return home


def minimill_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "minimill.cli", *args]


class Proc:
    """A minimill process in its own process group, logging to a file."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.args, self.env, self.log_path = args, env, log_path
        self.popen: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> None:
        self._log = self.log_path.open("ab")
        self.popen = subprocess.Popen(self.args, env=owned_env(self.env), stdout=self._log,
                                      stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, pattern: str, timeout: float, start: int = 0) -> re.Match[str]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            match = re.search(pattern, self.log_text()[start:])
            if match:
                return match
            if self.popen is not None and self.popen.poll() is not None:
                raise RuntimeError(f"process exited ({self.popen.returncode}):\n"
                                   f"{self.log_text()[-4000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"no {pattern!r} in {self.log_path} after {timeout}s:\n"
                           f"{self.log_text()[-4000:]}")

    def signal_group(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def kill9(self) -> None:
        """kill -9 the whole process group (e.g. control plane and its worker)."""
        self.signal_group(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait(timeout=30)
        self._close_log()

    def stop(self, timeout: float = 40.0) -> int | None:
        """SIGTERM, then SIGKILL of the group if it does not end in time."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.signal_group(signal.SIGKILL)
                self.popen.wait(timeout=30)
        # Anything left in the group (a worker whose parent died) goes too.
        self.signal_group(signal.SIGKILL)
        self._close_log()
        return self.popen.returncode

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


class Serve(Proc):
    """`minimill serve` on a free port with its own MINIMILL_HOME."""

    def __init__(self, home: Path, *, port: int | None = None, local_worker: bool = True,
                 extra_env: dict[str, str] | None = None, db: str | None = None,
                 model: str | None = None, workers: int = 1) -> None:
        self.home = home
        self.port = port or free_port()
        self.key = ""
        self.db = db
        env = {**os.environ, "MINIMILL_HOME": str(home), **FAST_ENV, **(extra_env or {})}
        args = minimill_cmd("serve", "--port", str(self.port), "--dtype", "float32")
        if db:
            args += ["--db", db]
        if model:
            args += ["--model", model]
        if not local_worker:
            args.append("--no-local-worker")
        if workers != 1:
            args += ["--workers", str(workers)]
        self.local_worker = local_worker
        super().__init__(args, env, home / f"serve-{self.port}.log")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start_and_wait(self, timeout: float = 180.0) -> Serve:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.start()
        self.key = self.wait_for_log(r"OPENAI_API_KEY=(\S+)", timeout, offset).group(1)
        deadline = time.time() + timeout
        while time.time() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(self.base_url + "/models",
                              headers={"Authorization": f"Bearer {self.key}"}, timeout=2)
                if r.status_code == 200:
                    break
            time.sleep(0.1)
        if self.local_worker:
            self.wait_for_log(r"worker for site 'local' ready", timeout, offset)
        return self

    def client(self, key: str | None = None, timeout: float = 120.0) -> OpenAI:
        return OpenAI(base_url=self.base_url, api_key=key or self.key, max_retries=0,
                      timeout=timeout)

    def db_url(self) -> str:
        return self.db or f"sqlite:///{self.home / 'data' / 'minimill.db'}"

    def cli(self, *args: str, env: dict[str, str] | None = None,
            timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(minimill_cmd(*args), env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout)


class Worker(Proc):
    """`minimill worker` joining a control plane as `site`."""

    def __init__(self, home: Path, server: str, site: str, token: str, *,
                 engine: str = "builtin", extra_env: dict[str, str] | None = None,
                 extra_args: tuple[str, ...] = ()) -> None:
        env = {**os.environ, "MINIMILL_HOME": str(home), **FAST_ENV,
               "MINIMILL_SITE_TOKEN": token, **(extra_env or {})}
        args = minimill_cmd("worker", "--server", server, "--site", site, "--engine", engine,
                            "--model", MODEL, "--dtype", "float32", *extra_args)
        super().__init__(args, env, home / f"worker-{site}.log")
        self.site = site

    def start_and_wait(self, timeout: float = 180.0) -> Worker:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.start()
        self.wait_for_log(rf"worker for site '{self.site}' ready", timeout, offset)
        return self


def chat_line(custom_id: str, content: str, max_tokens: int = 8, **extra: Any) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, **extra}
    return json.dumps({"custom_id": custom_id, "method": "POST",
                       "url": "/v1/chat/completions", "body": body})


def read_jsonl(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.splitlines() if line.strip()]
