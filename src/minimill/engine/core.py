"""The engine core: admission checks, and the step loop (schedule, execute, update, text).

Both front ends drive it: `LLM` (offline, in the caller's thread) and `AsyncEngine` (a
background thread). It is not thread-safe; each front end calls it from one thread.

Lanes (CPU, two cores or more): while at least LANE_MIN_REQUESTS per core are running,
each core runs its own steps over its own share of the requests, on its own clock. A step
split across cores (core_split.py) waits for its slower half, and on a shared 2-core VM
identical halves differ by 10-30% from step to step (a core lent to another process for a
moment, memory traffic); lanes never wait on each other. All bookkeeping (scheduling,
updates, text) stays on the caller's thread, one lane at a time: while a lane's model runs
on its core, the caller schedules and finishes the other's. A lane's requests are not
touched while its step runs (an abort then takes effect when the step ends). With fewer
requests, steps take the whole machine again (every core on one step). Results do not
depend on the lane: the kernels give the same numbers for a row whatever batch it is in.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import secrets
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from minimill.engine.busy_rate import BusyRate
from minimill.engine.config import EngineConfig
from minimill.engine.expert_dealer import deal_rank, rank_root
from minimill.engine.frontend import EngineLimits, check_tokens
from minimill.engine.guided import Guides, StepMasks
from minimill.engine.kv_tiers import KvTiers
from minimill.engine.model_runner import ModelRunner
from minimill.engine.output import OutputProcessor
from minimill.engine.params import (
    EngineDied,
    InvalidRequestError,
    SamplingParams,
    TokenDelta,
)
from minimill.engine.scheduler import ModelOutput, Scheduler, SchedulerOutput
from minimill.engine.sequence import RequestStatus, Sequence
from minimill.models.types import LoadedModel

# Lanes run while at least this many requests per core are running: below it a lane's
# GEMMs have too few rows to pay for every core reading every weight (core_split.py).
LANE_MIN_REQUESTS = 32


def make_tiers(config: EngineConfig, loaded: LoadedModel, block_shape: tuple[int, ...],
               dtype: torch.dtype) -> KvTiers | None:
    """The KV tiers the config asks for, or None; the layout says what a block's bytes are."""
    if not config.enable_prefix_caching or not (
            config.kv_host_bytes or (config.kv_flash_dir and config.kv_flash_bytes)):
        return None
    mc = loaded.config
    layout: dict[str, object] = {
        "model": config.model, "kv_dtype": config.kv_dtype, "block_size": config.block_size,
        "layers": mc.num_hidden_layers, "kv_heads": mc.num_key_value_heads,
        "head_dim": mc.head_dim, "hidden_size": mc.hidden_size, "vocab_size": mc.vocab_size,
        "rope_theta": mc.rope_theta, "block_shape": list(block_shape), "format": 1}
    tiers = KvTiers(layout, block_shape, dtype, config.kv_host_bytes, config.kv_flash_dir,
                    config.kv_flash_bytes)
    return tiers if tiers.enabled else None


def make_runner(config: EngineConfig, loaded: LoadedModel) -> ModelRunner:
    """The whole model here, stage 0 of a pipeline (pipeline_runner.py) or rank 0 of
    expert parallelism (expert_parallel.py)."""
    if config.expert_parallel > 1:
        from minimill.engine.expert_parallel import ExpertParallelRunner

        return ExpertParallelRunner(config, loaded)
    if config.pipeline_stages > 1:
        from minimill.engine.pipeline_runner import PipelineRunner

        return PipelineRunner(config, loaded)
    return ModelRunner(config, loaded)


@dataclass(slots=True)
class StepResult:
    deltas: list[TokenDelta] = field(default_factory=list)
    # Requests that failed this step (ended, blocks freed), with the reason.
    failures: dict[str, BaseException] = field(default_factory=dict)


