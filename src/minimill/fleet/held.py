"""One lease a worker holds: its choices' progress, the task that generates them, its result.

Progress per choice starts from the lease's checkpoint and grows with every engine update. The
worker checkpoints only what is new since the control plane's last accepted checkpoint (a
delta, from the lengths the control plane holds); when the control plane asks for a resync it
sends the whole progress once. When every choice has finished the lease turns into a
`CompletionItem` (succeeded, or failed with an OpenAI error code).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from minimill.fleet.choices import BodyError, ChoiceJob, choice_jobs, resumed_token_count
from minimill.fleet.engines import EngineAdapter, EngineUnavailableError, JobError
from minimill.transport.protocol import (
    Checkpoint,
    CheckpointDelta,
    ChoiceDelta,
    ChoiceProgress,
    CompletionItem,
    ErrorInfo,
    HeartbeatItem,
    Lease,
    Usage,
)

log = logging.getLogger("minimill.worker")
# Floor under the checkpoint interval a lease asks for (the server's settings decide above it).
MIN_CHECKPOINT_INTERVAL_S = 0.02
# Rough bytes of one logprob entry on the wire, per alternative, for sizing requests.
_LOGPROB_BYTES = 60


@dataclass(frozen=True, slots=True)
class Lengths:
    """How much of one choice a checkpoint holds."""

    tokens: int = 0
    chars: int = 0
    logprobs: int = 0
    has_logprobs: bool = False
    finish_reason: str | None = None

    @classmethod
    def of(cls, choice: ChoiceProgress) -> Lengths:
        return cls(len(choice.token_ids), len(choice.text), len(choice.logprobs or []),
                   choice.logprobs is not None, choice.finish_reason)


@dataclass(frozen=True, slots=True)
class SentCheckpoint:
    """A checkpoint on its way: the lengths it extends and those it brings the choices to."""

    base: dict[int, Lengths]
    target: dict[int, Lengths]
    full: bool


def _approx_bytes(choice: ChoiceProgress, base: Lengths) -> int:
    """About how many bytes a choice's progress beyond `base` takes as JSON."""
    lps = choice.logprobs or []
    tops = len(lps[-1].get("top_logprobs") or []) if lps else 0
    return (64 + 2 * (len(choice.text) - base.chars) + 8 * (len(choice.token_ids) - base.tokens)
            + (len(lps) - base.logprobs) * _LOGPROB_BYTES * (1 + tops))


def approx_bytes(choices: list[ChoiceProgress]) -> int:
    """About how many bytes these choices take as JSON (to keep requests under the limit);
    an embedding's float32 values print as up to ~24 characters each."""
    return sum(_approx_bytes(c, Lengths()) + 24 * len(c.embedding or []) for c in choices)


class Tally:
    """Tokens the engine produced for this worker (resumed tokens not counted), all leases."""

    def __init__(self) -> None:
        self.generated_tokens = 0


