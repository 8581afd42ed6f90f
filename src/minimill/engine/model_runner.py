"""Turns a SchedulerOutput into tensors, runs the model, samples: `execute() -> ModelOutput`.

Owns the device, the weights (through DecoderModel), the kernels and the KV cache tensor.
Tokens are laid out in the scheduler's order; attention reads each sequence's KV through its
block table, so no reordering or grouping is needed.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from minimill.engine.attention import AttentionMetadata, allocate_kv_cache, build_metadata
from minimill.engine.config import EngineConfig
from minimill.engine.core_split import CoreWorkers, core_workers, plan_groups
from minimill.engine.expert_share import ExpertExchange
from minimill.engine.kernels import select_kernels
from minimill.engine.kv_int4 import int4_step, stage_view
from minimill.engine.memory import keep_freed_memory
from minimill.engine.model import DecoderModel
from minimill.engine.sampler import sample
from minimill.engine.scheduler import ModelOutput, ScheduledSequence, SchedulerOutput
from minimill.engine.window_pool import WindowBlock, group_tables
from minimill.models.types import LoadedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step computed, for yardsticks (bench/sol.py): the work, not the time."""

    num_tokens: int  # rows through every linear layer
    num_logits: int  # rows through the vocabulary projection
    num_seqs: int
    kv_tokens: int  # sum of the sequences' KV lengths: each is read at least once per layer
    attended_pairs: int  # (query, key) pairs attention scores, over all sequences
    # Lanes stepping at once (core.py): a lane's step had one core of this many; 1 for a
    # step that had the whole machine.
    lanes: int = 1


@dataclass(slots=True)
class StepInputs:
    """A step's tokens laid out for the model, in the scheduler's order."""

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]  # tokens of KV after the step
    tables: list[list[int]]
    stage_units: list[list[int]]
    logits_rows: list[int]  # rows (into the step's tokens) that sample or pool
    window_tables: list[list[WindowBlock | None]]  # window_pool.py


def step_inputs(entries: list[ScheduledSequence]) -> StepInputs:
    inputs = StepInputs([], [], [], [], [], [], [], [])
    for e in entries:
        seq = e.seq
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + e.num_new_tokens
        inputs.input_ids.extend(seq.token_ids[start:end])
        inputs.positions.extend(range(start, end))
        inputs.query_lens.append(e.num_new_tokens)
        inputs.seq_lens.append(end)
        inputs.tables.append(seq.block_table)
        inputs.stage_units.append(seq.stage_units)
        inputs.window_tables.append(seq.window_table)
        if e.sample:
            inputs.logits_rows.append(len(inputs.input_ids) - 1)
    return inputs


