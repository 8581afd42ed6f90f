"""A pipeline stage after the first: a process holding one range of decoder layers, their
weights and their KV pool (as many blocks as stage 0's, the same block ids), that runs
each microbatch it receives through its layers and passes it on; the last stage also norms,
projects and samples, and sends the tokens back to stage 0 (pipeline_runner.py).

Steps arrive in order and leave in order, so a stage needs no bookkeeping of requests: a
step's description (StepWork) carries its sequences' lengths, block tables and, for the last
stage, what sampling needs. A stage's send of one microbatch overlaps its work on the next.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from minimill.engine import pipeline_link as link
from minimill.engine.config import EngineConfig
from minimill.engine.memory_budget import StageWeights
from minimill.engine.params import SamplingParams
from minimill.engine.peers import exit_with_parent
from minimill.models.types import ModelConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepWork:
    """One microbatch, as the stages after the first need it (in the step's order)."""

    query_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # tokens of KV per sequence after the step
    tables: list[list[int]]  # block tables
    logits_rows: list[int]  # rows (into the step's tokens) that sample
    # Per sampling row, for the last stage's sampler:
    params: list[SamplingParams]
    seeds: list[int]
    output_indices: list[int]  # the output position each row samples
    output_counts: list[dict[int, int] | None]  # tokens so far (penalties only)
    # Guided rows' allowed-token bitmasks (int32 words as bytes; None: unconstrained), or
    # None when no row is guided.
    masks: list[bytes | None] | None = None
    # Embedding requests at their last prompt token: sampling row -> request id (their rows
    # are pooled, not sampled).
    embed_ids: dict[int, str] = field(default_factory=dict)
    # int4 KV: each sequence's staging units (kv_int4.py), as stage 0's block manager holds
    # them; every stage's staging pool has the same units for its own layers.
    stage_units: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)
class StepFailed:
    """A stage could not run a microbatch: the stages after it pass this on, stage 0 fails
    the microbatch's requests (the engine lives on)."""

    message: str


def positions_of(query_lens: list[int], seq_lens: list[int]) -> list[int]:
    out: list[int] = []
    for q, n in zip(query_lens, seq_lens, strict=True):
        out.extend(range(n - q, n))
    return out


def pin_to(cpu: int | None) -> None:
    """Run this thread (and the kernels' threads it starts) on one core."""
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


def stage_main(conn: Connection, rank: int, world_size: int, port: int, source: str,
               config: EngineConfig, keep: StageWeights, cpu: int | None) -> None:
    """A stage process's life: load its layers' weights (only those, where the checkpoint
    can be read by tensor), say ready on `conn` with its pid and the bytes it holds (weights
    read, KV pool), join the groups, run steps until told to stop. It ends with stage 0's
    process (`conn` closes)."""
    exit_with_parent(conn, "minimill-stage-parent")
    # Stage 0 decides when this stage stops; a signal to the whole group must not end it
    # first (it dies with its parent all the same).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("MINIMILL_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s stage {rank} %(levelname)s %(message)s",
                        stream=sys.stderr)
    pin_to(cpu)
    try:
        runner, memory = load_stage(source, config, keep)
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", os.getpid(), memory))
    groups = link.join(rank, world_size, port)
    StageLoop(runner, groups).run()


def load_stage(source: str, config: EngineConfig, keep: StageWeights,
               check: Callable[[ModelConfig], None] | None = None, auto_pull: bool = False
               ) -> tuple[Any, tuple[int, int]]:
    """A stage's model runner over only its own weights, and what it holds: (bytes of
    weights read, bytes of its KV pool). `check` sees the model's configuration before the
    runner is built (and may refuse it)."""
    from minimill.engine.model_runner import ModelRunner
    from minimill.models.loader import load_model

    loaded = load_model(source, config.torch_dtype, keep=keep, auto_pull=auto_pull)
    if check is not None:
        check(loaded.config)
    if config.max_memory_gb is not None:
        # The budget counts one copy of each weight: the engine takes them over.
        loaded.extra["release_weights"] = True
    weight_bytes = int(loaded.extra.get("loaded_bytes") or sum(
        t.numel() * t.element_size() for t in loaded.weights.values()))
    runner = ModelRunner(config, loaded, keep.layers)
    loaded.weights.clear()
    return runner, (weight_bytes, runner.kv_cache.numel() * runner.kv_cache.element_size())


