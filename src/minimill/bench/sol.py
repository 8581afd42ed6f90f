"""The speed of light of a run: the least time this machine needs for the work the engine did.

Each step recorded by the engine (engine.model_runner.StepShape) needs its matmul FLOPs, at the
rate the engine's *own* GEMM path reaches on this machine at that step's shapes (measured here,
with the engine's prepared weights, in its dtype), and its bytes (weights plus the KV it reads
and writes) at this machine's memory bandwidth. A step can go no faster than the larger of the
two. Steps of lanes (engine/core.py), which run side by side on one core each, count as their
share of a step of all the lanes' rows together: rates at that row count, weights read once
for all of them. In a mixture of experts a step's rows split over the experts: a routed row
goes through one expert's GEMMs at the rate of the rows an expert gets on average (rows *
top_k / experts), and the step reads the weights of the experts its rows are expected to touch
(dense MLP layers beside the experts are left out, which only flatters the yardstick).
Attention FLOPs are counted at the GEMM rate too, which flatters the
yardstick, so the fraction an engine reaches of it can only be understated. A fraction
above 1 means the yardstick measured something else than what the engine ran (most often a
neighbour holding a core while it measured): the bench measures again, keeping the best of the
measurements at every shape, and reports a fraction still above 1 as a bug.
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
    # rows bucket (a power of two) -> seconds per row for all of one layer's linears (of a
    # mixture of experts: its attention's)
    layer_s_per_row: dict[int, float] = field(default_factory=dict)
    # rows an expert gets (bucket) -> seconds per row through one expert's gate/up and down
    expert_s_per_row: dict[int, float] = field(default_factory=dict)
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


def best_of(a: Yardstick, b: Yardstick) -> Yardstick:
    """The faster of two measurements at every shape: a neighbour that held a core during one
    measurement slowed only that one (the best of repeats, as each shape's own calls are)."""
    def fastest(x: dict[int, float], y: dict[int, float]) -> dict[int, float]:
        return {k: min(x.get(k, float("inf")), y.get(k, float("inf"))) for k in x.keys() | y}

    def highest(x: dict[int, float], y: dict[int, float]) -> dict[int, float]:
        return {k: max(x.get(k, 0.0), y.get(k, 0.0)) for k in x.keys() | y}

    return Yardstick(layer_s_per_row=fastest(a.layer_s_per_row, b.layer_s_per_row),
                     expert_s_per_row=fastest(a.expert_s_per_row, b.expert_s_per_row),
                     lm_head_s_per_row=fastest(a.lm_head_s_per_row, b.lm_head_s_per_row),
                     layer_flop_s=highest(a.layer_flop_s, b.layer_flop_s),
                     bandwidth_bytes_s=max(a.bandwidth_bytes_s, b.bandwidth_bytes_s))


def _moe_layers(model: DecoderModel) -> int:
    return sum(layer.experts is not None for layer in model.layers)


def expert_rows(model: DecoderModel, rows: int) -> int:
    """The bucket of the rows one expert gets on average in a step of `rows` rows."""
    c = model.config
    return bucket(-(-rows * c.num_experts_per_tok // c.num_experts))


def measure(model: DecoderModel, steps: list[StepShape], budget_s: float = 8.0) -> Yardstick:
    """GEMM rates of the engine's own path at the run's row counts, and memory bandwidth."""
    ops = model.kernels
    c = model.config
    q_width = model.num_heads * model.head_dim
    layer = model.layers[0]
    # (weight, in, out) of each linear a layer's row goes through.
    linears = [(layer.qkv, c.hidden_size, q_width + 2 * model.num_kv_heads * model.head_dim),
               (layer.o, q_width, c.hidden_size)]
    expert = next((x.experts for x in model.layers if x.experts is not None), None)
    if expert is None:
        assert layer.gate_up is not None and layer.down is not None
        linears += [(layer.gate_up, c.hidden_size, 2 * c.intermediate_size),
                    (layer.down, c.intermediate_size, c.hidden_size)]
    flops_per_row = sum(2 * k * n for _, k, n in linears)
    layer_buckets = sorted({bucket(s.num_tokens * s.lanes) for s in steps})
    head_buckets = sorted({bucket(s.num_logits * s.lanes) for s in steps if s.num_logits})
    expert_buckets = (sorted({expert_rows(model, s.num_tokens * s.lanes) for s in steps})
                      if expert is not None else [])
    per_measure = budget_s / max(1, len(layer_buckets) * len(linears) + len(head_buckets)
                                 + 2 * len(expert_buckets))
    stick = Yardstick()
    dtype, device = model.embed.dtype, model.embed.device
    with torch.inference_mode():
        for rows in layer_buckets:
            seconds = 0.0
            for weight, k, _ in linears:
                x = torch.randn(rows, k, device=device).to(dtype)
                seconds += _best_seconds(lambda x=x, w=weight: ops.linear(x, w), per_measure)
            stick.layer_s_per_row[rows] = seconds / rows
            stick.layer_flop_s[rows] = flops_per_row * rows / seconds
        for rows in head_buckets:
            x = torch.randn(rows, model.config.hidden_size, device=device).to(dtype)
            seconds = _best_seconds(lambda x=x: ops.linear(x, model.lm_head), per_measure)
            stick.lm_head_s_per_row[rows] = seconds / rows
        for rows in expert_buckets:
            assert expert is not None
            seconds = 0.0
            for weight, k in ((expert.gate_up[0], c.hidden_size),
                              (expert.down[0], c.moe_intermediate_size)):
                x = torch.randn(rows, k, device=device).to(dtype)
                seconds += _best_seconds(lambda x=x, w=weight: ops.expert_linear(x, w),
                                          per_measure)
            stick.expert_s_per_row[rows] = seconds / rows
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
    parts, kv_heads, kv_dim = mc.kv_layout
    kv_bytes_per_token = layers * parts * kv_heads * kv_dim * itemsize
    # Every linear weight and the vocabulary projection, read once per step; of the experts,
    # those the step's rows are expected to touch.
    weight_bytes = itemsize * mc.num_params
    moe_layers = _moe_layers(model)
    expert_bytes = itemsize * 3 * mc.hidden_size * mc.moe_intermediate_size
    weight_bytes -= moe_layers * mc.num_experts * expert_bytes
    # Per head, a score over the key's width and a sum over the value's (MLA: the latent's).
    value_dim = mc.kv_lora_rank if mc.is_mla else mc.head_dim
    attention_flops_per_pair = 2 * layers * mc.num_attention_heads * (kv_dim + value_dim)
    total = compute_total = memory_total = 0.0
    memory_bound = 0
    for step in steps:
        # A lane's step: its share of a machine-wide step of every lane's rows.
        rows = bucket(step.num_tokens * step.lanes)
        compute = layers * step.num_tokens * stick.layer_s_per_row[rows]
        step_weight_bytes = float(weight_bytes)
        if moe_layers:
            k, experts = mc.num_experts_per_tok, mc.num_experts
            all_rows = step.num_tokens * step.lanes
            compute += (moe_layers * step.num_tokens * k
                        * stick.expert_s_per_row[expert_rows(model, all_rows)])
            touched = experts * (1 - (1 - k / experts) ** all_rows)
            step_weight_bytes += moe_layers * touched * expert_bytes
        if step.num_logits:
            compute += step.num_logits * stick.lm_head_s_per_row[
                bucket(step.num_logits * step.lanes)]
        compute += attention_flops_per_pair * step.attended_pairs / stick.layer_flop_s[rows]
        memory = (step_weight_bytes / step.lanes
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
