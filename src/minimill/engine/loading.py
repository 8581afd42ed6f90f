"""A model loaded with the engine config derived for it, what every front end starts its
EngineCore with; under a `max_memory_gb` budget (memory_budget.py), cut into the pipeline
stages that fit it, this process reading only the first stage's weights; with expert
parallelism, only rank 0's share of the experts (expert_share.py)."""

from __future__ import annotations

import logging
from typing import Any

from minimill.engine.config import EngineConfig
from minimill.engine.expert_share import ExpertShare
from minimill.engine.memory_budget import GIB, StageWeights, fit_stages
from minimill.engine.params import InvalidRequestError
from minimill.models.loader import load_model
from minimill.models.types import LoadedModel

log = logging.getLogger(__name__)


def load_with_config(model: str | LoadedModel, overrides: dict[str, Any], *,
                     auto_pull: bool = False) -> tuple[LoadedModel, EngineConfig]:
    """The loaded model and the engine config derived for it (what every front end starts
    its EngineCore with)."""
    probe = EngineConfig(**overrides)  # validates the overrides before a slow load
    if probe.max_memory_gb is not None:
        return _load_within_budget(model, overrides, probe, auto_pull=auto_pull)
    if isinstance(model, str):
        loaded = load_model(model, probe.torch_dtype, auto_pull=auto_pull,
                            keep=_expert_share(model, overrides, probe, auto_pull))
        overrides = {**overrides, "model": model}
    else:
        loaded = model
        overrides = {"model": loaded.name, **overrides}
    return loaded, EngineConfig(**overrides, model_config=loaded.config)


def _nothing(_name: str) -> bool:
    return False


def _expert_share(model: str, overrides: dict[str, Any], probe: EngineConfig,
                  auto_pull: bool) -> ExpertShare | None:
    """With expert parallelism, rank 0's share of the experts (the model's shapes read
    first, for its number of experts): this process reads no other rank's experts."""
    if probe.expert_parallel == 1:
        return None
    outline = load_model(model, probe.torch_dtype, auto_pull=auto_pull, keep=_nothing)
    # What the model cannot run with is refused here, before a slow load.
    EngineConfig(**overrides, model_config=outline.config)
    return ExpertShare(0, probe.expert_parallel, outline.config.num_experts)


def _load_within_budget(model: str | LoadedModel, overrides: dict[str, Any],
                       probe: EngineConfig, *, auto_pull: bool = False
                       ) -> tuple[LoadedModel, EngineConfig]:
    """load_with_config for a `max_memory_gb` budget: the model's shapes first, the cut that
    fits, then only the first stage's weights (the other stages read their own)."""
    assert probe.max_memory_gb is not None
    dtype = probe.torch_dtype
    if isinstance(model, str):
        outline = load_model(model, dtype, auto_pull=auto_pull, keep=_nothing)
        shapes = outline.extra["weight_shapes"]
    else:
        outline, shapes = model, model.weights
    mc = outline.config
    memory = fit_stages(mc, shapes, probe.max_memory_gb, probe.layer_block_bytes(mc),
                        probe.block_size, min_stages=probe.pipeline_stages,
                        num_kv_blocks=probe.num_kv_blocks, max_model_len=probe.max_model_len,
                        max_kv_bytes=probe.default_kv_bytes())
    plan = memory.plan
    if not isinstance(model, str) and plan.num_stages > 1:
        raise InvalidRequestError(
            f"max_memory_gb {probe.max_memory_gb:g} needs {plan.num_stages} pipeline stages "
            "for this model, and each stage reads its own weights: give the model by name or "
            "path, not loaded already (this process holds all of its weights)")
    overrides = {**overrides, "pipeline_stages": plan.num_stages,
                 "num_kv_blocks": memory.num_kv_blocks,
                 "stage_starts": tuple(r.start for r in plan.layers[1:])}
    try:
        EngineConfig(**overrides)  # what stages do not run yet, refused before the load
    except InvalidRequestError as exc:
        raise InvalidRequestError(
            f"max_memory_gb {probe.max_memory_gb:g} needs {plan.num_stages} pipeline stages "
            f"for this model, and {exc}") from None
    log.info("max_memory_gb %g: %d stages, layers %s; each holds %s GiB of weights and KV "
             "(%d blocks of %d tokens)", probe.max_memory_gb, plan.num_stages,
             [(r.start, r.stop) for r in plan.layers],
             [f"{memory.stage_bytes(k) / GIB:.3f}" for k in range(plan.num_stages)],
             memory.num_kv_blocks, probe.block_size)
    if isinstance(model, str):
        loaded = load_model(model, dtype, keep=None if plan.num_stages == 1
                            else StageWeights.of(plan.layers[0], mc))
        # The budget counts one copy of each weight: the engine takes them over as it builds.
        loaded.extra["release_weights"] = True
        overrides["model"] = model
    else:
        loaded = model
        overrides = {"model": loaded.name, **overrides}
    return loaded, EngineConfig(**overrides, model_config=loaded.config)
