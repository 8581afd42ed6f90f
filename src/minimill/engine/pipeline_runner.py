"""Pipeline parallelism inside one site: the model's layers cut into stages (stage_plan.py),
stage 0 in the engine's process, the others in processes of their own (pipeline_stage.py),
joined by torch.distributed (pipeline_link.py).

The engine core sees a model runner with one lane per stage (core.py's lanes): the running
requests are dealt into as many microbatches, each stepping on its own clock, one behind
another, so that while stage k runs one microbatch, stage k + 1 runs the one before it and
every stage works while the others do. Scheduling, block tables and prefix reuse stay with
stage 0's scheduler; every stage holds a pool of the same number of blocks for its own
layers, and a block id means the same tokens on every stage.

With `stages_listen`, the stages after the first are not started here: they join from other
hosts of the site (stage_hosts.py) and are watched by their beat instead of their process.

Stage 0's layers run on a thread of their own (pinned to its core); a second thread receives
the last stage's tokens, which come back in the order the microbatches left. A stage process
that ends (killed, crashed) ends the pipeline: the others are stopped, every microbatch in
flight fails with PipelineStageError, and the engine refuses further steps (a site's engine
process then exits, as on any engine death).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from minimill.engine import peers
from minimill.engine import pipeline_link as link
from minimill.engine.config import EngineConfig
from minimill.engine.memory_budget import StageWeights
from minimill.engine.model_runner import ModelRunner, sample_masks, step_inputs
from minimill.engine.params import EngineDied, EngineError
from minimill.engine.pipeline_stage import StepFailed, StepWork, pin_to, stage_main
from minimill.engine.scheduler import ModelOutput, ScheduledSequence, SchedulerOutput
from minimill.engine.stage_hosts import Assignment, RemoteStages
from minimill.engine.stage_plan import StagePlan, head_cost, layer_costs, plan_at, plan_stages
from minimill.models.types import LoadedModel, ModelConfig

log = logging.getLogger(__name__)

_STAGE_START_TIMEOUT_S = 600.0
_STAGE_STOP_TIMEOUT_S = 30.0

Report = Callable[[bool, Any], None]


class PipelineStageError(EngineDied):
    """A pipeline stage's process ended: the engine cannot step any more."""


def plan_for(config: EngineConfig, loaded: LoadedModel) -> StagePlan:
    """The cut max_memory_gb chose (config.stage_starts), else the cheapest by cost; costs
    from every weight's shape (a stage loaded with its own weights only records them all)."""
    mc = loaded.config
    costs = layer_costs(mc, loaded.extra.get("weight_shapes") or loaded.weights)
    if config.stage_starts:
        return plan_at(costs, config.stage_starts, head_cost(mc))
    return plan_stages(costs, config.pipeline_stages, head_cost(mc))


