"""Expert parallelism's two small parts beside the model: which routed experts a rank holds
(`ExpertShare`, also the loader's `keep`, so a rank never reads another's experts), and how a
MoE layer's experts run when they are spread over the ranks (`ExpertExchange`).

Each rank runs its own sequences' tokens (expert_parallel.py) and routes them. In each MoE
layer the ranks first exchange how many (token, choice) pairs each sends each other, then
the pairs themselves (the token's row, its routing weight, its expert id), by
all_to_all_single on gloo. Each expert's rank computes the pairs it received with
`kernels.experts`, one choice a row, so each row comes back as that pair's output weighted
by its routing weight, as the single-process call computes it (an expert's GEMM rows are
batch-invariant, moe.py); a second all_to_all returns them, and each token adds its choices
in the router's order, as the single-process path does: greedy output in float32 is the
single-process engine's.
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
_HEAD_NAMES = frozenset({"model.norm.weight", "lm_head.weight"})


@dataclass(frozen=True, slots=True)
class ExpertShare:
    """Rank `rank` of `num_ranks` holds a contiguous range of each MoE layer's routed experts
    (`local`), every other weight whole but the final norm and the vocabulary projection,
    which rank 0 alone holds (a tied model's projection is the embedding, which every rank
    holds). Called with a weight's name: whether this rank
    reads it (a loader's `keep`; it crosses to the rank's process)."""

    rank: int
    num_ranks: int
    num_experts: int

    @property
    def local(self) -> range:
        """The expert ids held here: [rank * E / N, (rank + 1) * E / N), rounded down."""
        e, n = self.num_experts, self.num_ranks
        return range(self.rank * e // n, (self.rank + 1) * e // n)

    @property
    def holds_head(self) -> bool:
        """Rank 0 alone norms, projects and samples (expert_parallel.py)."""
        return self.rank == 0

    def __call__(self, name: str) -> bool:
        if name in _HEAD_NAMES:
            return self.holds_head
        match = EXPERT_NAME.match(name)
        return match is None or int(match.group(1)) in self.local


def experts_read(names: Any) -> list[int]:
    """The routed experts' ids among weight names (what a rank reports it read)."""
    return sorted({int(m.group(1)) for m in map(EXPERT_NAME.match, names) if m is not None})


class ExpertExchange:
    """`moe.ExpertCombine` over the ranks' group: each (token, choice) pair to its expert's
    rank and its weighted output back, by all_to_all. Every rank calls it in every MoE layer
    of every step, in the same order, with or without tokens of its own (`idle`)."""

    def __init__(self, share: ExpertShare) -> None:
        self.share = share
        n, e = share.num_ranks, share.num_experts
        # Each rank's first expert: a pair's rank is the last start at or below its expert.
        self.starts = torch.tensor([ExpertShare(r, n, e).local.start for r in range(n)])
        self.group: Any = None  # dist.ProcessGroupGloo, set once the ranks joined

    def __call__(self, ops: TorchKernels, x: torch.Tensor, expert_ids: torch.Tensor,
                 routing: torch.Tensor, weights: ExpertWeights,
                 swiglu: tuple[float, float] | None) -> torch.Tensor:
        tokens, top_k = expert_ids.shape
        hidden = x.shape[1]
        flat = expert_ids.flatten()  # token t's j-th choice at t * top_k + j
        owner = torch.searchsorted(self.starts, flat, right=True) - 1
        order = owner.argsort(stable=True)  # the pairs grouped by rank, in token order
        send_counts = torch.bincount(owner, minlength=self.share.num_ranks)
        recv_counts = torch.empty_like(send_counts)
        self._all_to_all(recv_counts, send_counts)
        sends, recvs = send_counts.tolist(), recv_counts.tolist()
        # Each pair's row with its routing weight (already in x's dtype) as one more column.
        rows = torch.cat([x[order // top_k], routing.flatten()[order, None]], dim=1)
        got_rows = x.new_empty(sum(recvs), hidden + 1)
        self._all_to_all(got_rows, rows, recvs, sends)
        got_ids = torch.empty(sum(recvs), dtype=torch.long)
        self._all_to_all(got_ids, flat[order].contiguous(), recvs, sends)
        out = x.new_empty(sum(recvs), hidden)
        if out.shape[0]:
            # One choice a row, its expert renumbered into this rank's list: the call's
            # result for a row is that pair's weighted output.
            out = ops.experts(got_rows[:, :hidden].contiguous(),
                              (got_ids - weights.first_expert).unsqueeze(1),
                              got_rows[:, hidden:].contiguous(), weights.gate_up,
                              weights.down, weights.gate_up_bias, weights.down_bias, swiglu)
        back = x.new_empty(tokens * top_k, hidden)
        self._all_to_all(back, out, sends, recvs)
        pairs = torch.empty_like(back)
        pairs[order] = back
        per_choice = pairs.view(tokens, top_k, hidden)
        if not tokens:
            return x.new_empty(0, hidden)
        out = per_choice[:, 0].clone()
        for choice in range(1, top_k):
            out += per_choice[:, choice]
        return out

    def idle(self, ops: TorchKernels, layers: Any, hidden: int, top_k: int,
             dtype: torch.dtype) -> None:
        """A step without tokens here: this rank's part in every MoE layer's exchanges."""
        x = torch.empty(0, hidden, dtype=dtype)
        ids = torch.empty(0, top_k, dtype=torch.long)
        for layer in layers:
            if layer.experts is not None:
                self(ops, x, ids, x.new_empty(0, top_k), layer.experts, None)

    def _all_to_all(self, output: torch.Tensor, data: torch.Tensor,
                    output_splits: list[int] | None = None,
                    input_splits: list[int] | None = None) -> None:
        self.group.alltoall_base(output, data, output_splits or [], input_splits or [],
                                 dist.AllToAllOptions()).wait()
