"""Which requests run this step and with how many tokens; token-level stop checks after it.

Every request is "num_computed_tokens of num_tokens": a new prompt, a chunk of a long prompt, a
decode and a recompute after preemption are all "compute the next n tokens". Running requests
go first (oldest first), then waiting ones fill what is left of the token budget. When the KV
pool is short, the most recently admitted running request is preempted: its blocks are freed
and it goes back to the front of the queue to be recomputed later.

A waiting request whose next uncached block is a block some running request is computing
right now (requests sharing a system prompt, arriving together) waits a step and then finds
it in the prefix cache, rather than computing the same prefix alongside.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minimill.engine.block_manager import BlockManager
from minimill.engine.config import EngineConfig
from minimill.engine.params import TokenLogprob
from minimill.engine.sequence import RequestStatus, Sequence
from minimill.engine.window_pool import WindowLayout

if TYPE_CHECKING:
    from minimill.engine.guided import StepMasks
    from minimill.engine.kv_tiers import KvTiers


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens whose KV this step computes, from seq.num_computed_tokens on
    sample: bool  # True when this step reaches the sequence's last token: sample the next
    # A guided sample's allowed tokens: row `mask_row` of `masks` (engine/guided.py).
    masks: StepMasks | None = None
    mask_row: int = 0


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence]  # what the model runner computes, in this order
    num_batched_tokens: int  # sum of num_new_tokens
    preempted: list[str] = field(default_factory=list)  # request ids sent back to waiting

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class ModelOutput:
    """What the model runner returns: one sampled token per scheduled sequence with sample=True."""

    sampled_token_ids: list[int]  # in the order of the sampling sequences in `scheduled`
    # Per sampled token: (logprob of the token, [(token_id, logprob), ...] top alternatives),
    # or None where the request did not ask for logprobs.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]
    # Embedding requests (params.embed) that reached their last prompt token: request id ->
    # pooled, normalised vector. They sample nothing, so they are not in the lists above.
    embeddings: dict[str, list[float]] = field(default_factory=dict)


# A lane gives requests to a less busy one only when they differ by at least this many: a
# small difference evens out as requests finish, and moving requests for it would only
# shuffle rows between GEMM calls.
LANE_REBALANCE_MIN = 16


class Scheduler:
    """Decides each step's batch; the engine calls schedule, runs it, then update_from_output."""

    def __init__(self, config: EngineConfig, tiers: KvTiers | None = None,
                 window_layout: WindowLayout | None = None) -> None:
        """`window_layout`: the pool's layout of a model with sliding-window and full
        layers (window_pool.py)."""
        assert config.num_kv_blocks is not None and config.max_model_len is not None
        self.config = config
        self.max_model_len = config.max_model_len
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching, tiers,
                                          int4_staging=config.kv_dtype == "int4",
                                          stage_units_per_block=config.stage_units_per_block,
                                          window=window_layout,
                                          max_chunk=config.max_num_batched_tokens)
        # request_id -> hashes of the full prompt blocks it is computing (not cached yet).
        self._inflight: dict[str, list[int]] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0  # since start, for tests and stats
        self.max_num_running = 0  # most requests running in one step, since start (or reset)
        # Requests running, summed over steps, and steps: their mean (benchmarks; reset freely).
        self.running_seq_steps = 0
        self.num_steps = 0
        self.num_cached_tokens_total = 0  # prompt tokens found in the prefix cache, since start

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add_request(self, seq: Sequence) -> None:
        """Called when a request is admitted (already validated)."""
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def abort_request(self, request_id: str) -> Sequence | None:
        """Called when the caller cancels; frees the request's blocks. Unknown ids are ignored."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> Sequence | None:
        """Called by the engine for stops found outside the scheduler (stop strings, errors)."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        if seq.status == RequestStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = status
        self._inflight.pop(request_id, None)
        self.block_manager.free(seq)
        return seq

    def schedule(self, lane: int | None = None, lanes: int = 1) -> SchedulerOutput:
        """Called once per step: pick requests and token counts within budget and KV memory.

        With `lane` (one of `lanes`, core.py), a step of that lane alone: its running
        requests, new ones admitted into it, each within the lane's share of the budgets;
        requests of other lanes (which may be running on another core right now) are left
        as they are."""
        budget = self.config.max_num_batched_tokens
        max_seqs = self.config.max_num_seqs
        if lane is None:
            mine = self.running
        else:
            budget, max_seqs = max(1, budget // lanes), max(1, max_seqs // lanes)
            mine = self._lane_running(lane, lanes)
        scheduled: list[ScheduledSequence] = []
        preempted: list[str] = []
        step_budget = budget
        i = 0
        while i < len(mine) and budget > 0:
            seq = mine[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = mine.pop()
                if mine is not self.running:
                    self.running.remove(victim)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    break
            else:
                scheduled.append(self._entry(seq, num_new))
                budget -= num_new
                i += 1
        # Admit new work only when nothing had to give way this step.
        bm = self.block_manager
        inflight = {h for hashes in self._inflight.values() for h in hashes}
        deferred: list[Sequence] = []
        while (self.waiting and budget > 0 and not preempted and len(mine) < max_seqs
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            cached = bm.find_prefix(seq)
            hashes = bm.pending_hashes(seq)[cached.num_blocks:] if bm.enable_prefix_caching \
                else []
            if hashes and hashes[0] in inflight:
                deferred.append(self.waiting.popleft())  # next step it is a cache hit
                continue
            num_cached = cached.num_blocks * self.config.block_size
            num_prompt = seq.num_tokens - num_cached
            num_new = min(num_prompt, budget)
            # The whole prompt must fit, not only this step's chunk: one admitted in part
            # would make room for its next chunk by preempting (itself, at worst), and
            # without prefix reuse every chunk computed before is lost, so under memory
            # pressure long prompts would be recomputed again and again.
            if num_new < num_prompt and not bm.can_allocate(seq, num_prompt, cached):
                break
            if not bm.allocate_slots(seq, num_new, cached):
                break
            self.waiting.popleft()
            self.num_cached_tokens_total += num_cached
            if seq.status == RequestStatus.WAITING:  # first admission: what the client sees
                seq.num_cached_prompt_tokens = min(num_cached, seq.num_prompt_tokens)
            if hashes:
                self._inflight[seq.request_id] = hashes
                inflight.update(hashes)
            seq.status = RequestStatus.RUNNING
            seq.lane = -1 if lane is None else lane
            self.running.append(seq)
            if mine is not self.running:
                mine.append(seq)
            scheduled.append(self._entry(seq, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))
        self.max_num_running = max(self.max_num_running, len(self.running))
        self.running_seq_steps += len(self.running)
        self.num_steps += 1
        return SchedulerOutput(scheduled, step_budget - budget, preempted)

    def _lane_running(self, lane: int, lanes: int) -> list[Sequence]:
        """The running requests of `lane`, oldest first. Requests admitted while no lanes
        ran are dealt out to the lanes; and when nothing waits, a lane that holds more than
        another gives it the difference's half of its newest (the lanes' cores finish
        together; each runs while the other does)."""
        counts = [0] * lanes
        for seq in self.running:
            if not 0 <= seq.lane < lanes:
                seq.lane = min(range(lanes), key=counts.__getitem__)
            counts[seq.lane] += 1
        mine = [seq for seq in self.running if seq.lane == lane]
        other = min(range(lanes), key=counts.__getitem__)
        surplus = (counts[lane] - counts[other]) // 2
        if not self.waiting and counts[lane] - counts[other] >= LANE_REBALANCE_MIN:
            for seq in mine[-surplus:]:
                seq.lane = other
            del mine[-surplus:]
        return mine

    def update_from_output(self, output: SchedulerOutput,
                           model_output: ModelOutput) -> list[Sequence]:
        """Called after the model ran: advance computed counts, append sampled tokens, apply
        token-level stops (eos, stop ids, max_tokens, context length). Returns the sequences
        that got a new token (finished ones included, already freed)."""
        updated: list[Sequence] = []
        sampled = iter(zip(model_output.sampled_token_ids, model_output.logprobs, strict=True))
        for entry in output.scheduled:
            seq = entry.seq
            seq.num_computed_tokens += entry.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
            if entry.sample:
                self._inflight.pop(seq.request_id, None)  # its prompt blocks are cached now
            if not entry.sample:
                continue
            if seq.params.embed:  # prefill done: its vector is its whole output
                seq.embedding = model_output.embeddings[seq.request_id]
                updated.append(seq)
                self.finish_request(seq.request_id, RequestStatus.FINISHED_STOPPED)
                continue
            token_id, logprob = next(sampled)
            seq.append_token(token_id)
            if logprob is not None:
                seq.logprobs.append(TokenLogprob(token_id, logprob[0], logprob[1]))
            updated.append(seq)
            status = self._token_stop(seq, token_id)
            if status is not None:
                self.finish_request(seq.request_id, status)
        return updated

    def _token_stop(self, seq: Sequence, token_id: int) -> RequestStatus | None:
        if token_id in seq.eos_token_ids or token_id in seq.params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _entry(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        sample = seq.num_computed_tokens + num_new == seq.num_tokens
        return ScheduledSequence(seq, num_new, sample)

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self._inflight.pop(seq.request_id, None)
        self.block_manager.free(seq)
        seq.status = RequestStatus.PREEMPTED
        seq.lane = -1
        self.waiting.appendleft(seq)
