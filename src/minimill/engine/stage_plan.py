"""Pipeline stages' share of the model: the decoder layers cut into contiguous ranges of about
equal cost, one per stage (pipeline_runner.py runs them).

A step's time on a stage is its layers' work on the step's rows: the linear layers read each
weight once per row (cost in parameters), attention reads the row's context (a few heads'
worth of dot products per key). The first stage also embeds (a lookup: free); the last also
norms, projects to the vocabulary and samples, which for a small model is several layers'
worth of work on every row that samples (in decode steps, every row). A pipeline runs at the
pace of its slowest stage, so the cut minimises the costliest stage.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from minimill.models.types import ModelConfig

# A decoder layer's weight, its index captured.
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
# The context a token's attention is costed at: the order of the agents' requests.
DEFAULT_CONTEXT_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class StagePlan:
    """Which layers each stage runs (stage k: layers[k]) and what each was estimated to cost,
    in parameter-rows (the units of `layer_costs`)."""

    layers: tuple[range, ...]
    costs: tuple[float, ...]

    @property
    def num_stages(self) -> int:
        return len(self.layers)

    def imbalance(self) -> float:
        """The costliest stage over the mean: what an even split would lose at most."""
        return max(self.costs) * len(self.costs) / sum(self.costs)


def layer_costs(config: ModelConfig, weights: Mapping[str, torch.Tensor],
                context_tokens: int = DEFAULT_CONTEXT_TOKENS) -> list[float]:
    """Each decoder layer's work per token, in parameters read: its weights (a routed
    expert's by the share of tokens that reach it) plus attention over `context_tokens` of
    context (a sliding-window layer's window at most)."""
    costs = [0.0] * config.num_hidden_layers
    expert_share = (config.num_experts_per_tok / config.num_experts if config.num_experts
                    else 1.0)
    for name, tensor in weights.items():
        match = LAYER_NAME.match(name)
        if match is None or int(match.group(1)) >= len(costs):
            continue
        routed = ".experts." in name or name.endswith((".experts.gate_up_proj",
                                                        ".experts.down_proj"))
        costs[int(match.group(1))] += tensor.numel() * (expert_share if routed else 1.0)
    for i in range(len(costs)):
        window = config.sliding_window if config.is_sliding(i) else None
        context = min(context_tokens, window) if window else context_tokens
        # Scores and the weighted sum: two multiply-adds per key, head dimension and query
        # head; a parameter is one multiply-add per row.
        costs[i] += 2 * config.num_attention_heads * config.head_dim * context
    return costs


def head_cost(config: ModelConfig, sampled_share: float = 1.0) -> float:
    """The last stage's extra work per token: the vocabulary projection of the rows that
    sample (`sampled_share` of them; decode steps: all)."""
    return config.vocab_size * config.hidden_size * sampled_share


def plan_stages(costs: Sequence[float], num_stages: int, last_extra: float = 0.0
                ) -> StagePlan:
    """Cut layers with these costs into `num_stages` contiguous, non-empty ranges whose
    costliest (the last one's counting `last_extra`) costs least."""
    n = len(costs)
    if num_stages < 1:
        raise ValueError("a pipeline needs at least one stage")
    if num_stages > n:
        raise ValueError(f"{num_stages} pipeline stages need at least {num_stages} decoder "
                         f"layers; this model has {n}")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)

    def span(a: int, b: int) -> float:
        return prefix[b] - prefix[a] + (last_extra if b == n else 0.0)

    # best[k][j]: the least costliest stage cutting layers [0, j) into k stages.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                worst = max(best[k - 1][i], span(i, j))
                if worst < best[k][j]:
                    best[k][j], cut[k][j] = worst, i
    bounds = [n]
    for k in range(num_stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    ranges = tuple(range(a, b) for a, b in itertools.pairwise(bounds))
    return StagePlan(ranges, tuple(span(r.start, r.stop) for r in ranges))


def plan_at(costs: Sequence[float], starts: Sequence[int], last_extra: float = 0.0
            ) -> StagePlan:
    """The cut that starts a stage at each of `starts` (after the first, at 0), with the
    costs `plan_stages` would give it."""
    n = len(costs)
    bounds = [0, *starts, n]
    if any(b <= a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"stage starts {list(starts)} do not cut {n} layers in order")
    ranges = tuple(range(a, b) for a, b in itertools.pairwise(bounds))
    return StagePlan(ranges, tuple(sum(costs[r.start:r.stop]) + (last_extra if r.stop == n
                                                                   else 0.0)
                                   for r in ranges))
