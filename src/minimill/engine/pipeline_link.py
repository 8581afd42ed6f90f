"""The wire between pipeline stages: torch.distributed process groups (gloo on CPUs) and the
messages stages pass over them.

Every stage process joins two groups over one TCP store: `forward` carries a step from stage
k to stage k + 1 (its description and the hidden states), `back` carries the last stage's
sampled tokens to stage 0. Two groups, so that stage 0 can send the next microbatch on one
thread while another waits for a finished one's tokens: each group's traffic is ordered and
never interleaved with the other's.

A message is a fixed header (kind and sizes, int64), then a pickled object and the hidden
states as raw bytes (any dtype crosses exactly). Sends are asynchronous: a stage starts its
send and goes on computing; the tensors stay referenced until the send completed.

Stages on other hosts reach stage 0's store over a network (stage_hosts.py), so what arrives
is read as untrusted: a message's object is unpickled by `loads`, which builds the few classes
a step carries and refuses any other (a plain unpickler runs whatever callable a stranger
names), and a header's sizes are bounded before anything is allocated.
"""

from __future__ import annotations

import io
import pickle
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# A stage waits for the next step for as long as the engine is idle: the groups' timeout
# must outlast any idle spell; a dead peer is found by its process ending, not by timeouts.
IDLE_TIMEOUT = timedelta(days=30)
STORE_TIMEOUT = timedelta(seconds=120)  # every stage joins within this of stage 0

STEP = 1  # a microbatch's step (forward: StepWork + hidden states; back: ModelOutput)
STATS = 2  # gather each stage's StageStats (reset=True starts them over)
STOP = 3  # end the stage processes

# The most a message may carry: its object (a step's description) and its hidden states (a
# step's tokens x hidden x 2, at most a few hundred MB for the largest models' full steps).
MAX_BODY_BYTES = 256 << 20
MAX_RAW_BYTES = 16 << 30

# Everything a message's object may be built from (module, name): the step's description and
# answer (a pipeline stage's, an expert-parallel rank's), the stage's assignment, and plain
# containers. Nothing that runs code when called.
_WIRE_CLASSES = frozenset({
    ("builtins", "range"), ("builtins", "set"), ("builtins", "frozenset"),
    ("minimill.engine.pipeline_stage", "StepWork"),
    ("minimill.engine.pipeline_stage", "StepFailed"),
    ("minimill.engine.params", "SamplingParams"),
    ("minimill.models.grammar", "GuidedDecoding"),
    ("minimill.models.grammar", "GuidedTag"),
    ("minimill.engine.scheduler", "ModelOutput"),
    ("minimill.engine.config", "EngineConfig"),
    ("minimill.engine.memory_budget", "StageWeights"),
    ("minimill.models.types", "ModelConfig"),
    ("minimill.engine.stage_hosts", "Assignment"),
    ("minimill.engine.expert_rank", "ExpertStep"),
    ("minimill.engine.expert_share", "ExpertShare"),
})


class WireError(Exception):
    """A message that is not one a stage sends: refused before it is acted on."""


class _WireUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _WIRE_CLASSES:
            raise WireError(f"a stage message may not build {module}.{name}")
        return super().find_class(module, name)


def dumps(obj: object) -> bytes:
    return pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    """A message's object, built only from _WIRE_CLASSES (WireError otherwise)."""
    try:
        return _WireUnpickler(io.BytesIO(data)).load()
    except WireError:
        raise
    except Exception as exc:  # truncated or malformed
        raise WireError(f"a malformed stage message: {type(exc).__name__}: {exc}") from exc


@dataclass(slots=True)
class StageStats:
    """Where one stage's time went since it started (or the last reset), in seconds."""

    stage: int
    steps: int = 0
    compute_s: float = 0.0  # running its layers (and the last stage: sampling)
    wait_s: float = 0.0  # idle, waiting for the next microbatch: the pipeline's bubble
    comm_s: float = 0.0  # receiving a step's body and waiting for its sends to complete

    def per_step(self) -> dict[str, float | int]:
        n = max(self.steps, 1)
        return {"stage": self.stage, "steps": self.steps,
                "compute_ms_per_step": 1000 * self.compute_s / n,
                "wait_ms_per_step": 1000 * self.wait_s / n,
                "comm_ms_per_step": 1000 * self.comm_s / n}


