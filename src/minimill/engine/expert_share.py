"""Expert parallelism's two small parts beside the model: which routed experts a rank holds
(`ExpertShare`, also the loader's `keep`, so a rank never reads another's experts), and how a
MoE layer's experts run when they are spread over the ranks (`ExpertExchange`).

Every rank runs the same tokens (expert_parallel.py), routes them the same way, and computes
only the (token, choice) pairs whose expert it holds, each pair's output weighted by its
routing weight, as `kernels.experts` would: each pair is a row of its own, and an expert's
GEMM rows are batch-invariant (moe.py), so the numbers are those of the single-process call.
Every other pair is zero on this rank. One all_reduce (sum) over the [tokens * top_k,
hidden] pairs then gives every rank every pair: only its owner's value is not zero, and
v + 0 is v exactly, so after it each token adds its choices in the router's order as the
single-process path does, and greedy output in float32 is the single-process engine's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from minimill.engine.kernels import TorchKernels
from minimill.engine.moe import ExpertWeights

# A routed expert's tensor in HF naming (Qwen3-MoE's and DeepSeek-V3's: one per expert).
EXPERT_NAME = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class ExpertShare:
    """Rank `rank` of `num_ranks` holds a contiguous range of each MoE layer's routed experts
    (`local`), every other weight whole. Called with a weight's name: whether this rank
    reads it (a loader's `keep`; it crosses to the rank's process)."""

    rank: int
    num_ranks: int
    num_experts: int

    @property
    def local(self) -> range:
        """The expert ids held here: [rank * E / N, (rank + 1) * E / N), rounded down."""
        e, n = self.num_experts, self.num_ranks
        return range(self.rank * e // n, (self.rank + 1) * e // n)

    def __call__(self, name: str) -> bool:
        match = EXPERT_NAME.match(name)
        return match is None or int(match.group(1)) in self.local


def experts_read(names: Any) -> list[int]:
    """The routed experts' ids among weight names (what a rank reports it read)."""
    return sorted({int(m.group(1)) for m in map(EXPERT_NAME.match, names) if m is not None})


class ExpertExchange:
    """`moe.ExpertCombine` over the ranks' group: this rank's experts' pairs, then one
    all_reduce. Every rank calls it in every MoE layer of every step, in the same order
    (each runs the whole step), with or without pairs of its own."""

    def __init__(self, share: ExpertShare) -> None:
        self.share = share
        self.group: Any = None  # dist.ProcessGroupGloo, set once the ranks joined
        self.reduce_s = 0.0  # time in the all_reduce (stats)

    def __call__(self, ops: TorchKernels, x: torch.Tensor, expert_ids: torch.Tensor,
                 routing: torch.Tensor, weights: ExpertWeights,
                 swiglu: tuple[float, float] | None) -> torch.Tensor:
        tokens, top_k = expert_ids.shape
        local = self.share.local
        flat = expert_ids.flatten()  # token t's j-th choice at t * top_k + j
        mine = ((flat >= local.start) & (flat < local.stop)).nonzero().squeeze(1)
        pairs = x.new_zeros(tokens * top_k, x.shape[1])
        if mine.numel():
            # One row per pair, its expert renumbered into this rank's list: the call's
            # result for a row with one choice is that choice's weighted output.
            ids = (flat[mine] - weights.first_expert).unsqueeze(1)
            pairs[mine] = ops.experts(x[mine // top_k], ids,
                                      routing.flatten()[mine].unsqueeze(1).contiguous(),
                                      weights.gate_up, weights.down, weights.gate_up_bias,
                                      weights.down_bias, swiglu)
        self.group.allreduce([pairs], dist.AllreduceOptions()).wait()
        per_choice = pairs.view(tokens, top_k, -1)
        out = per_choice[:, 0].clone()
        for choice in range(1, top_k):
            out += per_choice[:, choice]
        return out
