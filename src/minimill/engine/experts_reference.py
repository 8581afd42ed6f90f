"""Routed experts in PyTorch ops (moe.py): the portable path, and the reference that the
compiled CPU kernel (csrc/moe.cpp) matches bit for bit when it is given the same GEMM and the
same activation."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def grouped_experts(x: torch.Tensor, expert_ids: torch.Tensor, routing: torch.Tensor,
                    gate_up: Sequence[torch.Tensor], down: Sequence[torch.Tensor],
                    gate_up_bias: Sequence[torch.Tensor] | None,
                    down_bias: Sequence[torch.Tensor] | None, linear: Linear,
                    activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [tokens, hidden], each token's experts and their weights [tokens, top_k] -> the
    weighted sum of its experts' outputs [tokens, hidden]. Tokens are grouped by expert, so
    each expert that any token chose runs `linear` once for its gate and up (fused) and once
    for its down projection over all of its tokens: the loop is over the step's active
    experts, never over tokens."""
    top_k = expert_ids.shape[1]
    flat = expert_ids.flatten()  # token t's j-th choice at t * top_k + j
    # Every (token, choice) pair in expert order; stable, so tokens keep their order. The rows
    # are gathered once, so each expert's rows are a slice of one tensor.
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=len(gate_up)).tolist()
    rows = x[order // top_k]
    outputs = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        end = start + count
        act = activation(linear(rows[start:end], gate_up[expert],
                                gate_up_bias[expert] if gate_up_bias else None))
        outputs[start:end] = linear(act, down[expert], down_bias[expert] if down_bias else None)
        start = end
    # Back to (token, choice) order, weighted, and each token's choices summed one after the
    # other: the same additions in the same order whatever else is in the batch.
    weighted = torch.empty_like(outputs)
    weighted[order] = (outputs * routing.flatten()[order, None]).to(outputs.dtype)
    per_choice = weighted.view(x.shape[0], top_k, -1)
    out = per_choice[:, 0].clone()
    for choice in range(1, top_k):
        out += per_choice[:, choice]
    return out
