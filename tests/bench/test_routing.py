"""Balanced routers for random-weights mixtures of experts (bench/routing.py): a router drawn
at random sends every token to the same few experts when the tokens' hidden states share a
large direction, as a random model's do; the redrawn router spreads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from minimill.bench.hf_baseline import build_hf_model
from minimill.bench.routing import _router_modules, balance_routers, balanced_router
from minimill.models.loader import load_model
from minimill.models.shapes import random_model
from minimill.models.tokenizer import Tokenizer
from minimill.models.types import LoadedModel, ModelConfig

EXPERTS, TOP_K = 16, 4

TINY_MOE = ModelConfig(
    architecture="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=512,
    tie_word_embeddings=False, qk_norm=True, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
    moe_intermediate_size=32, norm_topk_prob=True)


@pytest.fixture(scope="module")
def tokenizer(model_file: Path) -> Tokenizer:
    return load_model(str(model_file), torch.float32).tokenizer


def _experts_chosen(router: torch.Tensor, inputs: torch.Tensor) -> int:
    return int(torch.unique((inputs @ router.T).topk(TOP_K, dim=-1).indices).numel())


def test_a_balanced_router_ignores_the_direction_its_inputs_share() -> None:
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(64, generator=g)
    # Tokens that are mostly one vector, as a random model's hidden states are.
    inputs = 20 * shared + torch.randn(256, 64, generator=g)
    drawn = torch.randn(EXPERTS, 64, generator=g) * 0.02
    balanced = balanced_router(inputs, EXPERTS, torch.Generator().manual_seed(1))
    assert balanced.shape == (EXPERTS, 64)
    # Its scores of the shared direction vanish; the drawn router's do not.
    mean = inputs.mean(dim=0)
    assert (balanced @ mean).abs().max() < 1e-4 * (drawn @ mean).abs().max()
    # So tokens spread over the experts instead of all picking the same TOP_K.
    assert _experts_chosen(drawn, inputs) <= TOP_K + 2
    assert _experts_chosen(balanced, inputs) >= EXPERTS - 2


def _router_inputs(loaded: LoadedModel, tokens: list[int]) -> dict[str, torch.Tensor]:
    """What each router of transformers' model of these weights reads for these tokens."""
    model = build_hf_model(loaded, torch.float32)
    inputs: dict[str, torch.Tensor] = {}
    for name, module in _router_modules(model).items():
        module.register_forward_pre_hook(
            lambda _m, args, name=name: inputs.setdefault(name, args[0].reshape(
                -1, TINY_MOE.hidden_size).clone()))
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]), use_cache=False)
    return inputs


def test_balance_routers_replaces_every_router_of_a_random_moe_and_leaves_the_rest(
        tokenizer: Tokenizer) -> None:
    g = torch.Generator().manual_seed(2)
    calibration = [torch.randint(3, 512, (40,), generator=g).tolist() for _ in range(4)]
    loaded = random_model("tiny moe", TINY_MOE, torch.float32, tokenizer, seed=4)
    before = {name: w.clone() for name, w in loaded.weights.items()}

    routers = balance_routers(loaded, calibration, torch.float32, seed=4)

    names = {f"model.layers.{i}.mlp.gate.weight" for i in range(TINY_MOE.num_hidden_layers)}
    assert set(routers) == names
    for name, weight in loaded.weights.items():
        if name in names:
            assert weight is routers[name] and weight.shape == before[name].shape
            assert weight.dtype == before[name].dtype
            assert not torch.equal(weight, before[name])
        else:
            assert torch.equal(weight, before[name]), name
    # Each router was drawn blind to the mean of what it reads, layer after layer: with the
    # routers before it balanced too (what it read while the calibration pass ran).
    tokens = [t for prompt in calibration for t in prompt]
    for module_name, seen in _router_inputs(loaded, tokens).items():
        mean = seen.mean(dim=0)
        key = f"{module_name}.weight"
        assert (routers[key] @ mean).abs().max() < 1e-4 * (before[key] @ mean).abs().max()
    # The same seed and prompts give the same routers (a peer's model drawn again gets them).
    again = random_model("tiny moe", TINY_MOE, torch.float32, tokenizer, seed=4)
    for name, weight in balance_routers(again, calibration, torch.float32, seed=4).items():
        assert torch.equal(weight, routers[name])


def test_a_bare_config_is_the_architecture_its_model_type_names(tmp_path: Path) -> None:
    """`bench engine --config` of a config.json without `architectures`: its model_type picks
    the architecture (a mixture of experts measured as a dense Llama would be routed by
    nothing); one minimill does not run is refused by name."""
    from minimill.models.shapes import shape_from_hf_config
    from minimill.models.types import ModelFileError

    def shape(model_type: str) -> ModelConfig:
        path = tmp_path / model_type / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps({
            "model_type": model_type, "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32}))
        return shape_from_hf_config(path)

    moe = shape("qwen3_moe")
    assert (moe.architecture, moe.num_experts, moe.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert shape("qwen2").architecture == "qwen2"
    assert shape("mistral").architecture == "llama"
    with pytest.raises(ModelFileError, match=r"model_type 'bert' not supported.*qwen3_moe"):
        shape("bert")
