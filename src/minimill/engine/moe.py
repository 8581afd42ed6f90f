"""Routed experts (Qwen3-MoE): each token goes through its top-k experts' SwiGLU MLPs, and
their outputs are summed with the router's weights.

Tokens are grouped by expert, so each expert that any token chose runs one GEMM for its gate
and up (fused) and one for its down projection, on prepacked weights, over all of its tokens
at once: the loop is over the step's active experts, never over tokens. A token's sum adds
its experts in expert order whatever else is in the batch, and each GEMM row is
batch-invariant (kernels.linear), so a sequence's numbers do not depend on its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minimill.engine.kernels import TorchKernels


@dataclass(slots=True)
class ExpertWeights:
    router: torch.Tensor  # [num_experts, hidden], plain (routing logits read it as F.linear)
    gate_up: list[torch.Tensor]  # per expert [2 * moe_intermediate, hidden], prepared
    down: list[torch.Tensor]  # per expert [hidden, moe_intermediate], prepared


def load_experts(prefix: str, num_experts: int, w: Callable[[str], torch.Tensor],
                 pack: Callable[[torch.Tensor], torch.Tensor]) -> ExpertWeights:
    """The experts under `prefix` ("model.layers.N.mlp.") in HF naming, fused and packed."""
    gate_up, down = [], []
    for e in range(num_experts):
        p = f"{prefix}experts.{e}."
        gate_up.append(pack(torch.cat([w(p + "gate_proj.weight"), w(p + "up_proj.weight")])))
        down.append(pack(w(p + "down_proj.weight")))
    return ExpertWeights(router=w(prefix + "gate.weight").contiguous(), gate_up=gate_up,
                         down=down)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [tokens, top_k], their weights [tokens, top_k] in x's dtype), as HF
    computes them: softmax in float32 over every expert, top-k, optionally renormalised."""
    probs = torch.softmax(torch.nn.functional.linear(x, router).float(), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights.to(x.dtype)


def experts_forward(ops: TorchKernels, x: torch.Tensor, weights: ExpertWeights, top_k: int,
                    normalize: bool) -> torch.Tensor:
    """x: [tokens, hidden] -> the weighted sum of each token's top-k experts' outputs."""
    experts, routing = route(x, weights.router, top_k, normalize)
    flat = experts.flatten()  # token t's j-th choice at t * top_k + j
    # Every (token, choice) pair in expert order; stable, so tokens keep their order.
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=len(weights.gate_up)).tolist()
    flat_weights = routing.flatten()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        hidden = ops.linear(ops.silu_and_mul(ops.linear(x[tokens], weights.gate_up[expert])),
                            weights.down[expert])
        out.index_add_(0, tokens, hidden * flat_weights[pairs, None])
    return out