def stage_cpus(num_stages: int, pin: bool) -> list[int | None]:
    """A core per stage where there are enough (each stage's threads stay on it)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not pin or len(cpus) < num_stages:
        return [None] * num_stages
    return list(cpus[:num_stages])


class PipelineRunner(ModelRunner):
    """Stage 0's model runner: its layers here, the rest in stage processes."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.plan = plan_for(config, loaded)
        source = loaded.source_path
        if not source or source.startswith("random:"):
            raise EngineError("pipeline stages load the model by name or path; this model "
                              "was built in memory")
        num_stages = self.plan.num_stages
        # Stages on other hosts leave every core here to stage 0.
        self.cpus = stage_cpus(num_stages, config.pin_threads and not config.stages_listen)
        weight_bytes = int(loaded.extra.get("loaded_bytes") or sum(
            t.numel() * t.element_size() for t in loaded.weights.values()))
        super().__init__(config, loaded, self.plan.layers[0])
        # What each stage holds, stage 0 first: (bytes of weights it read, of its KV pool).
        self.stage_memory: list[tuple[int, int]] = [
            (weight_bytes, self.kv_cache.numel() * self.kv_cache.element_size())]
        log.info("pipeline: %d stages, layers %s, estimated costs %s (imbalance %.2f)",
                 num_stages, [(r.start, r.stop) for r in self.plan.layers],
                 [f"{c:.3g}" for c in self.plan.costs], self.plan.imbalance())
        self._lock = threading.Lock()
        self._inflight: deque[Report] = deque()  # in the order their results come back
        self._expected = threading.Semaphore(0)
        self._dead: str | None = None
        self._closing = False
        self._work: queue.SimpleQueue[tuple[str, Any, Report] | None] = queue.SimpleQueue()
        self.stats = link.StageStats(0)
        self._start_stages(config, source, loaded.config)

    def _start_stages(self, config: EngineConfig, source: str, model_config: ModelConfig
                      ) -> None:
        self.processes: list[Any] = []
        self._conns: list[Any] = []
        self.remote: RemoteStages | None = None
        self._remote_pids: list[int] = []
        self._stopped = threading.Event()
        if config.stages_listen:
            self._join_remote(config, source, model_config)
        else:
            self._start_local(config, source, model_config)
        self._send = link.Sender(self.groups.forward, 1)
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._threads = [threading.Thread(target=target, name=f"minimill-pipeline-{name}",
                                          daemon=True)
                         for target, name in ((self._stage0, "stage0"),
                                              (self._results, "results"), (self._watch, "watch"))]
        for thread in self._threads:
            thread.start()

    def _join_remote(self, config: EngineConfig, source: str, model_config: ModelConfig
                     ) -> None:
        """Wait for the stages from other hosts, then join the groups with them."""
        assert config.stages_listen is not None
        keeps = tuple(StageWeights.of(r, model_config) for r in self.plan.layers)
        self.remote = RemoteStages(config.stages_listen,
                                   Assignment(config.model, source, model_config, config, keeps))
        try:
            for joined in self.remote.wait_ready(_STAGE_START_TIMEOUT_S):
                self._remote_pids.append(joined.pid)
                self.stage_memory.append(joined.memory)
            self.groups = link.join(0, self.plan.num_stages, self.remote.port,
                                    self.remote.store, address=self.remote.address)
        except BaseException:
            self.remote.stop()
            raise

    def _start_local(self, config: EngineConfig, source: str, model_config: ModelConfig
                     ) -> None:
        store, port = link.open_store(self.plan.num_stages)
        self.processes, self._conns, ready = peers.start_local(
            self.plan.num_stages, stage_main, lambda rank, conn: (
                conn, rank, self.plan.num_stages, port, source, config,
                StageWeights.of(self.plan.layers[rank], model_config), self.cpus[rank]),
            "minimill-stage", "pipeline stage", _STAGE_START_TIMEOUT_S, _STAGE_STOP_TIMEOUT_S)
        self.stage_memory += [memory for _pid, memory in ready]
        try:
            self.groups = link.join(0, self.plan.num_stages, port, store)
        except BaseException:
            self._kill_stages()
            raise

    @property
    def num_lanes(self) -> int:
        """One microbatch in flight per stage."""
        return self.plan.num_stages

    pipelined = True

    @property
    def stage_pids(self) -> list[int]:
        """The stage processes' pids, stage 1 first (a remote stage's on its own host)."""
        return self._remote_pids or [p.pid for p in self.processes]

    def start(self, output: SchedulerOutput, lane: int, lanes: int, report: Report) -> None:
        """Send one microbatch into the pipeline and return at once; report(True,
        ModelOutput) or report(False, exception) follows when its tokens are back."""
        if self._dead is not None:
            raise PipelineStageError(self._dead)
        if self.step_log is not None:
            self.step_log.append(self._shape(output.scheduled, lanes))
        self.lane_steps += 1
        self._work.put(("step", output.scheduled, report))

    def execute(self, output: SchedulerOutput) -> ModelOutput:
        """One microbatch through the whole pipeline, waited for."""
        done: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        self.start(output, 0, 1, lambda ok, value: done.put((ok, value)))
        ok, value = done.get()
        if not ok:
            raise value
        assert isinstance(value, ModelOutput)
        return value

    def stage_stats(self, reset: bool = False) -> list[dict[str, float | int]]:
        """Each stage's time per step since the start or the last reset (stage 0 first);
        `reset` starts them over. Call between steps (no microbatch in flight)."""
        done: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        if self._dead is not None:
            raise PipelineStageError(self._dead)
        self._work.put(("stats", reset, lambda ok, value: done.put((ok, value))))
        ok, value = done.get()
        if not ok:
            raise value
        return list(value[1])

    # Stage 0's thread: its layers, then the send to stage 1.
    def _stage0(self) -> None:
        pin_to(self.cpus[0])
        if self.cpus[0] is not None:
            self.kernels.init_thread()
        while True:
            started = time.perf_counter()
            item = self._work.get()
            self.stats.wait_s += time.perf_counter() - started
            if item is None:
                # The last stage answers STOP too: the results' thread ends on it.
                self._launch(lambda ok, value: None, link.STOP, None)
                self._guard(self._send.finish)
                return
            kind, payload, report = item
            if self._dead is not None:
                report(False, PipelineStageError(self._dead))
                continue
            if kind == "stats":
                gathered = [self.stats.per_step()]
                if payload:
                    self.stats = link.StageStats(0)
                self._launch(report, link.STATS, (payload, gathered))
                continue
            started = time.perf_counter()
            try:
                work, states = self._run_stage0(payload)
            except Exception as exc:  # this microbatch fails; the pipeline goes on
                report(False, exc)
                continue
            self.stats.compute_s += time.perf_counter() - started
            self.stats.steps += 1
            self._launch(report, link.STEP, work, states)

    def _launch(self, report: Report, kind: int, obj: object,
                states: torch.Tensor | None = None) -> None:
        """Send a message whose answer comes back to `report`."""
        with self._lock:
            dead = self._dead
            if dead is None:
                self._inflight.append(report)
        if dead is not None:  # the pipeline ended while this microbatch ran on stage 0
            report(False, PipelineStageError(dead))
            return
        self._expected.release()
        self._guard(lambda: self._send.send(kind, obj, states, self.stats))

    def _guard(self, action: Callable[[], None]) -> None:
        """Run a send; a failed one means a stage is gone."""
        try:
            action()
        except Exception as exc:
            self._die(f"pipeline stage 1 is unreachable: {exc}")

    @torch.inference_mode()
    def _run_stage0(self, entries: list[ScheduledSequence]) -> tuple[StepWork, torch.Tensor]:
        inputs = step_inputs(entries)
        dev = self.device
        meta = self.metadata(inputs.query_lens, inputs.seq_lens, inputs.tables,
                             inputs.stage_units)
        hidden = self.model.embed_tokens(torch.tensor(inputs.input_ids, dtype=torch.long,
                                                      device=dev))
        hidden, residual = self.model.run_layers(
            hidden, None, torch.tensor(inputs.positions, dtype=torch.long, device=dev), meta,
            self.kv_cache)
        assert residual is not None
        sampling = [e for e in entries if e.sample]
        sampled = [e.seq for e in sampling]
        # Guided samples' bitmasks (filled on the engine's thread while these layers ran) go
        # to the last stage as bytes, which samples under them.
        masks = sample_masks(sampling)
        work = StepWork(inputs.query_lens, inputs.seq_lens, [list(t) for t in inputs.tables],
                        inputs.logits_rows, [s.params for s in sampled],
                        [s.seed for s in sampled], [s.num_output_tokens for s in sampled],
                        [s.output_counts for s in sampled],
                        None if masks is None else [None if m is None else m.numpy().tobytes()
                                                    for m in masks],
                        {k: seq.request_id for k, seq in enumerate(sampled) if seq.params.embed},
                        [list(u) for u in inputs.stage_units] if self.kv_stage is not None
                        else [])
        return work, torch.stack([hidden, residual]).cpu()

    # The results' thread: the last stage's answers, in the order the microbatches left.
    def _results(self) -> None:
        last = self.plan.num_stages - 1
        while True:
            self._expected.acquire()
            if self._dead is not None:
                return
            try:
                kind, obj, _ = link.receive(self.groups.back, last)
            except Exception as exc:
                self._die(f"pipeline stage {last} is unreachable: {exc}")
                return
            if kind == link.STOP:
                return
            with self._lock:
                report = self._inflight.popleft() if self._inflight else None
            if report is None:
                continue
            if isinstance(obj, StepFailed):
                report(False, EngineError(obj.message))
            else:
                report(True, obj)

    # The watcher: a stage process that ends unasked ends the pipeline.
    def _watch(self) -> None:
        peers.watch("pipeline stage", self.processes, self.remote, self._stopped,
                    self._wake_r, lambda: self._closing, self._die, _STAGE_STOP_TIMEOUT_S)

    def _die(self, reason: str) -> None:
        with self._lock:
            if self._dead is not None or self._closing:
                return
            self._dead = reason
            reports = list(self._inflight)
            self._inflight.clear()
        log.error("%s: stopping the pipeline", reason)
        self._kill_stages()
        self._expected.release()  # the results' thread ends
        error = PipelineStageError(reason)
        for report in reports:
            report(False, error)

    def _kill_stages(self) -> None:
        peers.stop(self.processes, self.remote, self._stopped, _STAGE_STOP_TIMEOUT_S)

    def close(self) -> None:
        """Stop every stage process (idempotent)."""
        if self._closing:
            return
        if self._dead is None:
            self._closing = True
            self._work.put(None)  # stage 0 sends STOP down the pipeline
            deadline = time.monotonic() + _STAGE_STOP_TIMEOUT_S
            for process in self.processes:
                process.join(max(0.0, deadline - time.monotonic()))
            for thread in self._threads[:2]:
                thread.join(max(0.0, deadline - time.monotonic()))
            if not any(thread.is_alive() for thread in self._threads[:2]):
                # Release the groups now, not in the interpreter's teardown (where gloo's
                # threads abort the process).
                self._send.pending.clear()
                self._send.group = None
                self.groups.forward = self.groups.back = self.groups.store = None
                if self.remote is not None:
                    self.remote.store = None
        self._closing = True
        self._wake_w.send(None)
        self._kill_stages()
        for conn in self._conns:
            conn.close()
