"""Pipeline stages (or expert-parallel ranks) on other hosts of the site: stage 0's side and
the handshake.

`minimill worker --pipeline-stages N --stages-listen ADDRESS:PORT` runs stage 0 (the engine,
which leases, schedules and samples for the site) and waits for N - 1 stages to connect;
`minimill stage --connect ADDRESS:PORT` on each other host is one of them (stage_session.py).
A stage takes the next rank, reads from stage 0 what to run (the model, the engine's
settings, its layers or its share of the experts), loads only its own weights from its own
copy of the model (the same name, or `--model` where its path differs: the architecture must
be the one stage 0 runs), and joins the stages' gloo groups (pipeline_link.py) as a spawned
stage does.

The handshake goes through stage 0's TCP store (keys under `minimill/`):
  assignment  what every stage runs (an Assignment)     nonce     random bytes for the proof
  next-rank   a counter: a stage's add(1) is its rank   proof/R   HMAC(secret, nonce, R)
  ready/R     ("ready", pid, (weight bytes, KV bytes), host name, experts) or ("error", why)
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
import ipaddress
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

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

ASSIGNMENT_KEY = "minimill/assignment"
NONCE_KEY = "minimill/nonce"
NEXT_RANK_KEY = "minimill/next-rank"
STOP_KEY = "minimill/stop"


def store_key(name: str, rank: int) -> str:
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
        self.store.set(NONCE_KEY, self._nonce)
        self.store.set(ASSIGNMENT_KEY, link.dumps(assignment))
        self.hosts: list[str] = []

    def wait_ready(self, timeout_s: float) -> list[Joined]:
        """What each stage reported once all have joined and loaded; EngineError naming the
        stage that failed, was refused or never came."""
        started = time.monotonic()
        deadline, say_at = started + timeout_s, started + PROGRESS_S
        out = []
        for rank in range(1, self.num_stages):
            key = store_key("ready", rank)
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
            given = self.store.get(store_key("proof", rank))
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
                    beat = store.add(store_key("beat", rank), 0)
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
            self.store.set(STOP_KEY, b"1")
        except Exception as exc:  # the store is already gone
            log.debug("pipeline: could not set stop: %s", exc)
