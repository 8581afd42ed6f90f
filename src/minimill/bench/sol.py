"""The speed of light of a run: the least time this machine needs for the work the engine did.

Each step recorded by the engine (engine.model_runner.StepShape) needs its matmul FLOPs, at the
rate the engine's *own* GEMM path reaches on this machine at that step's shapes (measured here,
with the engine's prepared weights, in its dtype), and its bytes (weights plus the KV it reads
and writes) at this machine's memory bandwidth. A step can go no faster than the larger of the
two. Steps of lanes (engine/core.py), which run side by side on one core each, count as their
share of a step of all the lanes' rows together: rates at that row count, weights read once
for all of them. Attention FLOPs are counted at the GEMM rate too, which flatters the
yardstick, so the fraction an engine reaches of it can only be understated. A fraction
above 1 means the yardstick measured something else than what the engine ran: the bench
reports it as a bug.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from minimill.engine.model import DecoderModel
from minimill.engine.model_runner import StepShape

MIN_CALLS = 3


@dataclass(slots=True)
class Yardstick:
    # rows bucket (a power of two) -> seconds per row for all of one layer's linears
    layer_s_per_row: dict[int, float] = field(default_factory=dict)
    # rows bucket -> seconds per row for the vocabulary projection
    lm_head_s_per_row: dict[int, float] = field(default_factory=dict)
    # rows bucket -> FLOP/s of the layer's linears together (reported, and the attention rate)
    layer_flop_s: dict[int, float] = field(default_factory=dict)
    bandwidth_bytes_s: float = 0.0


def bucket(rows: int) -> int:
    return 1 << max(0, (rows - 1).bit_length())


def _best_seconds(fn: object, budget_s: float) -> float:
    assert callable(fn)
    fn()  # warm-up: kernel selection, page faults
    best, spent, calls = float("inf"), 0.0, 0
    while calls < MIN_CALLS or spent < budget_s:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best, spent, calls = min(best, elapsed), spent + elapsed, calls + 1
        if calls >= 50:
            break
    return best


def measure(model: DecoderModel, steps: list[StepShape], budget_s: float = 8.0) -> Yardstick:
    """GEMM rates of the engine's own path at the run's row counts, and memory bandwidth."""
    ops = model.kernels
    layer = model.layers[0]
    weights = [layer.qkv, layer.o, layer.gate_up, layer.down]
    in_dims = [model.config.hidden_size, model.num_heads * model.head_dim,
               model.config.hidden_size, model.config.intermediate_size]
    flops_per_row = sum(2 * k * n for k, n in zip(
        in_dims, [model.num_heads * model.head_dim + 2 * model.num_kv_heads * model.head_dim,
                  model.config.hidden_size, 2 * model.config.intermediate_size,
                  model.config.hidden_size], strict=True))
    layer_buckets = sorted({bucket(s.num_tokens * s.lanes) for s in steps})
    head_buckets = sorted({bucket(s.num_logits * s.lanes) for s in steps if s.num_logits})
    per_measure = budget_s / max(1, len(layer_buckets) * 4 + len(head_buckets))
    stick = Yardstick()
    dtype, device = model.embed.dtype, model.embed.device
    with torch.inference_mode():
        for rows in layer_buckets:
            seconds = 0.0
            for weight, k in zip(weights, in_dims, strict=True):
                x = torch.randn(rows, k, device=device).to(dtype)
                seconds += _best_seconds(lambda x=x, w=weight: ops.linear(x, w), per_measure)
            stick.layer_s_per_row[rows] = seconds / rows
            stick.layer_flop_s[rows] = flops_per_row * rows / seconds
        for rows in head_buckets:
            x = torch.randn(rows, model.config.hidden_size, device=device).to(dtype)
            seconds = _best_seconds(lambda x=x: ops.linear(x, model.lm_head), per_measure)
            stick.lm_head_s_per_row[rows] = seconds / rows
        stick.bandwidth_bytes_s = _bandwidth(device)
    return stick


def _bandwidth(device: torch.device) -> float:
    """Bytes/s of reading a buffer much larger than any cache, best of a few passes."""
    buffer = torch.ones(128 << 20, dtype=torch.float32, device=device)  # 512 MiB
    # Two seconds of passes (~40 here): a neighbour's burst of memory traffic does not set the
    # bound that small, memory-bound runs are measured against.
    seconds = _best_seconds(lambda: buffer.sum().item(), 2.0)
    return buffer.numel() * 4 / seconds


@dataclass(frozen=True, slots=True)
class SpeedOfLight:
    seconds: float
    compute_seconds: float  # the steps' compute bounds, summed
    memory_seconds: float  # the steps' memory bounds, summed
    memory_bound_steps: int


def speed_of_light(model: DecoderModel, steps: list[StepShape], stick: Yardstick
                   ) -> SpeedOfLight:
    mc = model.config
    itemsize = model.embed.element_size()
    layers = mc.num_hidden_layers
    kv_bytes_per_token = layers * 2 * mc.num_key_value_heads * mc.head_dim * itemsize
    # Every linear weight and the vocabulary projection, read once per step.
    weight_bytes = itemsize * mc.num_params
    attention_flops_per_pair = 4 * layers * mc.num_attention_heads * mc.head_dim
    total = compute_total = memory_total = 0.0
    memory_bound = 0
    for step in steps:
        # A lane's step: its share of a machine-wide step of every lane's rows.
        rows = bucket(step.num_tokens * step.lanes)
        compute = layers * step.num_tokens * stick.layer_s_per_row[rows]
        if step.num_logits:
            compute += step.num_logits * stick.lm_head_s_per_row[
                bucket(step.num_logits * step.lanes)]
        compute += attention_flops_per_pair * step.attended_pairs / stick.layer_flop_s[rows]
        memory = (weight_bytes / step.lanes
                  + kv_bytes_per_token * (step.kv_tokens + step.num_tokens)
                  ) / stick.bandwidth_bytes_s
        total += max(compute, memory)
        compute_total += compute
        memory_total += memory
        memory_bound += memory > compute
    return SpeedOfLight(total, compute_total, memory_total, memory_bound)


TARGET_NOTE = ("each step's bound is max(its matmul and attention FLOPs at the rate the "
               "engine's GEMM path reaches at the step's row count, its bytes at this "
               "machine's memory bandwidth); sol_tok_s is output tokens over their sum")