class HeldLease:
    """State of one held lease; `run` generates every choice and sets `result`."""

    def __init__(self, lease: Lease, adapter: EngineAdapter, tally: Tally | None = None) -> None:
        self.lease = lease
        self.adapter = adapter
        self.tally = tally or Tally()
        # An embedding request resumes from nothing: its vectors are recomputed whole.
        resumed = lease.checkpoint.choices if lease.checkpoint and lease.kind != "embedding" \
            else []
        self.progress: dict[int, ChoiceProgress] = {c.index: c.model_copy(deep=True)
                                                   for c in resumed}
        self.num_tokens: dict[int, int] = {}
        self.num_prompt_tokens = lease.checkpoint.num_prompt_tokens if lease.checkpoint else 0
        self.num_cached_tokens = 0  # of the prompt, served from the engine's KV cache
        self.jobs: list[ChoiceJob] = []
        self.result: CompletionItem | None = None
        self.engine_failed = False  # the engine, not the request, failed: let the lease lapse
        self.task: asyncio.Task[None] | None = None
        self.dirty = False  # progress changed since the last checkpoint sent
        self.last_checkpoint_at = time.monotonic()
        self.checkpoint_interval_s = max(MIN_CHECKPOINT_INTERVAL_S, lease.checkpoint_interval_s)
        # What the control plane holds (the lease's own checkpoint to begin with); deltas
        # extend it. `needs_full`: it asked for the whole progress (a delta did not fit).
        self.acked: dict[int, Lengths] = {c.index: Lengths.of(c) for c in resumed}
        self.needs_full = False

    @property
    def request_id(self) -> str:
        return self.lease.request_id

    @property
    def resumed_tokens(self) -> int:
        """Tokens this lease's checkpoint already holds (0 for a fresh request)."""
        if self.lease.checkpoint is None:
            return 0
        return sum(len(c.token_ids) or (1 if c.text else 0)
                   for c in self.lease.checkpoint.choices)

    @property
    def num_running(self) -> int:
        """Sequences this lease occupies in the engine (its unfinished choices)."""
        if self.task is None or self.task.done():
            return 0
        return sum(1 for j in self.jobs if self.progress[j.index].finish_reason is None) or 1

    def checkpoint(self) -> Checkpoint:
        """The progress so far. It shares the live per-choice state (no copies): callers
        serialize it at once, before the event loop runs generation again."""
        return Checkpoint.model_construct(
            choices=[self.progress[i] for i in sorted(self.progress)],
            num_prompt_tokens=self.num_prompt_tokens)

    def _delta(self) -> CheckpointDelta:
        """What is new per choice since what the control plane holds."""
        choices = []
        for index in sorted(self.progress):
            p, base = self.progress[index], self.acked.get(index, Lengths())
            if Lengths.of(p) == base:
                continue
            choices.append(ChoiceDelta(
                index=index, base_tokens=base.tokens, base_chars=base.chars,
                base_logprobs=base.logprobs, token_ids=p.token_ids[base.tokens:],
                text=p.text[base.chars:],
                logprobs=None if p.logprobs is None else p.logprobs[base.logprobs:],
                finish_reason=p.finish_reason, tool_format=p.tool_format))
        return CheckpointDelta(choices=choices, num_prompt_tokens=self.num_prompt_tokens)

    def pending_bytes(self) -> int:
        """About how large the next checkpoint of this lease is."""
        return sum(_approx_bytes(p, Lengths() if self.needs_full
                                 else self.acked.get(i, Lengths()))
                   for i, p in self.progress.items())

    def heartbeat_item(self, with_checkpoint: bool) -> tuple[HeartbeatItem,
                                                             SentCheckpoint | None]:
        """This lease's heartbeat, with its checkpoint if asked (a delta, or the whole progress
        after a resync), and what that checkpoint would make the control plane hold."""
        item = HeartbeatItem(request_id=self.request_id, epoch=self.lease.epoch)
        if not with_checkpoint or not self.progress:
            return item, None
        target = {i: Lengths.of(p) for i, p in self.progress.items()}
        if self.needs_full:
            # Serialized at once by the caller, before generation runs again.
            item.checkpoint = self.checkpoint()
        else:
            item.delta = self._delta()
        self.dirty = False
        self.last_checkpoint_at = time.monotonic()
        return item, SentCheckpoint(base=dict(self.acked), target=target,
                                    full=self.needs_full)

    def checkpoint_answered(self, sent: SentCheckpoint, accepted: bool, resync: bool) -> None:
        """The control plane's answer to a checkpoint (neither flag: no answer came)."""
        if accepted and (sent.full or self.acked == sent.base):
            self.acked = sent.target
            if sent.full:
                self.needs_full = False
        elif accepted or resync:
            self.needs_full = True  # what it holds is no longer known here
        if not accepted:
            self.dirty = True

    def checkpoint_due(self, now: float) -> bool:
        return self.dirty and now - self.last_checkpoint_at >= self.checkpoint_interval_s

    def start(self, on_done: Callable[[HeldLease], None]) -> None:
        self.task = asyncio.create_task(self._run(on_done), name=f"lease-{self.request_id}")

    def _fail(self, code: str, message: str, param: str | None = None) -> None:
        self.result = CompletionItem(request_id=self.request_id, epoch=self.lease.epoch,
                                     outcome="failed",
                                     error=ErrorInfo(code=code, message=message, param=param))

    async def _run(self, on_done: Callable[[HeldLease], None]) -> None:
        try:
            self.jobs = choice_jobs(self.lease, self.adapter.default_max_tokens,
                                    self.adapter.tool_format, self.adapter.guides,
                                    self.adapter.embeds)
            for job in self.jobs:
                self.progress.setdefault(job.index, ChoiceProgress(index=job.index))
                self.progress[job.index].tool_format = job.tool_format
                self.num_tokens[job.index] = resumed_token_count(job)
            if self.resumed_tokens:
                log.debug("lease %s epoch %d resumes from a checkpoint of %d tokens",
                          self.request_id, self.lease.epoch, self.resumed_tokens)
            await asyncio.gather(*(self._run_choice(j) for j in self.jobs
                                   if self.progress[j.index].finish_reason is None))
            self._succeed()
        except BodyError as exc:
            self._fail("invalid_request_error", str(exc), exc.param)
        except JobError as exc:
            self._fail(exc.code, str(exc), exc.param)
        except EngineUnavailableError as exc:
            log.warning("engine unavailable for %s: %s", self.request_id, exc)
            self.engine_failed = True
        except asyncio.CancelledError:
            self._abort_engine()
            raise
        except Exception as exc:
            # An engine bug must not kill the worker; the request fails with a server error.
            log.exception("request %s failed in the engine", self.request_id)
            self._fail("server_error", f"the engine failed: {type(exc).__name__}: {exc}")
        finally:
            if self.result is not None or self.engine_failed:
                self._abort_engine()
            on_done(self)

    def _abort_engine(self) -> None:
        for job in self.jobs:
            if self.progress.get(job.index) is None or \
                    self.progress[job.index].finish_reason is None:
                self.adapter.abort(job.engine_request_id)

    async def _run_choice(self, job: ChoiceJob) -> None:
        state = self.progress[job.index]
        async for update in self.adapter.generate(job):
            if update.num_prompt_tokens:
                self.num_prompt_tokens = update.num_prompt_tokens
            if update.num_cached_tokens and job.index == self.jobs[0].index:
                # The prompt is billed once: as the first choice's engine request found it.
                self.num_cached_tokens = update.num_cached_tokens
            if update.new_token_ids:
                state.token_ids.extend(update.new_token_ids)
            if update.new_text:
                state.text += update.new_text
            if update.logprobs:
                if state.logprobs is None:
                    state.logprobs = []
                state.logprobs.extend(update.logprobs)
            self.num_tokens[job.index] += update.num_new_tokens
            self.tally.generated_tokens += update.num_new_tokens
            if update.embedding is not None:
                state.embedding = update.embedding
            if update.finish_reason is not None:
                state.finish_reason = update.finish_reason
            # An embedding has nothing a checkpoint could resume from.
            self.dirty = job.kind != "embedding"
        if state.finish_reason is None:
            # The stream ended without saying why (e.g. a server that omits it): a length stop.
            state.finish_reason = "length"

    def _succeed(self) -> None:
        self.result = CompletionItem(
            request_id=self.request_id, epoch=self.lease.epoch, outcome="succeeded",
            choices=[self.progress[i] for i in sorted(self.progress)],  # final: no more writes
            usage=Usage(prompt_tokens=self.num_prompt_tokens,
                        completion_tokens=sum(self.num_tokens.values()),
                        cached_tokens=min(self.num_cached_tokens, self.num_prompt_tokens)))

    def cancel(self) -> None:
        """Stop generating (revoked lease, shutdown); the result, if any, is dropped."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self._abort_engine()
