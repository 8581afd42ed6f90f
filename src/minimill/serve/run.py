"""`minimill serve`: the control plane (uvicorn, in this process, and with `--workers K` in K-1
more: api_workers.py) plus one local worker process.

The local worker is an ordinary `minimill worker` subprocess that reaches the control plane over
loopback HTTP with the "local" site's token, exactly as a remote site would. This process
supervises it (fleet/supervisor.py: restarts it if it dies) and stops it on SIGINT/SIGTERM,
before the API, which the worker's last checkpoints and hand-backs are sent to; it
dies with serve however serve ends, and serve dies with the process that started it when that
one asks (lifetime.py). Every start prints a fresh API key of tenant "default" with a
copy-pasteable hint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from sqlalchemy.engine import make_url

from minimill import event_loop
from minimill.api.settings import Settings
from minimill.fleet.kv_options import KvOptions
from minimill.fleet.supervisor import LOCAL_SITE, WorkerSupervisor, worker_command
from minimill.lifetime import STOP_SIGNALS, die_with_parent, stop_reason
from minimill.serve.api_workers import ApiWorkers, check_workers

log = logging.getLogger("minimill.serve")
DEFAULT_TENANT = "default"


class _Server(uvicorn.Server):
    """uvicorn without its signal capture: serve handles signals itself, so that it can stop
    the worker before exiting (uvicorn would re-raise SIGTERM and die on the spot)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _model_path(model: str) -> str:
    from minimill.models.registry import KNOWN_MODELS, logged_progress, pull_model, resolve_model

    if model in KNOWN_MODELS:
        return str(pull_model(model, progress=logged_progress))
    return str(resolve_model(model))


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything else so a busy port fails fast and clearly."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"error: cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def _chip() -> str:
    return "cuda" if shutil.which("nvidia-smi") else "cpu"


def _print_key(key: str, host: str, port: int, model: str) -> None:
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    base = f"http://{shown_host}:{port}/v1"
    print(f"minimill serve: API key for tenant '{DEFAULT_TENANT}' (new each start):\n"
          f"  export OPENAI_BASE_URL={base}\n"
          f"  export OPENAI_API_KEY={key}\n"
          f"  export MINIMILL_BASE_URL={base}\n"
          f"  export MINIMILL_API_KEY={key}\n"
          f"  python -c \"from openai import OpenAI; print(OpenAI().chat.completions.create("
          f"model='{model}', messages=[{{'role': 'user', 'content': 'Hi'}}])"
          f".choices[0].message.content)\"", flush=True)


def _loopback_url(host: str, port: int) -> str:
    """Where the local worker reaches the control plane: loopback unless bound elsewhere."""
    if host in ("0.0.0.0", "::", "", "localhost", "127.0.0.1"):
        return f"http://127.0.0.1:{port}"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _serve(server: _Server, sock: socket.socket, supervisor: WorkerSupervisor | None,
                 workers: ApiWorkers | None = None) -> None:
    loop = asyncio.get_running_loop()
    stopping_worker: list[asyncio.Task[None]] = []

    async def stop_worker_then_api(worker: WorkerSupervisor) -> None:
        # The worker's last acts (checkpoints, hand-backs, box snapshots and releases) are
        # calls to this control plane: it answers them before it closes.
        try:
            await asyncio.to_thread(worker.stop)
        finally:
            server.should_exit = True

    def on_signal(signum: int) -> None:
        log.info("%s: stopping", stop_reason(signum))
        if supervisor is not None and not stopping_worker:
            # A terminal's Ctrl-C reaches the worker too: it must not be restarted meanwhile.
            supervisor.stopping = True
            stopping_worker.append(asyncio.create_task(stop_worker_then_api(supervisor)))
            return
        if supervisor is not None:
            supervisor.hurry()  # a second stop: the worker skips its drain
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    background: list[asyncio.Task[None]] = []
    try:
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if workers is not None and server.started:  # the socket listens: they may accept
            background.append(asyncio.create_task(workers.run()))
        if supervisor is not None and server.started:
            background.append(asyncio.create_task(supervisor.run()))
        await serving
    finally:
        if supervisor is not None:  # the API ended without a signal (it failed): stop it too
            supervisor.stopping = True
            await asyncio.to_thread(supervisor.stop)
        await asyncio.gather(*stopping_worker, return_exceptions=True)
        if workers is not None:  # after the local worker, whose last calls they may serve
            await asyncio.to_thread(workers.stop)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)


