"""Expert parallelism inside one site: a mixture of experts' routed experts spread over N
processes (ranks), rank 0 the engine's process (this runner), ranks 1..N-1 spawned as
pipeline stages are (expert_rank.py) and joined to it by torch.distributed (gloo) over a TCP
store (pipeline_link.py).

Each rank holds every weight but the routed experts (attention, norms, routers, shared
experts, the embedding; rank 0 alone the final norm and vocabulary projection, since it
alone samples) and its own contiguous range of each MoE layer's experts
(expert_share.ExpertShare), and reads only those from the checkpoint: the experts, most of
such a model, are what need not fit one process.

Attention is data-parallel: each sequence is dealt a rank when the engine admits it
(expert_dealer.py: the rank running the fewest, its cached prefixes that rank's own) and
keeps it for its life; rank 0's scheduler decides each step and its runner sends each rank
its sequences. Each rank embeds its own
tokens and runs their attention over its own KV pool; in each MoE layer the ranks exchange
(token, choice) pairs with their experts' ranks by all_to_all (expert_share.ExpertExchange),
every rank every layer, with tokens or none. Each rank then sends its sampling rows' hidden
states to rank 0, which norms, projects and samples every sequence's token (guided decoding
and embeddings as usual).
What that costs: every rank keeps a KV pool of as many blocks as rank 0's (block ids as
rank 0 allocates them; only the rank that runs a sequence writes its blocks), so the KV
takes N times one pool's memory for one pool's worth of tokens; a prefix shared by many
sequences is computed once per rank; and the dealing balances the ranks by sequences, not
by tokens.

A rank that ends (killed, crashed) ends the engine: the watcher kills the other ranks, the
step in progress fails with PipelineStageError (an EngineDied) and every later step is
refused, as for a dead pipeline stage. A step that fails on any rank does too: the ranks'
collectives are then out of step with each other, and nothing can step again.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from minimill.engine import peers
from minimill.engine import pipeline_link as link
from minimill.engine.config import EngineConfig
from minimill.engine.expert_rank import (
    RandomWeights,
    RankReport,
    experts_group,
    rank_main,
    run_share,
    step_of,
)
from minimill.engine.expert_share import ExpertExchange, ExpertShare, experts_read
from minimill.engine.model_runner import ModelRunner
from minimill.engine.params import EngineError
from minimill.engine.pipeline_runner import PipelineStageError
from minimill.engine.scheduler import ModelOutput, SchedulerOutput
from minimill.engine.stage_hosts import Assignment, RemoteStages
from minimill.models.types import LoadedModel

log = logging.getLogger(__name__)

_RANK_START_TIMEOUT_S = 600.0
_RANK_STOP_TIMEOUT_S = 30.0
# After a step failed: how long to wait for a rank's exit to name it as the cause (a killed
# process's end is seen at once; this bounds the wait where no rank ended).
_DEATH_NAMING_S = 10.0


class ExpertParallelRunner(ModelRunner):
    """Rank 0's model runner: the whole step here with its share of the experts, the other
    shares in the rank processes."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        path = loaded.source_path
        source: str | RandomWeights = path
        if path.startswith("random:") and "random_seed" in loaded.extra:
            # Random weights (benchmarks): each rank draws the same from the seed.
            source = RandomWeights(loaded.name, loaded.config, loaded.extra["random_seed"],
                                   loaded.tokenizer)
        elif not path or path.startswith("random:"):
            raise EngineError("expert-parallel ranks load the model by name or path; this "
                              "model was built in memory")
        mc = loaded.config
        self.num_ranks = config.expert_parallel
        self.shares = [ExpertShare(r, self.num_ranks, mc.num_experts)
                       for r in range(self.num_ranks)]
        self.exchange = ExpertExchange(self.shares[0])
        # What this process read: its share where it loaded the model itself (load_with_config),
        # everything where it was handed a whole model (only its share is used).
        report = RankReport(os.getpid(), int(loaded.extra.get("loaded_bytes") or sum(
            t.numel() * t.element_size() for t in loaded.weights.values())),
            0, experts_read(loaded.weights))
        # Its kernels pin their threads to the first cores (model_runner.py); each other rank
        # takes the cores after them (expert_rank.rank_cpus).
        super().__init__(config, loaded, exchange=self.exchange)
        report.kv_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        self.ranks: list[RankReport] = [report]  # rank 0 first
        self.seq_steps = [0] * self.num_ranks  # sequences each rank ran, over all steps
        self._dead: str | None = None
        self._closing = False
        self._lock = threading.Lock()
        self._start_ranks(config, source)
        log.info("expert parallel: %d ranks, experts %s", self.num_ranks,
                 [(s.local.start, s.local.stop) for s in self.shares])

    def _start_ranks(self, config: EngineConfig, source: str | RandomWeights) -> None:
        self.processes: list[Any] = []
        self._conns: list[Connection] = []
        self.remote: RemoteStages | None = None
        self._remote_pids: list[int] = []
        self._stopped = threading.Event()
        if config.stages_listen:
            self._join_remote(config, source)
        else:
            self._start_local(config, source)
        self._senders = [link.Sender(self.groups.forward, rank)
                         for rank in range(1, self.num_ranks)]
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._watcher = threading.Thread(target=self._watch, name="minimill-experts-watch",
                                         daemon=True)
        self._watcher.start()

    def _join_remote(self, config: EngineConfig, source: str | RandomWeights) -> None:
        """Wait for the ranks from other hosts (stage_hosts.py), then join their groups."""
        assert config.stages_listen is not None
        if isinstance(source, RandomWeights):
            raise EngineError("expert-parallel ranks on other hosts load the model by name "
                              "or path; random weights are drawn on one host only")
        self.remote = RemoteStages(config.stages_listen, Assignment(
            config.model, source, self.model_config, config, tuple(self.shares)))
        try:
            for rank, joined in enumerate(self.remote.wait_ready(_RANK_START_TIMEOUT_S), 1):
                self._remote_pids.append(joined.pid)
                self.ranks.append(RankReport(joined.pid, joined.memory[0], joined.memory[1],
                                             joined.experts))
                log.info("expert parallel: rank %d joined, experts %s", rank, joined.experts)
            self.groups = link.join(0, self.num_ranks, self.remote.port, self.remote.store,
                                    address=self.remote.address)
            self.exchange.group = experts_group(0, self.num_ranks, self.remote.store,
                                                self.remote.address)
        except BaseException:
            self.remote.stop()
            raise

    def _start_local(self, config: EngineConfig, source: str | RandomWeights) -> None:
        store, port = link.open_store(self.num_ranks)
        self.processes, self._conns, ready = peers.start_local(
            self.num_ranks, rank_main,
            lambda rank, conn: (conn, self.shares[rank], port, source, config),
            "minimill-experts", "expert-parallel rank", _RANK_START_TIMEOUT_S,
            _RANK_STOP_TIMEOUT_S)
        self.ranks += [report for (report,) in ready]
        try:
            # `forward` carries steps from rank 0 to each rank, `back` their sampling rows,
            # and a group of their own the experts' exchanges.
            self.groups = link.join(0, self.num_ranks, port, store)
            self.exchange.group = experts_group(0, self.num_ranks, store)
        except BaseException:
            self._kill_ranks()
            raise

    @property
    def rank_pids(self) -> list[int]:
        """The rank processes' pids, rank 1 first (a remote rank's on its own host)."""
        return self._remote_pids or [p.pid for p in self.processes]

    def execute(self, output: SchedulerOutput) -> ModelOutput:
        """Send each rank its sequences of the step, run this rank's with them, then norm,
        project and sample every sequence's rows here."""
        if self._dead is not None:
            raise PipelineStageError(self._dead)
        entries = output.scheduled
        if self.step_log is not None:
            self.step_log.append(self._shape(entries))
        owners = [e.seq.rank for e in entries]  # dealt at admission (expert_dealer.py)
        shares = [[e for e, r in zip(entries, owners, strict=True) if r == rank]
                  for rank in range(self.num_ranks)]
        for rank, share in enumerate(shares):
            self.seq_steps[rank] += len(share)
        try:
            for sender, share in zip(self._senders, shares[1:], strict=True):
                sender.send(link.STEP, step_of(share))
            parts = [run_share(self, self.exchange, step_of(shares[0]))]
            for rank in range(1, self.num_ranks):
                _, _, raw = link.receive(self.groups.back, rank)
                parts.append(torch.empty(2, 0, self.model_config.hidden_size,
                                         dtype=self.config.torch_dtype) if raw is None
                             else raw.view(self.config.torch_dtype).view(
                                 2, -1, self.model_config.hidden_size))
        except Exception as exc:
            self._die(self._cause(exc))
            # Reaped before the error goes up, whichever thread saw the death first (the
            # watch's stop of the ranks may still be under way).
            self._kill_ranks()
            assert self._dead is not None
            raise PipelineStageError(self._dead) from exc
        # The sampling rows, from each rank's part back into the step's order.
        place: list[int] = []
        offsets = [0] * self.num_ranks
        starts = [0]
        for part in parts[:-1]:
            starts.append(starts[-1] + part.shape[1])
        for entry, rank in zip(entries, owners, strict=True):
            if entry.sample:
                place.append(starts[rank] + offsets[rank])
                offsets[rank] += 1
        states = torch.cat(parts, dim=1)[:, place].to(self.device)
        rows = torch.arange(len(place), device=self.device)
        return self._finish(entries, states[0], states[1], rows)

    def _cause(self, exc: Exception) -> str:
        """Why a step failed: a rank that ended, else the error itself."""
        if self.remote is not None:  # no process to see end: the link broke
            return f"an expert-parallel rank is unreachable: {type(exc).__name__}: {exc}"
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, 1)}
        ready = wait(list(sentinels), _DEATH_NAMING_S)
        if ready:
            rank = sentinels[ready[0]]
            code = peers.reap(self.processes[rank - 1], _RANK_STOP_TIMEOUT_S)
            return f"expert-parallel rank {rank} ended (exit code {code})"
        return f"an expert-parallel step failed: {type(exc).__name__}: {exc}"

    def _watch(self) -> None:
        """A rank process that ends unasked ends the engine (a rank on another host: one
        whose beat stopped; one whose process ended breaks the next step's link)."""
        peers.watch("expert-parallel rank", self.processes, self.remote, self._stopped,
                    self._wake_r, lambda: self._closing, self._die, _RANK_STOP_TIMEOUT_S)

    def _die(self, reason: str) -> None:
        with self._lock:
            if self._dead is not None or self._closing:
                return
            self._dead = reason
        log.error("%s: stopping the expert-parallel ranks", reason)
        # The others' sockets close with them, so a collective rank 0 waits in fails.
        self._kill_ranks()

    def _kill_ranks(self) -> None:
        peers.stop(self.processes, self.remote, self._stopped, _RANK_STOP_TIMEOUT_S)

    def close(self) -> None:
        """Stop every rank process (idempotent)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            dead = self._dead is not None
        if not dead:
            with contextlib.suppress(Exception):
                for sender in self._senders:
                    sender.send(link.STOP)
                for sender in self._senders:
                    sender.finish()
            for process in self.processes:
                peers.reap(process, _RANK_STOP_TIMEOUT_S)
            # Release the groups now, not in the interpreter's teardown (where gloo's
            # threads abort the process).
            self._senders.clear()
            self.exchange.group = None
            self.groups.forward = self.groups.back = self.groups.store = None
            if self.remote is not None:
                self.remote.store = None
        self._wake_w.send(None)
        self._kill_ranks()
        for conn in self._conns:
            conn.close()
