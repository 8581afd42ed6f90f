"""Pipeline stages on other hosts of the site.

`minimill worker --pipeline-stages N --stages-listen ADDRESS:PORT` runs stage 0 (the engine,
which leases, schedules and samples for the site) and waits for N - 1 stages to connect;
`minimill stage --connect ADDRESS:PORT` on each other host is one of them. A stage takes the
next rank, reads from stage 0 what to run (the model, the engine's settings, its layers),
loads only its own layers' weights from its own copy of the model (the same name, or
`--model` where its path differs: the architecture must be the one stage 0 runs), and joins
the stages' gloo groups (pipeline_link.py) as a spawned stage does.

The handshake goes through stage 0's TCP store (keys under `minimill/`):
  assignment  what every stage runs (an Assignment)     nonce     random bytes for the proof
  next-rank   a counter: a stage's add(1) is its rank   proof/R   HMAC(secret, nonce, R)
  ready/R     ("ready", pid, (weight bytes, KV bytes), host name) or ("error", why)
  beat/R      a counter the stage adds to every second  stop      stage 0 ended the pipeline

The link carries tenants' hidden states unencrypted and is meant for a site's private
network. Stage 0 listens on the address it is given only; off loopback it needs a shared
secret (MINIMILL_STAGE_SECRET on every host) and admits a stage only with its proof, so a
stranger who reaches the port cannot take a stage's place; what any peer sends is read by
pipeline_link's bounded, class-restricted decoder.

A stage lives as long as its stage 0: it leaves when stage 0 ends (the link closes, or `stop`
is set) and `minimill stage` then waits for the next stage 0 at the same address (a
restarted worker), each time in a fresh process. Stage 0 ends the pipeline when a stage's
link breaks (its process ended) or its beat stops for SILENCE_S (its host is gone).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import multiprocessing
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from minimill.engine import pipeline_link as link
from minimill.engine.config import EngineConfig
from minimill.engine.expert_share import ExpertShare
from minimill.engine.memory_budget import StageWeights
from minimill.engine.params import EngineError, InvalidRequestError
from minimill.models.types import ModelConfig

log = logging.getLogger(__name__)

SECRET_ENV = "MINIMILL_STAGE_SECRET"
BEAT_S = 1.0
SILENCE_S = 15.0  # a stage whose beat stopped this long is gone (its host, or the network)
RETRY_S = 2.0  # a stage retries reaching stage 0 this often
PROGRESS_S = 30.0  # how often a wait says it is still waiting

_ASSIGNMENT = "minimill/assignment"
_NONCE = "minimill/nonce"
_NEXT_RANK = "minimill/next-rank"
_STOP = "minimill/stop"


def _key(name: str, rank: int) -> str:
    return f"minimill/{name}/{rank}"


@dataclass(frozen=True, slots=True)
class Assignment:
    """What stage 0 tells every stage: the model as stage 0 was given it (a name, or a path
    on stage 0's host), its architecture, the engine's settings and each stage's weights."""

    model: str
    source: str  # where stage 0 read it: the same path may hold it here
    model_config: ModelConfig
    config: EngineConfig
    # Per stage, stage 0 first: a pipeline stage's StageWeights, or an expert-parallel
    # rank's ExpertShare (expert_share.py), which also says what the process runs.
    keeps: tuple[StageWeights | ExpertShare, ...]

    @property
    def num_stages(self) -> int:
        return len(self.keeps)


@dataclass(frozen=True, slots=True)
class Joined:
    """What a stage reported when it was ready."""

    pid: int  # on its own host
    memory: tuple[int, int]  # bytes of weights it read, of its KV pool
    experts: list[int]  # an expert-parallel rank's routed experts among them


def parse_address(text: str) -> tuple[str, int]:
    """"HOST:PORT" (an IPv6 host in brackets) -> (host, port)."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidRequestError(f"a stage address is HOST:PORT, got {text!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    import ipaddress

    return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def stage_secret() -> bytes | None:
    value = os.environ.get(SECRET_ENV, "")
    return value.encode() if value else None


def proof(secret: bytes | None, nonce: bytes, rank: int) -> bytes:
    return hmac.new(secret or b"", nonce + str(rank).encode(), hashlib.sha256).hexdigest(
    ).encode()


def own_address(host: str, port: int) -> str:
    """This host's address on the route to (host, port): where its stage's peers reach it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # a datagram socket's connect only picks the route
        return str(probe.getsockname()[0])


class RemoteStages:
    """Stage 0's side: listen, hand out the assignment, admit the stages, watch them."""

    def __init__(self, listen: str, assignment: Assignment) -> None:
        self.host, port = parse_address(listen)
        if self.host in ("0.0.0.0", "::"):
            # The stages connect to the address stage 0 gives them: a wildcard is none.
            raise InvalidRequestError(
                f"stages_listen (--stages-listen) {listen}: give this host's address that its "
                "stages reach it at, not a wildcard")
        self.secret = stage_secret()
        if self.secret is None and not is_loopback(self.host):
            raise InvalidRequestError(
                f"stages_listen (--stages-listen) {listen} is off this host: set {SECRET_ENV} "
                "to the same secret on every host of the site, so that only its own stages "
                "can join")
        self.num_stages = assignment.num_stages
        self.address = self.host
        self.store, self.port = link.open_store(self.num_stages, self.host, port)
        self._nonce = secrets.token_bytes(32)
        self.store.set(_NONCE, self._nonce)
        self.store.set(_ASSIGNMENT, link.dumps(assignment))
        self.hosts: list[str] = []

    def wait_ready(self, timeout_s: float) -> list[Joined]:
        """What each stage reported once all have joined and loaded; EngineError naming the
        stage that failed, was refused or never came."""
        started = time.monotonic()
        deadline, say_at = started + timeout_s, started + PROGRESS_S
        out = []
        for rank in range(1, self.num_stages):
            key = _key("ready", rank)
            # Polled: the store's own wait logs a warning at every timeout.
            while not self.store.check([key]):
                now = time.monotonic()
                if now >= deadline:
                    raise EngineError(
                        f"pipeline stage {rank} did not join at {self.host}:{self.port} within "
                        f"{timeout_s:.0f} s (start `minimill stage --connect "
                        f"{self.host}:{self.port}` on the stage's host)")
                if now >= say_at:
                    log.info("pipeline: waiting for stage %d of %d to join at %s:%d", rank,
                             self.num_stages - 1, self.host, self.port)
                    say_at = now + PROGRESS_S
                time.sleep(0.1)
            given = self.store.get(_key("proof", rank))
            if not hmac.compare_digest(given, proof(self.secret, self._nonce, rank)):
                raise EngineError(f"pipeline stage {rank} was refused: its proof of "
                                  f"{SECRET_ENV} does not match this host's")
            message = link.loads(self.store.get(key))
            if message[0] != "ready":
                raise EngineError(f"pipeline stage {rank} did not start: {message[1]}")
            _, pid, memory, host, experts = message
            log.info("pipeline: stage %d joined from %s (pid %d)", rank, host, pid)
            self.hosts.append(str(host))
            out.append(Joined(int(pid), (int(memory[0]), int(memory[1])),
                              [int(e) for e in experts]))
        return out

    def watch(self, stopped: threading.Event, on_silent: Callable[[int], None]) -> None:
        """Until `stopped`: call on_silent(rank) for the first stage whose beat stopped."""
        seen = {rank: (0, time.monotonic()) for rank in range(1, self.num_stages)}
        try:
            store = dist.TCPStore(self.host, self.port, None, False, link.STORE_TIMEOUT)
            while not stopped.wait(BEAT_S):
                now = time.monotonic()
                for rank, (count, since) in seen.items():
                    beat = store.add(_key("beat", rank), 0)
                    if beat != count:
                        seen[rank] = (beat, now)
                    elif now - since > SILENCE_S:
                        on_silent(rank)
                        return
        except Exception as exc:  # the store closed: the pipeline is closing
            if not stopped.is_set():
                log.warning("pipeline: the stages' store failed: %s", exc)

    def stop(self) -> None:
        """Tell the stages to leave (they also do when this process ends)."""
        try:
            self.store.set(_STOP, b"1")
        except Exception as exc:  # the store is already gone
            log.debug("pipeline: could not set stop: %s", exc)


# The stage's side.

def serve_stages(connect: str, model: str | None = None, threads: int | None = None,
                 once: bool = False) -> int:
    """`minimill stage`: be a stage of the pipeline whose stage 0 listens at `connect`, for
    each stage 0 that comes there in turn (only the first with `once`). Each time runs in a
    fresh process; returns its exit status when `once`."""
    parse_address(connect)
    context = multiprocessing.get_context("spawn")
    current: list[Any] = []

    def stop(signum: int, _frame: object) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # once: the exit must not be interrupted
        for process in current:
            process.kill()
            process.join(10)  # gone (and reaped) before this process is
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)
    while True:
        process = context.Process(target=_session, name="minimill-stage",
                                  args=(connect, model, threads, os.getpid()))
        current[:] = [process]
        process.start()
        process.join()
        code = process.exitcode or 0
        if once:
            return code
        log.info("stage: the pipeline ended (status %d); waiting for stage 0 at %s again",
                 code, connect)
        time.sleep(RETRY_S)


