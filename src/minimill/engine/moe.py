"""Routed experts (Qwen3-MoE, gpt-oss, DeepSeek-V3): each token goes through its top-k
experts' gated MLPs, and their outputs are summed with the router's weights.

Routing runs in PyTorch ops around the router's GEMM (the kernels' batch-invariant `linear`,
on the router prepared as every other weight). The experts themselves are one call,
`kernels.experts`: it groups the (token, choice) pairs by expert, so each expert that any token
chose runs one GEMM for its gate and up (fused) and one for its down projection, on prepacked
weights, over all of its tokens at once. On the CPU kernels that whole layer (grouping, GEMMs
on the oneDNN weights, activation, weighted sum) is one C++ call (csrc/moe.cpp), with no Python
per expert or token; the portable path loops over the step's active experts in PyTorch
(experts_reference.py). A token's sum adds its experts in the order the router ranked them
whatever else is in the batch, and each GEMM row is batch-invariant (kernels.expert_linear: a
fixed row count per call where AMX needs one, sized for an expert's few rows), so a sequence's
numbers do not depend on its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from minimill.engine.experts_reference import Linear
from minimill.engine.kernels import TorchKernels


@dataclass(slots=True)
class ExpertWeights:
    router: torch.Tensor  # [num_experts, hidden], prepared (the routing's `linear` reads it)
    gate_up: list[torch.Tensor]  # per expert [2 * moe_intermediate, hidden], prepared
    down: list[torch.Tensor]  # per expert [hidden, moe_intermediate], prepared
    # gpt-oss: biases of the router and of each expert's two projections.
    router_bias: torch.Tensor | None = None
    gate_up_bias: list[torch.Tensor] | None = None
    down_bias: list[torch.Tensor] | None = None
    # DeepSeek-V3: float32 [num_experts], added to the sigmoid scores to choose experts.
    score_bias: torch.Tensor | None = None
    # The id of gate_up[0]: an expert-parallel rank holds a range of the experts
    # (expert_share.py); 0 where every expert is here.
    first_expert: int = 0


class ExpertCombine(Protocol):
    """What runs the routed experts in place of `kernels.experts` where they are spread over
    processes (expert_share.ExpertExchange): same arguments, same result."""

    def __call__(self, ops: TorchKernels, x: torch.Tensor, expert_ids: torch.Tensor,
                 routing: torch.Tensor, weights: ExpertWeights,
                 swiglu: tuple[float, float] | None) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class GroupedRouting:
    """DeepSeek-V3's routing (ModelConfig's n_group, topk_group, routed_scaling_factor)."""

    n_group: int
    topk_group: int
    scaling: float


Pack = Callable[[torch.Tensor], torch.Tensor]
# An expert's (gate_up, down) -> both packed (kernels.prepare_expert_weights).
PackExpert = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def load_experts(prefix: str, expert_ids: range, w: Callable[[str], torch.Tensor],
                 pack: Pack, pack_expert: PackExpert) -> ExpertWeights:
    """Qwen3-MoE's experts `expert_ids` (all of them, or an expert-parallel rank's share)
    under `prefix` ("model.layers.N.mlp.") in HF naming, fused and packed: the router by
    `pack` (kernels.prepare_weight), the experts' matrices by `pack_expert`
    (kernels.prepare_expert_weights)."""
    gate_up, down = _expert_matrices(prefix, expert_ids, w, pack_expert)
    return ExpertWeights(router=pack(w(prefix + "gate.weight")), gate_up=gate_up, down=down,
                         first_expert=expert_ids.start)


def _expert_matrices(prefix: str, expert_ids: range, w: Callable[[str], torch.Tensor],
                     pack: PackExpert) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each expert's fused gate/up and its down projection, packed (Qwen3-MoE's naming)."""
    gate_up, down = [], []
    for e in expert_ids:
        p = f"{prefix}experts.{e}."
        packed = pack(torch.cat([w(p + "gate_proj.weight"), w(p + "up_proj.weight")]),
                      w(p + "down_proj.weight"))
        gate_up.append(packed[0])
        down.append(packed[1])
    return gate_up, down


class WeightReader(Protocol):
    """A weight by its HF name, in the model dtype or `as_dtype`."""

    def __call__(self, name: str, as_dtype: torch.dtype = ...) -> torch.Tensor: ...


def load_deepseek_experts(prefix: str, expert_ids: range, w: WeightReader, pack: Pack,
                          pack_expert: PackExpert) -> ExpertWeights:
    """DeepSeek-V3's routed experts (Qwen3-MoE's naming) and its router's correction bias,
    both router tensors in float32 whatever the model dtype, as HF keeps them (the loader
    reads them so, hf_loader._FLOAT32_WEIGHTS)."""
    gate_up, down = _expert_matrices(prefix, expert_ids, w, pack_expert)
    return ExpertWeights(
        router=pack(w(prefix + "gate.weight", torch.float32)), gate_up=gate_up,
        down=down,
        score_bias=w(prefix + "gate.e_score_correction_bias", torch.float32).contiguous(),
        first_expert=expert_ids.start)


