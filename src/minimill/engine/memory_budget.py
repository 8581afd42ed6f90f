"""`max_memory_gb`: a bound on what each process of the engine holds, its weights and its KV
pool (the interpreter and the runtime around them are not counted).

A model whose weights and KV do not fit one process's budget is cut into pipeline stages
(stage_plan.py's cut, by cost) with one more stage at a time until every stage's share fits:
a stage holds its own decoder layers' weights (the first also the embedding, the last the
final norm and the vocabulary projection, which a tied model shares with the embedding) and
a KV pool of its own layers. Every stage's pool has the same number of blocks (a block id
means the same tokens on every stage): as many as the tightest stage's budget leaves room
for. Sizes come from the checkpoint's tensor shapes in the engine's dtype, before any bytes
are read; each stage then reads only its own tensors (`StageWeights`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from minimill.engine.params import InvalidRequestError
from minimill.engine.stage_plan import (
    LAYER_NAME,
    StagePlan,
    head_cost,
    layer_costs,
    plan_stages,
)
from minimill.models.types import ModelConfig

GIB = 1 << 30
# Each stage keeps room in its budget for at least this many tokens of KV: a pool smaller
# than one step's prefill would leave the engine little to batch.
MIN_KV_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class StageWeights:
    """The weights the stage running `layers` needs: a loader's `keep`, which crosses to the
    stage's process with it."""

    layers: range
    num_layers: int
    tied: bool  # the vocabulary projection is the embedding

    @classmethod
    def of(cls, layers: range, config: ModelConfig) -> StageWeights:
        return cls(layers, config.num_hidden_layers, config.tie_word_embeddings)

    def __call__(self, name: str) -> bool:
        match = LAYER_NAME.match(name)
        if match is not None:
            return int(match.group(1)) in self.layers
        first, last = self.layers.start == 0, self.layers.stop == self.num_layers
        if name == "model.embed_tokens.weight":
            return first or (last and self.tied)
        if name in ("model.norm.weight", "lm_head.weight"):
            return last
        return True  # any other weight outside the layers: every stage keeps its own copy


def stage_weight_bytes(shapes: Mapping[str, torch.Tensor], layers: range,
                       config: ModelConfig) -> int:
    keeps = StageWeights.of(layers, config)
    return sum(t.numel() * t.element_size() for name, t in shapes.items() if keeps(name))


@dataclass(frozen=True, slots=True)
class StageMemory:
    """How a model is cut to fit the budget, and what each stage then holds."""

    plan: StagePlan
    weight_bytes: tuple[int, ...]  # per stage
    kv_block_bytes: tuple[int, ...]  # one pool block of each stage's layers
    num_kv_blocks: int  # every stage's pool

    def stage_bytes(self, stage: int) -> int:
        return self.weight_bytes[stage] + self.num_kv_blocks * self.kv_block_bytes[stage]


def fit_stages(config: ModelConfig, shapes: Mapping[str, torch.Tensor], budget_gb: float,
               layer_block_bytes: int, block_size: int, *, min_stages: int = 1,
               num_kv_blocks: int | None = None, max_model_len: int | None = None,
               max_kv_bytes: int | None = None) -> StageMemory:
    """The fewest stages (at least `min_stages`) whose weights and KV pools each fit
    `budget_gb`; `num_kv_blocks`, if given, is the pool every stage must hold, else the pools
    take what the budget leaves (at least MIN_KV_TOKENS, or a whole `max_model_len` context
    if that is shorter), none over `max_kv_bytes` (the pool the engine takes unbudgeted).
    Refuses, naming the budget, when none does."""
    if not budget_gb > 0:
        raise InvalidRequestError(f"max_memory_gb must be > 0, got {budget_gb}")
    budget = int(budget_gb * GIB)
    costs = layer_costs(config, shapes)
    min_tokens = min(MIN_KV_TOKENS, max_model_len or config.max_position_embeddings)
    need_blocks = num_kv_blocks or math.ceil(min_tokens / block_size)
    smallest_need = None
    for num_stages in range(max(1, min_stages), config.num_hidden_layers + 1):
        plan = plan_stages(costs, num_stages, head_cost(config))
        weights = tuple(stage_weight_bytes(shapes, r, config) for r in plan.layers)
        block_bytes = tuple(len(r) * layer_block_bytes for r in plan.layers)
        room = min((budget - w) // b for w, b in zip(weights, block_bytes, strict=True))
        if room >= need_blocks:
            if num_kv_blocks is None and max_kv_bytes is not None:
                room = max(need_blocks, min(room, max_kv_bytes // max(block_bytes)))
            return StageMemory(plan, weights, block_bytes, num_kv_blocks or int(room))
        smallest_need = max(w + need_blocks * b for w, b in zip(weights, block_bytes,
                                                                 strict=True))
    assert smallest_need is not None  # a model has at least one layer
    raise InvalidRequestError(
        f"max_memory_gb (--max-memory-gb) {budget_gb:g} is {budget / GIB:.3f} GiB a process, "
        f"too little for even one decoder layer a stage: the largest of "
        f"{config.num_hidden_layers} one-layer stages needs {smallest_need / GIB:.3f} GiB "
        f"(its weights and a KV pool of {need_blocks * block_size} tokens)")