@dataclass(slots=True)
class Groups:
    forward: Any  # dist.ProcessGroupGloo
    back: Any
    rank: int
    world_size: int
    store: Any = None  # stage 0 holds the store's server


def open_store(world_size: int, host: str = "127.0.0.1", port: int = 0) -> tuple[Any, int]:
    """Stage 0's TCP store listening on `host` only (a free loopback port unless told where):
    (store, port). The store is handed a socket bound here, as its own would listen on every
    interface of the host."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    store = dist.TCPStore(host, port, world_size, True, STORE_TIMEOUT, wait_for_workers=False,
                          master_listen_fd=sock.detach())  # the store owns the socket now
    return store, port


def join(rank: int, world_size: int, port: int, store: Any = None, *,
         host: str = "127.0.0.1", address: str = "127.0.0.1") -> Groups:
    """Join the stages' groups (every stage calls this, stage 0 with its store; a stage on
    another host with stage 0's `host`). `address`: this process's own address, where the
    other stages reach it (gloo listens there only)."""
    if store is None:
        store = dist.TCPStore(host, port, world_size, False, STORE_TIMEOUT)
    groups = []
    for name in ("forward", "back"):
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = IDLE_TIMEOUT
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        groups.append(dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world_size,
                                            options))
    return Groups(groups[0], groups[1], rank, world_size, store)


@dataclass(slots=True)
class Sender:
    """Asynchronous sends on one group to one peer; each message's tensors live until its
    sends complete (`finish` waits for those started before)."""

    group: Any
    peer: int
    pending: deque[tuple[list[Any], list[torch.Tensor]]] = field(default_factory=deque)

    def send(self, kind: int, obj: object = None, hidden: torch.Tensor | None = None,
             stats: StageStats | None = None) -> None:
        """Start sending; waits (counted as `stats.comm_s`) only for sends two messages back,
        so that at most two messages' buffers are held."""
        body = torch.frombuffer(bytearray(dumps(obj)), dtype=torch.uint8)
        raw = (hidden.contiguous().view(-1).view(torch.uint8) if hidden is not None
               else torch.empty(0, dtype=torch.uint8))
        header = torch.tensor([kind, body.numel(), raw.numel()], dtype=torch.int64)
        tensors = [header, body] + ([raw] if raw.numel() else [])
        works = [self.group.send([t], self.peer, 0) for t in tensors]
        self.pending.append((works, tensors))
        while len(self.pending) > 2:
            self._wait_oldest(stats)

    def finish(self, stats: StageStats | None = None) -> None:
        while self.pending:
            self._wait_oldest(stats)

    def _wait_oldest(self, stats: StageStats | None) -> None:
        works, _tensors = self.pending.popleft()
        started = time.perf_counter()
        for work in works:
            work.wait()
        if stats is not None:
            stats.comm_s += time.perf_counter() - started


def receive(group: Any, peer: int, stats: StageStats | None = None
            ) -> tuple[int, Any, torch.Tensor | None]:
    """The next message from `peer`: (kind, object, hidden bytes or None). Waiting for its
    header counts as `stats.wait_s` (idle), the rest as `stats.comm_s`."""
    started = time.perf_counter()
    header = torch.empty(3, dtype=torch.int64)
    group.recv([header], peer, 0).wait()
    arrived = time.perf_counter()
    kind, body_bytes, raw_bytes = header.tolist()
    if (kind not in (STEP, STATS, STOP) or not 0 <= body_bytes <= MAX_BODY_BYTES
            or not 0 <= raw_bytes <= MAX_RAW_BYTES):
        raise WireError(f"a stage message with header {[kind, body_bytes, raw_bytes]}")
    body = torch.empty(body_bytes, dtype=torch.uint8)
    works = [group.recv([body], peer, 0)]
    raw = None
    if raw_bytes:
        raw = torch.empty(raw_bytes, dtype=torch.uint8)
        works.append(group.recv([raw], peer, 0))
    for work in works:
        work.wait()
    obj = loads(body.numpy().tobytes())
    if stats is not None:
        stats.wait_s += arrived - started
        stats.comm_s += time.perf_counter() - arrived
    return kind, obj, raw
