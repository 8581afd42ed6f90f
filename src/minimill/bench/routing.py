"""Routers for a random-weights mixture of experts that spread tokens over the experts as a
trained model's do.

With every weight drawn at random, a layer's hidden states share a few large directions
(attention over random keys averages the values, so every token gets much the same mix), and a
router drawn at random scores the experts by those directions: every token picks nearly the
same few. Measured on qwen3-moe-2.9b-a0.7b: a 32-token decode step sent its tokens to 12 of
the 64 experts (median), the top five taking nearly all of them. A trained router, balanced by
its training loss, spreads a step's tokens over most experts; a bench on the random one
measures a dense model of a few experts (few experts' weights read per step, many rows each),
not a mixture of experts.

`balance_routers` redraws each router blind to those directions: one forward pass of
transformers' model of the same weights over calibration prompts, and at each router, in layer
order, the mean and the first principal directions of its input are projected out of a fresh
random draw. The same 32-token steps then touch 46 of the 64 experts (median). The redrawn
routers replace the drawn ones in the model's weights, so the engine and every baseline run
the same numbers.
"""

from __future__ import annotations

from typing import Any

import torch

from minimill.models.types import LoadedModel

# Directions of a router's input projected out besides its mean (more changed nothing measured:
# 16 and 64 gave the same spread as 8 within a few experts).
DIRECTIONS = 8
# Calibration tokens: the prompts, one after the other, up to this many.
CALIBRATION_TOKENS = 512
# The spread of a drawn weight (shapes.random_model's).
_STD = 0.02


def _router_modules(model: Any) -> dict[str, torch.nn.Module]:
    """transformers' routers by module name: Qwen3-MoE's and DeepSeek-V3's `mlp.gate`,
    gpt-oss's `mlp.router` (each a module with a [experts, hidden] weight)."""
    return {name: module for name, module in model.named_modules()
            if name.endswith(("mlp.gate", "mlp.router"))
            and isinstance(getattr(module, "weight", None), torch.Tensor)
            and module.weight.dim() == 2}


def balanced_router(inputs: torch.Tensor, experts: int, generator: torch.Generator,
                    directions: int = DIRECTIONS) -> torch.Tensor:
    """A random [experts, hidden] router (float32) whose scores ignore the mean and the first
    `directions` principal directions of `inputs` [tokens, hidden]."""
    x = inputs.reshape(-1, inputs.shape[-1]).float()
    mean = x.mean(dim=0)
    basis = [mean / mean.norm().clamp_min(1e-12)]
    if directions:
        _, _, components = torch.linalg.svd(x - mean, full_matrices=False)
        basis.extend(components[:directions])
    orthonormal = torch.linalg.qr(torch.stack(basis, dim=1))[0]  # [hidden, 1 + directions]
    drawn = torch.randn(experts, x.shape[1], generator=generator) * _STD
    return drawn - (drawn @ orthonormal) @ orthonormal.T


def balance_routers(loaded: LoadedModel, prompts: list[list[int]], dtype: torch.dtype,
                    seed: int = 0) -> dict[str, torch.Tensor]:
    """Replace the routers in `loaded.weights` by balanced ones (see the module's docstring);
    returns them by weight name, to put back into a model of the same seed drawn again."""
    from minimill.bench.hf_baseline import build_hf_model

    tokens = [t for prompt in prompts for t in prompt][:CALIBRATION_TOKENS]
    if not tokens:
        raise ValueError("balance_routers: no calibration tokens")
    model = build_hf_model(loaded, dtype)
    routers = _router_modules(model)
    if not routers:
        raise ValueError(f"{loaded.config.architecture}: no routers found to balance")
    generator = torch.Generator().manual_seed(seed)
    balanced: dict[str, torch.Tensor] = {}
    handles = []

    def redraw(name: str, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if name in balanced:
            return
        current: torch.Tensor = getattr(module, "weight")  # noqa: B009 (a Module's attribute)
        weight = balanced_router(args[0], current.shape[0], generator)
        balanced[name] = weight.to(loaded.weights[f"{name}.weight"].dtype)
        with torch.no_grad():
            current.copy_(weight)

    for name, module in routers.items():
        handles.append(module.register_forward_pre_hook(
            lambda module, args, name=name: redraw(name, module, args)))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens]), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    del model
    if len(balanced) != len(routers):
        raise ValueError(f"balance_routers: {len(routers) - len(balanced)} routers were not "
                         "reached by the calibration pass")
    weights = {f"{name}.weight": w for name, w in balanced.items()}
    loaded.weights.update(weights)
    return weights