def _sandboxed_count(count: int, insecure_no_sandbox: bool, check: Callable[[], None],
                     what: str, off: list[str]) -> int:
    """How many boxes or agents the local worker offers: none where `check` finds their
    sandbox unavailable (tokens are served all the same); `off` gets the reason."""
    if count <= 0 or insecure_no_sandbox:
        return max(count, 0)
    from minimill.boxes.sandbox import IsolationUnavailable

    try:
        check()
    except IsolationUnavailable as exc:
        off.append(f"{what} are off: {exc}")
        return 0
    return count


def _local_sandboxed(boxes: int, agents: int, insecure_no_sandbox: bool,
                     off: list[str]) -> tuple[int, int]:
    """The boxes and agents the local worker offers, after checking their sandboxes."""
    from minimill.agents.harness_process import check_harness_isolation
    from minimill.boxes.sandbox import check_isolation

    return (_sandboxed_count(boxes, insecure_no_sandbox, check_isolation, "boxes", off),
            _sandboxed_count(agents, insecure_no_sandbox, check_harness_isolation, "agents",
                             off))


def run_serve(*, host: str, port: int, db: str | None, model: str, dtype: str,
              local_worker: bool, price_per_hour: float, kv: KvOptions | None = None,
              boxes: int = 4, insecure_no_sandbox: bool = False, agents: int = 8,
              webhook_allow_private: bool = False, workers: int = 1) -> None:
    """Serve the OpenAI-compatible API on host:port from `workers` processes (api_workers.py),
    plus one local worker serving `model`, holding up to `boxes` boxes and running up to
    `agents` durable agents. With `webhook_allow_private`, webhooks may reach private
    addresses (else the environment's MINIMILL_WEBHOOK_ALLOW_PRIVATE decides)."""
    logging.basicConfig(level=os.environ.get("MINIMILL_LOG_LEVEL", "INFO"),
                        format="%(asctime)s serve %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per call is noise
    die_with_parent()
    check_workers(workers, db)
    from minimill.api.app import create_app
    from minimill.control.errors import ControlError
    from minimill.control.keys import create_key
    from minimill.control.records import ALL_SITE_SCOPES
    from minimill.control.sites import create_site
    from minimill.control.store import StoreError, open_store
    from minimill.models.types import ModelError

    # What is off comes first, in plain words, before anything else serve says.
    off: list[str] = []
    boxes, agents = (_local_sandboxed(boxes, agents, insecure_no_sandbox, off) if local_worker
                     else (0, 0))
    for line in off:
        print(f"minimill serve: {line}", file=sys.stderr, flush=True)
    sock = _bind(host, port)
    try:
        if local_worker:
            log.info("model %s: %s", model, _model_path(model))
        chosen: dict[str, Any] = {"db": db} if db else {}
        if webhook_allow_private:
            chosen["webhook_allow_private"] = True
        settings = Settings(models=[model], **chosen)
        store = open_store(settings.db)
    except (ModelError, StoreError) as exc:
        sock.close()
        raise SystemExit(f"error: {exc}") from None
    try:
        key = create_key(store, DEFAULT_TENANT)
        chip = _chip()
        # The local worker serves tokens, and boxes and agents where it can sandbox them.
        token = create_site(store, LOCAL_SITE, price_per_hour, chip, replace=True,
                            serves=ALL_SITE_SCOPES)
    except ControlError as exc:
        store.close()
        sock.close()
        raise SystemExit(f"error: {exc.message}") from None
    _print_key(key, host, port, model)
    app = create_app(settings, store=store)
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                    timeout_graceful_shutdown=5))
    command = worker_command(_loopback_url(host, port), model, dtype, price_per_hour, chip,
                             kv=kv, boxes=boxes, insecure_no_sandbox=insecure_no_sandbox,
                             agents=agents)
    supervisor = WorkerSupervisor(command, token) if local_worker else None
    others = (ApiWorkers(workers - 1, sock, settings.db or store.url, model,
                         webhook_allow_private) if workers > 1 else None)
    # The URL may carry the store's password: the log shows *** in its place.
    shown = make_url(store.url).render_as_string(hide_password=True)
    log.info("control plane on http://%s:%d/v1 (store %s, %d API process%s)%s", host, port,
             shown, workers, "es" if workers > 1 else "",
             ", starting the local worker" if local_worker else "")
    try:
        event_loop.run(_serve(server, sock, supervisor, others))
    finally:
        store.close()
        sock.close()