class StageLoop:
    """Receive, compute, send on: one stage's steps."""

    def __init__(self, runner: Any, groups: link.Groups) -> None:
        self.runner = runner
        self.groups = groups
        self.rank = groups.rank
        self.is_last = groups.rank == groups.world_size - 1
        self.stats = link.StageStats(groups.rank)
        if self.is_last:
            self.out = link.Sender(groups.back, 0)
        else:
            self.out = link.Sender(groups.forward, groups.rank + 1)

    def run(self) -> None:
        while True:
            kind, obj, raw = link.receive(self.groups.forward, self.rank - 1, self.stats)
            if kind == link.STOP:
                self.out.send(link.STOP)
                self.out.finish()
                return
            if kind == link.STATS:
                reset, gathered = obj
                gathered.append(self.stats.per_step())
                if reset:
                    self.stats = link.StageStats(self.rank)
                self.out.send(link.STATS, (reset, gathered))
                continue
            if isinstance(obj, StepFailed):
                self.out.send(link.STEP, obj)
                continue
            started = time.perf_counter()
            try:
                result = self.step(obj, raw)
            except Exception as exc:  # this microbatch fails; the pipeline goes on
                log.exception("stage %d: a step failed", self.rank)
                result = (StepFailed(f"pipeline stage {self.rank}: {exc}"), None)
            self.stats.compute_s += time.perf_counter() - started
            self.stats.steps += 1
            self.out.send(link.STEP, result[0], result[1], self.stats)

    @torch.inference_mode()
    def step(self, work: StepWork, raw: torch.Tensor | None) -> tuple[object, torch.Tensor | None]:
        from minimill.engine.sampler import sample
        from minimill.engine.scheduler import ModelOutput

        runner, model = self.runner, self.runner.model
        assert raw is not None
        num_tokens = sum(work.query_lens)
        states = raw.view(runner.config.torch_dtype).view(2, num_tokens, -1)
        hidden, residual = states[0], states[1]
        dev = runner.device
        meta = runner.metadata(work.query_lens, work.seq_lens, work.tables,
                               work.stage_units or [[] for _ in work.query_lens])
        positions = torch.tensor(positions_of(work.query_lens, work.seq_lens),
                                 dtype=torch.long, device=dev)
        hidden, residual = model.run_layers(hidden.to(dev), residual.to(dev), positions, meta,
                                            runner.kv_cache)
        if not self.is_last:
            assert residual is not None
            return work, torch.stack([hidden, residual]).cpu()
        pooled = sorted(work.embed_ids)
        if not set(pooled) <= set(range(len(work.params))):
            raise ValueError(f"embedding rows {pooled} out of the step's "
                             f"{len(work.params)} sampling rows")
        logits = model.head(hidden, residual,
                            torch.tensor(work.logits_rows, dtype=torch.long, device=dev),
                            hidden_only=bool(pooled))
        embeddings: dict[str, list[float]] = {}
        rows = list(range(len(work.params)))
        if pooled:
            # As one process pools them (model_runner.py): the final normed hidden state of
            # the last prompt token, L2-normalised; the other rows are projected after.
            vectors = torch.nn.functional.normalize(logits[pooled].float(), dim=-1)
            embeddings = {work.embed_ids[k]: v
                          for k, v in zip(pooled, vectors.cpu().tolist(), strict=True)}
            rows = [k for k in rows if k not in work.embed_ids]
            logits = model.project(logits[rows]) if rows else logits[:0]
        if not rows:
            return ModelOutput([], [], embeddings), None
        masks = None if work.masks is None else [
            None if (words := work.masks[k]) is None else _mask_words(words, logits.shape[-1])
            for k in rows]
        tokens, logprobs = sample(logits, [work.params[k] for k in rows],
                                  [work.seeds[k] for k in rows],
                                  [work.output_indices[k] for k in rows], runner.kernels,
                                  [work.output_counts[k] for k in rows], masks)
        return ModelOutput(tokens, logprobs, embeddings), None


def _mask_words(raw: bytes, vocab_size: int) -> torch.Tensor:
    """A guided row's bitmask from the wire, refused unless it covers the vocabulary exactly
    (the sampler reads every word)."""
    from minimill.engine.guided import mask_words

    if len(raw) != 4 * mask_words(vocab_size):
        raise ValueError(f"a guided row's bitmask of {len(raw)} bytes, not "
                         f"{4 * mask_words(vocab_size)}")
    return torch.frombuffer(bytearray(raw), dtype=torch.int32)