class EngineCore:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.runner = make_runner(config, loaded)
        self.tiers = make_tiers(config, loaded, tuple(self.runner.kv_cache.shape[1:]),
                                self.runner.kv_cache.dtype)
        self.scheduler = Scheduler(config, self.tiers, self.runner.window_layout)
        self.outputs = OutputProcessor(loaded.tokenizer)
        eos = set(loaded.config.eos_token_ids)
        if loaded.tokenizer.eos_token_id is not None:
            eos.add(loaded.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = loaded.config.vocab_size
        self.guides = Guides(loaded.tokenizer, self.vocab_size, self.eos_token_ids)
        self._pending: list[TokenDelta] = []  # finished at admission (resumed past max_tokens)
        self._busy_rate = BusyRate()
        self._lane_started: dict[int, float] = {}  # lane -> when its running step started
        # Steps that ran the model, and the sequences they ran: their ratio is the mean batch.
        self.num_steps = 0
        self.num_step_seqs = 0
        # Lanes whose step is running on their core: lane -> what it runs.
        self._in_flight: dict[int, SchedulerOutput] = {}
        self._lane_done: queue.SimpleQueue[tuple[int, bool, object]] = queue.SimpleQueue()
        # Aborted while their lane's step ran: finished when it ends.
        self._aborted_in_flight: set[str] = set()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._pending)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams,
                    resume_token_ids: Seq[int] = (), resume_text: str | None = None
                    ) -> tuple[int, str]:
        """Validate and queue a request; returns its seed (drawn here when params has none)
        and the text counted as already handed out for `resume_token_ids`.

        `resume_text` is the text a checkpoint handed out for the resumed tokens (it may stop
        short of their decoding: a held-back stop-string prefix, a split character); the
        deltas continue from it exactly as the uninterrupted request's would have.
        """
        prompt, resume = list(prompt_token_ids), list(resume_token_ids)
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        self.check_request(prompt, resume)
        guide = self.guides.start(params.guided, resume) if params.guided is not None else None
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = Sequence(request_id, prompt, params, seed, self.eos_token_ids, resume)
        seq.guide = guide
        if self.config.expert_parallel > 1:
            seq.rank = deal_rank(self.scheduler.requests.values(), self.config.expert_parallel)
            seq.prefix_root = rank_root(seq.prefix_root, seq.rank)
        handed_out = self.outputs.add_request(seq, resume_text)
        done = (RequestStatus.FINISHED_LENGTH if len(resume) >= params.max_tokens
                else RequestStatus.FINISHED_STOPPED if guide is not None and guide.finished
                else None)
        if done is not None:
            # The checkpoint already holds every token asked for, or a complete output.
            seq.status = done
            self._pending.append(self.outputs.delta(seq, [], seq.status.finish_reason, None))
            self.outputs.remove(request_id)
            return seed, handed_out
        self.scheduler.add_request(seq)
        return seed, handed_out

    @property
    def limits(self) -> EngineLimits:
        """The sizes front ends check requests against before they reach the step loop."""
        assert self.config.max_model_len is not None
        return EngineLimits(self.config.max_num_seqs, self.config.max_model_len,
                            self.vocab_size)

    def check_request(self, prompt: list[int], resume: list[int]) -> None:
        """Raise InvalidRequestError for a request this engine cannot run (any thread)."""
        check_tokens(prompt, resume, self.limits)

    def abort_request(self, request_id: str) -> TokenDelta | None:
        """End a request now; returns its final delta (None if it was not running)."""
        if request_id in self._aborted_in_flight:
            return None
        if any(e.seq.request_id == request_id for out in self._in_flight.values()
               for e in out.scheduled):
            # Its lane's step is writing its KV: the blocks are freed when the step ends.
            running = self.scheduler.requests[request_id]
            self._aborted_in_flight.add(request_id)
            delta = self.outputs.delta(running, [],
                                       RequestStatus.FINISHED_ABORTED.finish_reason, None)
            self.outputs.remove(request_id)
            return delta
        seq = self.scheduler.abort_request(request_id)
        if seq is None:
            return None
        delta = self.outputs.delta(seq, [], seq.status.finish_reason, None)
        self.outputs.remove(request_id)
        return delta

    def step(self) -> StepResult:
        """One engine step: schedule, run the model, update requests, produce deltas. With
        lanes, the step of whichever lane finishes next (the others keep running)."""
        result = StepResult(self._pending)
        self._pending = []
        lanes = self._lanes_wanted()
        if lanes:
            self._start_lanes(lanes)
            if self._in_flight:
                self._finish_lane(*self._lane_done.get(), result)
                self._start_lanes(lanes)
            return result
        self.drain_lanes(result)
        started = time.monotonic()
        scheduled = self.scheduler.schedule()
        self._move_blocks()
        if scheduled.is_empty:
            return result
        masks = self._attach_masks(scheduled)
        if masks is not None:
            masks.fill()
        try:
            model_output = self.runner.execute(scheduled)
        except EngineDied:
            raise  # nothing more can step: the front end stops the engine
        except Exception as exc:  # the batch failed: fail its requests, keep the engine alive
            for entry in scheduled.scheduled:
                self._fail(entry.seq.request_id, exc, result)
            return result
        self._finish_step(scheduled, model_output, result, started)
        return result

    def _finish_step(self, scheduled: SchedulerOutput, model_output: ModelOutput,
                     result: StepResult, started: float) -> None:
        self.num_steps += 1
        self.num_step_seqs += len(scheduled.scheduled)
        updated = self.scheduler.update_from_output(scheduled, model_output)
        self._write_through()
        for seq in updated:
            if seq.request_id in self._aborted_in_flight:
                continue
            if seq.guide is not None and not self._advance_guide(seq, result):
                continue
            try:
                result.deltas.append(self._process(seq))
            except Exception as exc:  # one request's text processing failed: only it ends
                self._fail(seq.request_id, exc, result)
        # Output tokens: an embedding request's vector is none.
        self._busy_rate.record(started, time.monotonic(),
                               sum(1 for seq in updated if not seq.params.embed))

    def _lanes_wanted(self) -> int:
        """How many lanes to step now: 0 for steps over the whole machine."""
        if self.runner.pipelined:
            return self.runner.num_lanes  # one microbatch per stage, however few requests
        lanes = self.runner.num_lanes if self.config.lanes else 0
        # By what runs, not what waits: with a small KV pool only a few requests fit at once.
        # Lanes stay a little below the count that starts them, so that a few requests
        # finishing do not switch back and forth.
        running = len(self.scheduler.running)
        least = lanes * LANE_MIN_REQUESTS * (3 if self._in_flight else 4) // 4
        return lanes if lanes and running >= least else 0

    def _start_lanes(self, lanes: int) -> None:
        """Schedule each lane whose core is free and start its step there."""
        for lane in range(lanes):
            if lane in self._in_flight:
                continue
            scheduled = self.scheduler.schedule(lane, lanes)
            self._move_blocks()
            if scheduled.is_empty:
                continue
            started = time.monotonic()
            masks = self._attach_masks(scheduled)
            # In flight once started (a pipeline whose stage died refuses to start it): the
            # report comes through _lane_done, read on this thread, never before this.
            self.runner.start(scheduled, lane, lanes, functools.partial(self._report, lane))
            self._in_flight[lane] = scheduled
            self._lane_started[lane] = started
            if masks is not None:
                masks.fill()  # while the lane's forward pass runs; it waits only to sample

    def _attach_masks(self, scheduled: SchedulerOutput) -> StepMasks | None:
        """The step's guided samples get a row of one bitmask, to be filled (guided.py)."""
        entries = [e for e in scheduled.scheduled if e.sample and e.seq.guide is not None]
        if not entries:
            return None
        masks = StepMasks([e.seq.guide for e in entries if e.seq.guide is not None],
                          self.vocab_size)
        for row, entry in enumerate(entries):
            entry.masks, entry.mask_row = masks, row
        return masks

    def _advance_guide(self, seq: Sequence, result: StepResult) -> bool:
        """Feed a guided request's new token to its grammar: a complete output ends the
        request, a refused token fails it. False when the request failed."""
        assert seq.guide is not None
        if not seq.guide.accept(seq.token_ids[-1]):
            self._fail(seq.request_id, InvalidRequestError(
                f"the output left its schema or tools: {seq.guide.error or 'refused token'}"),
                result)
            return False
        if seq.guide.finished and not seq.status.is_finished:
            self.scheduler.finish_request(seq.request_id, RequestStatus.FINISHED_STOPPED)
        return True

    def _report(self, lane: int, ok: bool, value: object) -> None:
        """Called on the lane's core when its step ends (the caller's thread finishes it)."""
        self._lane_done.put((lane, ok, value))

    def _finish_lane(self, lane: int, ok: bool, value: object, result: StepResult) -> None:
        scheduled = self._in_flight.pop(lane)
        started = self._lane_started.pop(lane)
        if ok:
            assert isinstance(value, ModelOutput)
            self._finish_step(scheduled, value, result, started)
        elif isinstance(value, EngineDied):
            raise value  # nothing more can step: the front end stops the engine
        else:  # the lane's batch failed: fail its requests, keep the engine alive
            assert isinstance(value, BaseException)
            for entry in scheduled.scheduled:
                if entry.seq.request_id not in self._aborted_in_flight:
                    self._fail(entry.seq.request_id, value, result)
        for entry in scheduled.scheduled:
            request_id = entry.seq.request_id
            if request_id in self._aborted_in_flight:
                self._aborted_in_flight.discard(request_id)
                self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def drain_lanes(self, result: StepResult | None = None) -> None:
        """Wait for every lane's running step and finish it (its deltas go to `result`)."""
        while self._in_flight:
            self._finish_lane(*self._lane_done.get(), result or StepResult())

    def _move_blocks(self) -> None:
        """Copy evicted blocks down a tier, then restored ones back, before the model runs."""
        saves, loads = self.scheduler.block_manager.take_transfers()
        if self.tiers is None:
            return
        kv = self.runner.kv_cache
        for block_id, block_hash, token_ids in saves:
            self.tiers.put(block_hash, token_ids, kv[block_id])
        if loads:
            started = time.perf_counter()
            for block_id, block in loads:
                kv[block_id].copy_(block)
            self.tiers.stats.restored_blocks += len(loads)
            self.tiers.stats.restore_s += time.perf_counter() - started

    def _write_through(self) -> None:
        """Send the blocks this step filled to the flash tier (written in the background)."""
        fresh = self.scheduler.block_manager.take_new_full_blocks()
        if self.tiers is None or not fresh:
            return
        kv = self.runner.kv_cache
        for block_id, block_hash, token_ids in fresh:
            self.tiers.persist(block_hash, token_ids, kv[block_id])

    def close(self) -> None:
        """Write what the pool holds to the flash tier and finish writing: a restarted engine
        finds every prefix this one had computed (unless the process is killed first)."""
        try:
            with contextlib.suppress(EngineDied):  # its steps ended with its pipeline
                self.drain_lanes()
        finally:
            self.runner.close()
        if self.tiers is None:
            return
        kv = self.runner.kv_cache
        for block_id, block_hash, token_ids in self.scheduler.block_manager.cached_blocks():
            self.tiers.persist(block_hash, token_ids, kv[block_id])
        self.tiers.close()

    def recent_output_tok_s(self) -> float:
        """Output tokens per busy second over the last few tens of seconds (busy_rate.py)."""
        return self._busy_rate.tokens_per_s()

    def _process(self, seq: Sequence) -> TokenDelta:
        state = self.outputs.texts[seq.request_id]
        num_before = state.num_emitted_tokens
        stopped_by_string = self.outputs.process(seq)
        if stopped_by_string:
            if seq.status.is_finished:
                seq.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_request(seq.request_id, RequestStatus.FINISHED_STOPPED)
        new_ids = seq.token_ids[seq.num_prompt_tokens + num_before:]
        wants_logprobs = seq.params.logprobs or seq.params.top_logprobs > 0
        logprobs = seq.logprobs[-len(new_ids):] if wants_logprobs and new_ids else None
        reason = seq.status.finish_reason
        delta = self.outputs.delta(seq, new_ids, reason, logprobs, stopped_by_string)
        if reason is not None:
            self.outputs.remove(seq.request_id)
        return delta

    def _fail(self, request_id: str, exc: BaseException, result: StepResult) -> None:
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self.outputs.remove(request_id)
        result.failures[request_id] = exc