class ModelRunner:
    pipelined = False  # PipelineRunner (pipeline_runner.py): stages in other processes

    def __init__(self, config: EngineConfig, loaded: LoadedModel,
                 layers: range | None = None, exchange: ExpertExchange | None = None
                 ) -> None:
        """`layers`: a pipeline stage's share of the decoder (stage_plan.py); its weights and
        KV are all this runner holds. None: the whole model. `exchange`: an expert-parallel
        rank's (expert_share.py): its share of the routed experts, the rest over the ranks."""
        assert config.num_kv_blocks is not None and config.max_model_len is not None
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # before the weights, the pool and the core threads' arenas
        if self.device.type == "cpu" and config.num_threads:
            torch.set_num_threads(config.num_threads)
        mc = loaded.config
        self.model_config = mc
        self.kernels, self.kernels_reason = select_kernels(
            config.kernels, self.device, config.torch_dtype, config.block_size,
            None if mc.is_mla else mc.head_dim)
        pinned = self.kernels.pin_threads() if config.pin_threads else []
        log.info("engine: dtype %s (%s); KV %s, %d blocks of %d tokens; kernels %s (%s); "
                 "%d threads, pinned to CPUs %s", config.dtype, config.dtype_reason,
                 config.kv_dtype, config.num_kv_blocks, config.block_size, self.kernels.name,
                 self.kernels_reason, torch.get_num_threads(), pinned)
        self.model = DecoderModel(mc, loaded.weights, config.torch_dtype, self.device,
                                  config.max_model_len, self.kernels,
                                  release_weights=bool(loaded.extra.get("release_weights")),
                                  layers=layers,
                                  expert_ids=None if exchange is None else exchange.share.local,
                                  combine=exchange,
                                  with_head=exchange is None or exchange.share.holds_head)
        kv_parts, kv_heads, kv_dim = mc.kv_layout
        # With sliding-window and full layers, a block holds one group of layers
        # (window_pool.py): the model reads each layer at its (group, slot). A pipeline
        # stage's pool holds its own layers.
        self.window_layout = config.window_layout(mc)
        self.model.place_layers(self.window_layout)
        pool_layers = (config.pool_layers(mc) if self.window_layout is not None
                       else len(self.model.layer_range))
        self.kv_cache = allocate_kv_cache(config.num_kv_blocks, pool_layers, kv_heads,
                                          config.block_size, kv_dim, config.kv_torch_dtype,
                                          self.device, prefault=config.prefault_kv,
                                          kv_parts=kv_parts)
        # int4: open blocks are staged in pool blocks, seen through this int8 view.
        self.kv_stage: torch.Tensor | None = None
        if config.kv_dtype == "int4":
            self.kv_stage = stage_view(self.kv_cache, mc.head_dim)
        # Set to a list to record every step's shape (benchmarks); None costs nothing.
        self.step_log: list[StepShape] | None = None
        # CPU: big steps run as groups of sequences, one per core (core_split.py); not where
        # every step is a collective over processes (its groups would run them out of order).
        self.workers = (self._core_workers() if layers is None and exchange is None
                        else None)
        self.split_steps = 0  # steps run that way (tests, logs)
        self.lane_steps = 0  # steps run by one lane on its core (start())

    def close(self) -> None:
        """Release what outlives the engine (nothing here; stage processes for a pipeline)."""

    @property
    def num_lanes(self) -> int:
        """How many lanes (one per core) could step at once: 0 where steps are not split."""
        return len(self.workers.cpus) if self.workers is not None else 0

    def start(self, output: SchedulerOutput, lane: int, lanes: int,
              report: Callable[[bool, Any], None]) -> None:
        """Run one lane's step on the lane's core and return at once; the core calls
        report(True, ModelOutput) or report(False, exception) when it is done."""
        assert self.workers is not None
        if self.step_log is not None:
            self.step_log.append(self._shape(output.scheduled, lanes))
        self.lane_steps += 1
        self.workers.submit(lane, functools.partial(self._run, output.scheduled), report)

    def _core_workers(self) -> CoreWorkers | None:
        threads = torch.get_num_threads()
        if (self.device.type != "cpu" or not self.config.split_steps or threads < 2
                or self.kernels.name != "native-cpu" or not hasattr(os, "sched_getaffinity")):
            return None
        cpus = sorted(os.sched_getaffinity(0))[:threads]
        if len(cpus) < 2:
            return None
        return core_workers(cpus, self.config.pin_threads, self.kernels.init_thread)

    def _groups(self, entries: list[ScheduledSequence]) -> list[list[int]] | None:
        if self.workers is None:
            return None
        # Cost in rows through the linears; attention reads the KV (~1/1000 of a row's GEMM
        # time per token of KV at this model's shape); a sampled row adds the vocabulary
        # projection (~1/5 of a row through every layer).
        costs = [e.num_new_tokens + 0.2 * e.sample
                 + (e.seq.num_computed_tokens + e.num_new_tokens) / 1000 for e in entries]
        return plan_groups(costs, [e.num_new_tokens for e in entries], len(self.workers.cpus))

    @torch.inference_mode()
    def metadata(self, query_lens: list[int], seq_lens: list[int], tables: list[list[int]],
                 stage_units: list[list[int]],
                 window_tables: list[list[WindowBlock | None]] | None = None
                 ) -> AttentionMetadata:
        """The step's attention metadata over this runner's cache (an int4 cache also places
        the step's tokens in its staging units; each sliding group gets its own over
        `window_tables`, window_pool.py)."""
        block_size, dev = self.config.block_size, self.device
        int4 = None if self.kv_stage is None else int4_step(
            query_lens, seq_lens, tables, block_size, stage_units, self.kv_stage, dev)
        meta = build_metadata(query_lens, seq_lens, tables, block_size, dev, int4)
        if self.window_layout is not None:
            assert window_tables is not None
            meta.groups = [meta] + [
                build_metadata(query_lens, seq_lens, group_tables(window_tables, k),
                               block_size, dev)
                for k in range(self.window_layout.window_groups)]
        return meta

    def execute(self, output: SchedulerOutput) -> ModelOutput:
        """Compute the scheduled tokens' KV and sample for sequences that reached their end."""
        entries = output.scheduled
        if self.step_log is not None:
            self.step_log.append(self._shape(entries))
        groups = self._groups(entries)
        if groups is None:
            return self._run(entries)
        assert self.workers is not None
        parts = self.workers.map([functools.partial(self._run, [entries[i] for i in group])
                                  for group in groups])
        self.split_steps += 1
        # Back into the step's order: entry i's sample is the k-th of the step's samples.
        rank = {i: k for k, i in enumerate(i for i, e in enumerate(entries)
                                           if e.sample and not e.seq.params.embed)}
        out = ModelOutput([0] * len(rank), [None] * len(rank))
        for group, part in zip(groups, parts, strict=True):
            out.embeddings.update(part.embeddings)
            sampled = [rank[i] for i in group if i in rank]
            for k, token, logprob in zip(sampled, part.sampled_token_ids, part.logprobs,
                                         strict=True):
                out.sampled_token_ids[k], out.logprobs[k] = token, logprob
        return out

    @staticmethod
    def _shape(entries: list[ScheduledSequence], lanes: int = 1) -> StepShape:
        # A query at position p scores p + 1 keys; a chunk of q rows ending at n scores
        # q * n - q * (q - 1) / 2 pairs.
        rows = pairs = kv = logits = 0
        for e in entries:
            q, n = e.num_new_tokens, e.seq.num_computed_tokens + e.num_new_tokens
            rows, kv, logits = rows + q, kv + n, logits + e.sample
            pairs += q * n - q * (q - 1) // 2
        return StepShape(rows, logits, len(entries), kv, pairs, lanes)

    def _run(self, entries: list[ScheduledSequence]) -> ModelOutput:
        """Forward and sample these sequences (all of a step, or one core's group)."""
        inputs = step_inputs(entries)
        dev = self.device
        meta = self.metadata(inputs.query_lens, inputs.seq_lens, inputs.tables,
                             inputs.stage_units, inputs.window_tables)
        model = self.model
        hidden, residual = model.run_layers(
            model.embed_tokens(torch.tensor(inputs.input_ids, dtype=torch.long, device=dev)),
            None, torch.tensor(inputs.positions, dtype=torch.long, device=dev), meta,
            self.kv_cache)
        return self._finish(entries, hidden, residual,
                            torch.tensor(inputs.logits_rows, dtype=torch.long, device=dev))

    def _finish(self, entries: list[ScheduledSequence], hidden: torch.Tensor,
                residual: torch.Tensor | None, logits_rows: torch.Tensor) -> ModelOutput:
        """The step's end from its layers' output: the final norm and the logits of
        `logits_rows` (one per entry that samples, in the step's order), then pooling
        (embedding requests) and sampling."""
        ends = [e for e in entries if e.sample]
        pooled = [k for k, e in enumerate(ends) if e.seq.params.embed]
        logits = self.model.head(hidden, residual, logits_rows, hidden_only=bool(pooled))
        embeddings: dict[str, list[float]] = {}
        if pooled:
            # Last-token pooling: the final normed hidden state of each embedding request's
            # last prompt token, L2-normalised (the Qwen3-Embedding recipe).
            hidden = logits
            vectors = torch.nn.functional.normalize(hidden[pooled].float(), dim=-1)
            embeddings = {ends[k].seq.request_id: v for k, v in
                          zip(pooled, vectors.cpu().tolist(), strict=True)}
            rows = [k for k, e in enumerate(ends) if not e.seq.params.embed]
            logits = self.model.project(hidden[rows]) if rows else hidden[:0]
        sampled = [e for e in ends if not e.seq.params.embed]
        if not sampled:
            return ModelOutput([], [], embeddings)
        sampling = [e.seq for e in sampled]
        tokens, logprobs = sample(logits, [s.params for s in sampling],
                                  [s.seed for s in sampling],
                                  [s.num_output_tokens for s in sampling], self.kernels,
                                  [s.output_counts for s in sampling], sample_masks(sampled))
        return ModelOutput(tokens, logprobs, embeddings)


def sample_masks(sampled: list[ScheduledSequence]) -> list[torch.Tensor | None] | None:
    """Each sample's allowed-token bitmask (None: unconstrained), once the engine filled them
    (it does while the forward pass runs: engine/guided.py)."""
    if all(e.masks is None for e in sampled):
        return None
    out: list[torch.Tensor | None] = []
    for e in sampled:
        if e.masks is None:
            out.append(None)
            continue
        e.masks.ready.wait()
        out.append(e.masks.words[e.mask_row])
    return out
