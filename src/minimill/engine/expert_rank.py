"""An expert-parallel rank after the first (expert_parallel.py): a process holding every
weight but the routed experts and its own share of those (expert_share.ExpertShare, read
alone from the checkpoint), and a KV pool of as many blocks as rank 0's; it runs the
sequences rank 0 deals it each step, takes part in every MoE layer's exchanges, and sends
its sampling rows' hidden states back to rank 0. What the ranks share: the step's message
(`ExpertStep`), a rank's part of a step (`run_share`, rank 0's too), what a rank reports
once loaded (`RankReport`) and the cores it takes (`rank_cpus`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from minimill.engine import pipeline_link as link
from minimill.engine.config import EngineConfig
from minimill.engine.expert_share import ExpertExchange, ExpertShare, experts_read
from minimill.engine.model_runner import ModelRunner, step_inputs
from minimill.engine.peers import exit_with_parent
from minimill.engine.pipeline_stage import positions_of
from minimill.engine.scheduler import ScheduledSequence
from minimill.models.tokenizer import Tokenizer
from minimill.models.types import ModelConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ExpertStep:
    """One step, as the ranks after the first run it (in the step's order)."""

    input_ids: list[int]
    query_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # tokens of KV per sequence after the step
    tables: list[list[int]]  # block tables
    logits_rows: list[int]  # rows (into its tokens) whose hidden states go to rank 0


def step_of(entries: list[ScheduledSequence]) -> ExpertStep:
    inputs = step_inputs(entries)
    return ExpertStep(inputs.input_ids, inputs.query_lens, inputs.seq_lens,
                      [list(t) for t in inputs.tables], inputs.logits_rows)


@torch.inference_mode()
def run_share(runner: ModelRunner, exchange: ExpertExchange, step: ExpertStep
              ) -> torch.Tensor:
    """One rank's part of a step: its tokens through every layer (the MoE layers exchanging
    with the other ranks), or only the exchanges where it has none. Returns the hidden
    states and residual of its logits rows, [2, rows, hidden]."""
    model, dev, mc = runner.model, runner.device, runner.model_config
    dtype = runner.config.torch_dtype
    if not step.input_ids:
        exchange.idle(runner.kernels, model.layers, mc.hidden_size, mc.num_experts_per_tok,
                      dtype)
        return torch.empty(2, 0, mc.hidden_size, dtype=dtype)
    meta = runner.metadata(step.query_lens, step.seq_lens, step.tables,
                           [[] for _ in step.query_lens])
    positions = torch.tensor(positions_of(step.query_lens, step.seq_lens), dtype=torch.long,
                             device=dev)
    hidden = model.embed_tokens(torch.tensor(step.input_ids, dtype=torch.long, device=dev))
    hidden, residual = model.run_layers(hidden, None, positions, meta, runner.kv_cache)
    assert residual is not None
    rows = torch.tensor(step.logits_rows, dtype=torch.long, device=dev)
    return torch.stack([hidden[rows], residual[rows]]).cpu()


@dataclass(slots=True)
class RankReport:
    """What a rank holds once loaded."""

    pid: int
    weight_bytes: int  # of the tensors it read
    kv_bytes: int  # of its KV pool
    experts: list[int]  # the routed experts' ids among the tensors it read


def rank_cpus(rank: int, num_threads: int, pin: bool) -> set[int] | None:
    """`num_threads` cores of their own for each rank where there are enough."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    mine = cpus[rank * num_threads:(rank + 1) * num_threads]
    return set(mine) if pin and len(mine) == num_threads else None


@dataclass(frozen=True, slots=True)
class RandomWeights:
    """A model of random weights (models/shapes.random_model, benchmarks): each rank draws
    the same ones from the seed and keeps its share."""

    name: str
    config: ModelConfig
    seed: int
    tokenizer: Tokenizer


def rank_main(conn: Connection, share: ExpertShare, port: int, source: str | RandomWeights,
              config: EngineConfig) -> None:
    """A rank process's life: load its weights (its experts only), say ready on `conn`
    with a RankReport, join the groups, run steps until told to stop. It ends with rank 0's
    process (`conn` closes)."""
    exit_with_parent(conn, "minimill-experts-parent")
    # Rank 0 decides when this rank stops; a signal to the whole group must not end it first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("MINIMILL_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s experts rank {share.rank} %(levelname)s "
                               "%(message)s", stream=sys.stderr)
    cpus = rank_cpus(share.rank, config.num_threads or 1, config.pin_threads)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # the kernels' threads pin inside these
    try:
        runner, exchange, (weight_bytes, kv_bytes), experts = load_rank(source, config, share)
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", RankReport(os.getpid(), weight_bytes, kv_bytes, experts)))
    serve_rank(runner, exchange, link.join(share.rank, share.num_ranks, port), "127.0.0.1")


def load_rank(source: str | RandomWeights, config: EngineConfig, share: ExpertShare,
              check: Callable[[ModelConfig], None] | None = None, auto_pull: bool = False
              ) -> tuple[ModelRunner, ExpertExchange, tuple[int, int], list[int]]:
    """A rank's model runner over its share of the weights, its exchange, what it holds
    (bytes of weights read, of its KV pool) and the routed experts it read. `check` sees the model's
    configuration before the runner is built (and may refuse it)."""
    from minimill.models.loader import load_model
    from minimill.models.shapes import random_model

    if isinstance(source, RandomWeights):
        loaded = random_model(source.name, source.config, config.torch_dtype,
                              source.tokenizer, source.seed, keep=share)
    else:
        loaded = load_model(source, config.torch_dtype, keep=share, auto_pull=auto_pull)
    if check is not None:
        check(loaded.config)
    names = list(loaded.weights)
    weight_bytes = int(loaded.extra.get("loaded_bytes") or sum(
        t.numel() * t.element_size() for t in loaded.weights.values()))
    exchange = ExpertExchange(share)
    runner = ModelRunner(config, loaded, exchange=exchange)
    loaded.weights.clear()
    kv_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    return runner, exchange, (weight_bytes, kv_bytes), experts_read(names)


def serve_rank(runner: ModelRunner, exchange: ExpertExchange, groups: link.Groups,
               address: str) -> None:
    """Run rank 0's steps on this rank's share until it says stop (`address`: this
    process's, where the other ranks reach it)."""
    exchange.group = experts_group(groups.rank, groups.world_size, groups.store, address)
    try:
        _run_steps(runner, exchange, groups)
    except Exception:
        # Its exchanges are out of step with the others': nothing can go on.
        log.exception("expert-parallel rank %d: a step failed", groups.rank)
        os._exit(1)
    exchange.group = None
    groups.forward = groups.back = groups.store = None


def experts_group(rank: int, num_ranks: int, store: Any, address: str = "127.0.0.1") -> Any:
    """The ranks' group for the experts' exchanges, beside pipeline_link's two, listening
    at this process's `address` as theirs do."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = link.IDLE_TIMEOUT
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(dist.PrefixStore("experts", store), rank, num_ranks, options)


def _run_steps(runner: ModelRunner, exchange: ExpertExchange, groups: link.Groups) -> None:
    back = link.Sender(groups.back, 0)
    while True:
        kind, step, _ = link.receive(groups.forward, 0)
        if kind == link.STOP:
            back.finish()
            return
        assert isinstance(step, ExpertStep)
        back.send(link.STEP, None, run_share(runner, exchange, step))


