"""Where a step's time goes: the engine's kernels timed call by call.

`TimedKernels` wraps the kernels a model runs (engine.kernels) and adds each call's wall time
to its operation's total; linear layers are told apart by their weight. On the CPU every
kernel returns when its work is done, so a call's wall time is its cost. A call counts for the
share of the engine's cores it ran on: a kernel spread over both of two cores counts whole, each
of two groups or lanes run side by side on one core each (engine/core_split.py, core.py)
counts half, so the totals stay comparable with the run's wall time. What the kernels do not
account for (building the step's inputs, scheduling, detokenizing) is the run's time less
their sum.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from minimill.engine.attention import AttentionMetadata
from minimill.engine.kernels import TorchKernels
from minimill.engine.model_runner import ModelRunner

_TIMED = ("rms_norm", "add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "clamped_swiglu",
          "rotary_kv_write", "rotary_kv_write_int4", "sample", "token_logprobs")


class TimedKernels:
    """Delegates to `inner`, timing every call of the per-step operations."""

    def __init__(self, inner: TorchKernels, weight_names: dict[int, str],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """`clock`: wall time by default; time.thread_time measures a one-thread engine on a
        busy machine by the CPU time it got."""
        self._inner = inner
        self._clock = clock
        self._weight_names = weight_names
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        # Over the experts' calls: (token, expert) pairs, and distinct experts each call ran.
        self.expert_pairs = 0
        self.experts_run = 0
        self._cores = torch.get_num_threads()
        self._lock = threading.Lock()  # groups on several cores report at once

    def _timed(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = self._clock()
        try:
            return fn(*args, **kwargs)
        finally:
            share = min(1.0, torch.get_num_threads() / self._cores)
            elapsed = (self._clock() - start) * share
            with self._lock:
                self.seconds[name] += elapsed
                self.calls[name] += 1

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in _TIMED:
            return attr
        return lambda *args, **kwargs: self._timed(name, attr, *args, **kwargs)

    @staticmethod
    def _attention_name(meta: AttentionMetadata) -> str:
        # Decode-only steps and steps with prompt chunks stress attention differently.
        return "paged_attention." + ("decode" if meta.max_query_len == 1 else "with_prompts")

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, window: int | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
        return self._timed(self._attention_name(meta), self._inner.paged_attention, q,
                           k_cache, v_cache, meta, scale, window, sinks)

    def paged_attention_int4(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                             k_cache: torch.Tensor, v_cache: torch.Tensor,
                             k_stage: torch.Tensor, v_stage: torch.Tensor,
                             meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self._timed(self._attention_name(meta), self._inner.paged_attention_int4, q,
                           k_new, v_new, k_cache, v_cache, k_stage, v_stage, meta, scale)

    def experts(self, x: torch.Tensor, expert_ids: torch.Tensor, *args: Any,
                **kwargs: Any) -> torch.Tensor:
        """A mixture-of-experts layer after its routing, its GEMMs included, in one figure;
        and how spread the routing was (a call's cost follows the experts it reads)."""
        distinct = int(torch.unique(expert_ids).numel())
        with self._lock:
            self.expert_pairs += expert_ids.numel()
            self.experts_run += distinct
        return self._timed("experts", self._inner.experts, x, expert_ids, *args, **kwargs)

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._timed("linear." + self._weight_names.get(id(weight), "other"),
                           self._inner.linear, x, weight, bias)


def instrument(runner: ModelRunner,
               clock: Callable[[], float] = time.perf_counter) -> TimedKernels:
    """Time the runner's kernels (the model's and the sampler's) from now on; returns the
    recorder (`restore` undoes it)."""
    model = runner.model
    names: dict[int, str] = {id(model.lm_head): "lm_head"}
    for layer in model.layers:
        names.update({id(layer.qkv): "qkv", id(layer.o): "o"})
        if layer.experts is not None:
            names[id(layer.experts.router)] = "router"
            if layer.gate_up is not None:  # DeepSeek's shared experts
                names.update({id(layer.gate_up): "shared.gate_up", id(layer.down): "shared.down"})
        else:
            names.update({id(layer.gate_up): "gate_up", id(layer.down): "down"})
    inner = model.kernels
    timed = TimedKernels(inner, names, clock)
    model.kernels = runner.kernels = timed  # type: ignore[assignment]
    return timed


def restore(runner: ModelRunner, timed: TimedKernels) -> None:
    runner.model.kernels = runner.kernels = timed._inner


def report(timed: TimedKernels, wall_s: float) -> dict[str, Any]:
    """Seconds and share of the wall time per operation, largest first, and the rest."""
    rows = sorted(timed.seconds.items(), key=lambda kv: -kv[1])
    accounted = sum(timed.seconds.values())
    out: dict[str, Any] = {name: {"s": round(s, 3), "share": round(s / wall_s, 3),
                                  "calls": timed.calls[name]} for name, s in rows}
    if "experts" in out and timed.calls["experts"]:
        calls = timed.calls["experts"]
        out["experts"]["experts_per_call"] = round(timed.experts_run / calls, 1)
        out["experts"]["pairs_per_call"] = round(timed.expert_pairs / calls, 1)
    rest = max(0.0, wall_s - accounted)
    out["outside_kernels"] = {"s": round(rest, 3), "share": round(rest / wall_s, 3)}
    return out