def load_gpt_oss_experts(prefix: str, w: Callable[[str], torch.Tensor], pack: Pack,
                         pack_expert: PackExpert) -> ExpertWeights:
    """gpt-oss's experts: HF keeps them as [experts, in, out] tensors with gate and up
    interleaved (even columns gate, odd up); here each expert's gate rows come before its up
    rows, as for every other gated MLP."""
    gate_up_all = w(prefix + "experts.gate_up_proj")  # [E, hidden, 2 * I]
    gate_up_bias = w(prefix + "experts.gate_up_proj_bias")  # [E, 2 * I]
    down_all = w(prefix + "experts.down_proj")  # [E, I, hidden]
    down_bias = w(prefix + "experts.down_proj_bias")  # [E, hidden]
    weights = ExpertWeights(router=pack(w(prefix + "router.weight")), gate_up=[],
                            down=[], router_bias=w(prefix + "router.bias").contiguous(),
                            gate_up_bias=[], down_bias=[])
    assert weights.gate_up_bias is not None and weights.down_bias is not None
    for e in range(gate_up_all.shape[0]):
        fused = gate_up_all[e].t()  # [2 * I, hidden]
        packed = pack_expert(torch.cat([fused[0::2], fused[1::2]]), down_all[e].t())
        weights.gate_up.append(packed[0])
        bias = gate_up_bias[e]
        weights.gate_up_bias.append(torch.cat([bias[0::2], bias[1::2]]).contiguous())
        weights.down.append(packed[1])
        weights.down_bias.append(down_bias[e].contiguous())
    return weights


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool,
          linear: Linear = F.linear) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [tokens, top_k], their weights [tokens, top_k] in x's dtype), as HF
    computes them: softmax in float32 over every expert, top-k, optionally renormalised.
    `linear`: the router's GEMM (the kernels' batch-invariant one, in the engine)."""
    probs = torch.softmax(linear(x, router, None).float(), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights.to(x.dtype)


def route_top_logits(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, top_k: int,
                     linear: Linear = F.linear) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing: the top-k logits (router with bias), softmaxed among themselves."""
    values, experts = linear(x, router, bias).topk(top_k, dim=-1)
    return experts, torch.softmax(values, dim=-1)


def route_grouped(x: torch.Tensor, router: torch.Tensor, score_bias: torch.Tensor,
                  top_k: int, normalize: bool, grouped: GroupedRouting,
                  linear: Linear = F.linear) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing, in float32 as HF computes it: sigmoid scores; the experts are
    chosen by score + bias, among the `topk_group` groups whose two best biased scores sum
    highest; their weights are the unbiased scores (renormalised), times the scaling."""
    scores = linear(x.float(), router, None).sigmoid()  # [tokens, experts]
    choice = scores + score_bias
    per_group = choice.view(x.shape[0], grouped.n_group, -1)
    group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1)[0].sum(dim=-1)
    groups = group_scores.topk(grouped.topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    choice = choice.masked_fill(~keep.repeat_interleave(per_group.shape[-1], dim=1),
                                float("-inf"))
    experts = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return experts, weights * grouped.scaling


def experts_forward(ops: TorchKernels, x: torch.Tensor, weights: ExpertWeights, top_k: int,
                    normalize: bool, swiglu: tuple[float, float] | None = None,
                    grouped: GroupedRouting | None = None,
                    combine: ExpertCombine | None = None) -> torch.Tensor:
    """x: [tokens, hidden] -> the weighted sum of each token's top-k experts' outputs.
    `swiglu`: gpt-oss's (alpha, limit); else the experts' gate is SiLU. `grouped`: route
    as DeepSeek-V3 does (the weights have a score_bias). `combine`: where the experts are
    spread over processes, what runs them (expert_share.py); None: every expert is here."""
    if grouped is not None:
        assert weights.score_bias is not None
        experts, routing = route_grouped(x, weights.router, weights.score_bias, top_k,
                                         normalize, grouped, ops.linear)
    elif weights.router_bias is not None:
        experts, routing = route_top_logits(x, weights.router, weights.router_bias, top_k,
                                            ops.linear)
    else:
        experts, routing = route(x, weights.router, top_k, normalize, ops.linear)
    if combine is not None:
        return combine(ops, x, experts, routing, weights, swiglu)
    return ops.experts(x, experts, routing, weights.gate_up, weights.down,
                       weights.gate_up_bias, weights.down_bias, swiglu)