def _session(connect: str, model: str | None, threads: int | None, parent: int) -> None:
    logging.basicConfig(level=os.environ.get("MINIMILL_LOG_LEVEL", "INFO"),
                        format="%(asctime)s stage %(levelname)s %(message)s", stream=sys.stderr)
    threading.Thread(target=_watch_parent, args=(parent,), name="minimill-stage-parent",
                     daemon=True).start()
    sys.exit(_run_session(connect, model, threads))


def _watch_parent(parent: int) -> None:
    """A session never outlives its `minimill stage` (killed, it cannot stop its child)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _connect(host: str, port: int) -> Any:
    """A client of stage 0's store, once stage 0 listens (asked with a plain connection
    first: the store's client logs a C++ stack trace at every refused attempt)."""
    said = False
    while True:
        try:
            socket.create_connection((host, port), timeout=RETRY_S * 5).close()
            return dist.TCPStore(host, port, None, False, timedelta(seconds=RETRY_S * 5))
        except Exception:
            if not said:
                log.info("stage: waiting for stage 0 at %s:%d", host, port)
                said = True
            time.sleep(RETRY_S)


def _run_session(connect: str, model: str | None, threads: int | None) -> int:
    from minimill.engine.pipeline_stage import StageLoop, load_stage

    host, port = parse_address(connect)
    store = _connect(host, port)
    rank = int(store.add(_NEXT_RANK, 1))
    assignment = link.loads(store.get(_ASSIGNMENT))
    if not isinstance(assignment, Assignment):
        log.error("stage: %s sent no assignment", connect)
        return 2
    if rank >= assignment.num_stages:
        log.error("stage: stage 0 at %s has all %d of its stages", connect,
                  assignment.num_stages - 1)
        return 2
    store.set(_key("proof", rank), proof(stage_secret(), store.get(_NONCE), rank))
    keep = assignment.keeps[rank]
    config = assignment.config
    config.num_threads = threads or os.cpu_count() or 1
    model = model or _model_here(assignment)
    expected = assignment.model_config

    def same_model(found: ModelConfig) -> None:
        if found != expected:
            raise EngineError(f"{model} on {socket.gethostname()} is not the model stage 0 "
                              f"runs ({expected.architecture}, {expected.num_hidden_layers} "
                              f"layers, hidden {expected.hidden_size})")

    try:
        if isinstance(keep, ExpertShare):
            from minimill.engine.expert_rank import load_rank

            runner, exchange, memory, experts = load_rank(model, config, keep, same_model,
                                                         auto_pull=True)
            what = f"experts {keep.local.start}-{keep.local.stop - 1}"
        else:
            runner, memory = load_stage(model, config, keep, same_model, auto_pull=True)
            experts, what = [], f"layers {keep.layers.start}-{keep.layers.stop - 1}"
    except Exception as exc:
        log.error("stage %d: %s: %s", rank, type(exc).__name__, exc)
        store.set(_key("ready", rank), link.dumps(("error", f"{type(exc).__name__}: {exc}")))
        return 1
    store.set(_key("ready", rank), link.dumps(("ready", os.getpid(), memory,
                                                socket.gethostname(), experts)))
    log.info("stage %d of %d: %s of %s", rank, assignment.num_stages - 1, what, model)
    threading.Thread(target=_beat, args=(host, port, rank), name="minimill-stage-beat",
                     daemon=True).start()
    address = own_address(host, port)
    try:
        groups = link.join(rank, assignment.num_stages, port, store, host=host,
                           address=address)
        if isinstance(keep, ExpertShare):
            from minimill.engine.expert_rank import serve_rank

            serve_rank(runner, exchange, groups, address)
        else:
            StageLoop(runner, groups).run()
    except Exception as exc:  # stage 0 went away mid-step
        log.warning("stage %d: the link to stage 0 broke: %s", rank, exc)
        os._exit(1)  # gloo's threads may still hold the broken link: no teardown
    log.info("stage %d: stage 0 stopped the pipeline", rank)
    os._exit(0)


def _model_here(assignment: Assignment) -> str:
    """The model as stage 0 named it (a known name, or a path or cached name that exists
    here), else the path stage 0 read it from."""
    from minimill.models.registry import KNOWN_MODELS, resolve_model

    if assignment.model in KNOWN_MODELS:
        return assignment.model
    try:
        resolve_model(assignment.model)
        return assignment.model
    except Exception:
        return assignment.source


def _beat(host: str, port: int, rank: int) -> None:
    """Tell stage 0 this stage lives; leave when stage 0 says stop or is gone."""
    try:
        store = dist.TCPStore(host, port, None, False, link.STORE_TIMEOUT)
        while True:
            store.add(_key("beat", rank), 1)
            if store.check([_STOP]):
                log.info("stage %d: stage 0 ended the pipeline", rank)
                os._exit(0)
            time.sleep(BEAT_S)
    except Exception as exc:
        log.warning("stage %d: stage 0 is gone: %s", rank, exc)
        os._exit(1)
