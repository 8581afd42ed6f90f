"""DeepSeek-V3 (multi-head latent attention over a latent cache, grouped sigmoid routing with
shared experts) against transformers: tiny random checkpoints saved as HF directories,
with a query bottleneck and without, loaded by minimill; float32 logits and greedy tokens
compared over prompts longer than a KV block, several sequences per batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import assert_logits_match, engine_logits

from minimill.engine.llm import LLM
from minimill.engine.params import InvalidRequestError, SamplingParams
from minimill.models.loader import load_model
from minimill.models.shapes import random_model
from minimill.models.types import LoadedModel
from tiny_hf import DEEPSEEK_V3, VOCAB, hf_greedy, save_tiny

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["q_lora", "plain_q"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         smol_f32: LoadedModel) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp(f"deepseek_v3_{request.param}")
    overrides = {"q_lora_rank": None} if request.param == "plain_q" else {}
    return directory, save_tiny("deepseek_v3", directory, smol_f32, **overrides)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    # Each past one KV block (16 tokens) and the chunk (20) of the chunked runs.
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (45, 23, 33)]


def test_config_and_parameter_count(tiny: tuple[Path, Any]) -> None:
    directory, hf = tiny
    mc = load_model(str(directory), torch.float32).config
    assert mc.architecture == "deepseek_v3" and mc.is_mla
    assert mc.dense_layers == (0,) and [mc.is_moe(i) for i in range(3)] == [False, True, True]
    assert (mc.n_group, mc.topk_group, mc.n_shared_experts) == (2, 1, 1)
    assert mc.kv_layout == (1, 1, DEEPSEEK_V3["kv_lora_rank"] + DEEPSEEK_V3["qk_rope_head_dim"])
    # Matrices a forward pass reads: every parameter but the norms and the embedding lookup.
    matrices = sum(p.numel() for n, p in hf.named_parameters()
                   if not n.endswith("norm.weight") and "embed_tokens" not in n)
    assert mc.num_params == matrices
    routed = 3 * mc.hidden_size * mc.moe_intermediate_size
    assert mc.num_params - mc.num_active_params == 2 * (8 - 2) * routed


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_logits_and_greedy_match_transformers(tiny: tuple[Path, Any], kernels: str) -> None:
    directory, hf = tiny
    llm = LLM(load_model(str(directory), torch.float32), dtype="float32", num_kv_blocks=64,
              kernels=kernels)
    prompts = _prompts()
    assert_logits_match(llm, hf, prompts, kernels)
    outs = llm.generate(prompts, GREEDY)  # one batch: prefill together, then decode together
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.output_token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)[0]


def test_the_cache_holds_one_latent_per_token_and_layer(tiny: tuple[Path, Any]) -> None:
    directory, _ = tiny
    loaded = load_model(str(directory), torch.float32)
    mc = loaded.config
    width = mc.kv_lora_rank + mc.qk_rope_head_dim
    llm = LLM(loaded, dtype="float32", num_kv_blocks=8)
    assert llm.engine.runner.kv_cache.shape == (8, mc.num_hidden_layers, 1, 1, 16 * width)
    assert llm.config.kv_bytes_per_token(mc) == mc.num_hidden_layers * width * 4
    int8 = LLM(loaded, dtype="float32", kv_dtype="int8", num_kv_blocks=8)
    # int8: the values plus a float16 scale and an int8 zero point per token and layer.
    assert int8.config.kv_bytes_per_token(mc) == mc.num_hidden_layers * (width + 3)
    with pytest.raises(InvalidRequestError, match="int4 is not supported"):
        LLM(loaded, dtype="float32", kv_dtype="int4", num_kv_blocks=8)


def test_prefix_reuse_gives_the_cold_run_s_tokens(tiny: tuple[Path, Any]) -> None:
    directory, _ = tiny
    loaded = load_model(str(directory), torch.float32)
    hot = LLM(loaded, dtype="float32", num_kv_blocks=64)
    cold = LLM(loaded, dtype="float32", num_kv_blocks=64, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(5)
    system = torch.randint(3, VOCAB, (2 * 16,), generator=g).tolist()
    prompts = [[*system, *torch.randint(3, VOCAB, (7 + i,), generator=g).tolist()]
               for i in range(3)]
    out = hot.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in out] == [0, 32, 32]
    assert ([o.output_token_ids for o in out]
            == [o.output_token_ids for o in cold.generate(prompts, GREEDY)])
    # A next turn reuses the blocks the first turn's generated tokens filled.
    turn2 = [*prompts[0], *out[0].output_token_ids, *system[:9]]
    again = hot.generate([turn2], GREEDY)[0]
    assert again.num_cached_tokens == 3 * 16
    assert again.output_token_ids == cold.generate([turn2], GREEDY)[0].output_token_ids


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_compressed_latents_stay_close(tiny: tuple[Path, Any], kv_dtype: str) -> None:
    """A bf16 model (bf16 latents), and int8 latents under a float32 model, stay close to the
    float32 reference. Not at every position: a rounded score can move a token to another
    expert, and a tiny random model's logits swing with that (measured: the worst position
    of int8 latents is off by 80%, as quantizing either half of the latent alone does)."""
    directory, hf = tiny
    dtype = torch.bfloat16 if kv_dtype == "bfloat16" else torch.float32
    llm = LLM(load_model(str(directory), dtype), dtype=str(dtype).removeprefix("torch."),
              kv_dtype=kv_dtype, num_kv_blocks=64)
    prompts = _prompts()
    with torch.inference_mode():
        refs = [hf(torch.tensor([p])).logits[0] for p in prompts]
    ours = engine_logits(llm, prompts, 20)
    errors = torch.cat([(o.float() - r).norm(dim=-1) / r.norm(dim=-1)
                        for o, r in zip(ours, refs, strict=True)])
    agree = torch.cat([o.float().argmax(-1) == r.argmax(-1)
                       for o, r in zip(ours, refs, strict=True)]).float().mean()
    assert errors.median() < 0.05 and errors.quantile(0.9) < 0.1, kv_dtype
    # Measured: 84% to 95% (a random model's top two logits are often close).
    assert agree >= 0.8, f"{kv_dtype}: top tokens agree at {agree:.0%} of positions"


def test_routing_matches_transformers_router() -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from minimill.engine.moe import GroupedRouting, route_grouped

    config = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4,
                              n_group=4, topk_group=2, routed_scaling_factor=2.5,
                              norm_topk_prob=True)
    torch.manual_seed(0)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.3)
    x = torch.randn(64, 32)
    _, ref_weights, ref_experts = router(x)
    experts, weights = route_grouped(x, router.weight.detach(), router.e_score_correction_bias,
                                     4, True, GroupedRouting(4, 2, 2.5))
    ours, ref = experts.sort(dim=-1), ref_experts.sort(dim=-1)
    assert torch.equal(ours.values, ref.values)
    torch.testing.assert_close(weights.gather(1, ours.indices),
                               ref_weights.gather(1, ref.indices))


def test_a_sequence_computes_the_same_alone_or_in_a_batch(tiny: tuple[Path, Any]) -> None:
    directory, _ = tiny
    llm = LLM(load_model(str(directory), torch.float32), dtype="float32", num_kv_blocks=64,
              kernels="native")
    first, second, third = _prompts()
    alone = engine_logits(llm, [first])[0]
    crowded = engine_logits(llm, [second, first, third[:7]])[1]
    # Bit for bit: what makes a resumed request continue exactly.
    assert torch.equal(alone, crowded)


def test_the_benchmark_s_transformers_model_is_the_checkpoint_s(tiny: tuple[Path, Any]
                                                                ) -> None:
    from minimill.bench.hf_baseline import build_hf_model

    directory, hf = tiny
    rebuilt = build_hf_model(load_model(str(directory), torch.float32), torch.float32)
    prompt = torch.tensor([_prompts()[0]])
    with torch.inference_mode():
        torch.testing.assert_close(rebuilt(prompt).logits, hf(prompt).logits)


def test_random_weight_shapes_are_the_checkpoint_s(tiny: tuple[Path, Any]) -> None:
    """`bench engine --shape` builds DeepSeek-V3 shapes from weight_shapes: every tensor of
    a real checkpoint, no more."""
    from minimill.models.shapes import weight_shapes

    directory, _ = tiny
    loaded = load_model(str(directory), torch.float32)
    assert weight_shapes(loaded.config) == {n: tuple(w.shape) for n, w in loaded.weights.items()}


def test_a_multi_token_prediction_layer_is_not_loaded(tiny: tuple[Path, Any],
                                                       tmp_path: Path) -> None:
    """DeepSeek-V3's checkpoints hold a multi-token prediction layer past the decoder's
    (model.layers.61): the engine does not run it, so its weights are never held."""
    import json
    import shutil

    from safetensors.torch import save_file

    directory, _ = tiny
    copy = tmp_path / "with_mtp"
    shutil.copytree(directory, copy)
    save_file({"model.layers.3.eh_proj.weight": torch.zeros(4, 4),
               "model.layers.3.self_attn.kv_b_proj.weight": torch.zeros(4, 4)},
              str(copy / "mtp.safetensors"))
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    index["weight_map"].update({"model.layers.3.eh_proj.weight": "mtp.safetensors",
                                "model.layers.3.self_attn.kv_b_proj.weight": "mtp.safetensors"})
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    weights = load_model(str(copy), torch.float32).weights
    assert not any(name.startswith("model.layers.3.") for name in weights)
    assert "model.layers.2.self_attn.kv_b_proj.weight" in weights


def test_kimi_k2_s_config() -> None:
    """Kimi K2 ships DeepSeek-V3's architecture with its own numbers (as in its config.json,
    less the FP8 quantization_config of the released weights)."""
    from minimill.models.hf_config import config_from_hf

    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
           "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
           "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
           "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 384,
           "routed_scaling_factor": 2.827, "kv_lora_rank": 512, "q_lora_rank": 1536,
           "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
           "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
           "first_k_dense_replace": 1, "norm_topk_prob": True, "scoring_func": "sigmoid",
           "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
           "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                            "type": "yarn"},
           "attention_bias": False, "tie_word_embeddings": False}
    mc = config_from_hf(cfg, Path("config.json"))
    assert mc.architecture == "deepseek_v3" and mc.kv_layout == (1, 1, 576)
    assert (mc.num_experts, mc.n_group, mc.topk_group, mc.dense_layers) == (384, 1, 1, (0,))
    assert mc.head_dim == 64 and mc.rope_scaling is not None
    assert mc.rope_scaling["rope_type"] == "yarn"
    # 192 ** -0.5 times (0.1 ln 32 + 1) squared.
    assert mc.attention_scale == pytest.approx(192 ** -0.5 * 1.3465735902799727 ** 2)
    assert 1.00e12 < mc.num_params < 1.05e12 and 31e9 < mc.num_active_params < 33e9


def test_attention_in_query_slices_computes_the_same(tiny: tuple[Path, Any],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt chunk's attention runs a few query positions at a time (bounded
    scores): the same logits as all at once."""
    from minimill.engine import mla

    directory, _ = tiny
    llm = LLM(load_model(str(directory), torch.float32), dtype="float32", num_kv_blocks=64)
    whole = engine_logits(llm, _prompts(), 20)
    monkeypatch.setattr(mla, "_MAX_SCORES", 3 * 4 * 48 * 3)  # 3 positions a call, 3 sequences
    for sliced, ref in zip(engine_logits(llm, _prompts(), 20), whole, strict=True):
        torch.testing.assert_close(sliced, ref, rtol=1e-5, atol=1e-5)


def test_latent_blocks_restored_from_host_ram_and_flash(tiny: tuple[Path, Any],
                                                        tmp_path: Path) -> None:
    """The KV tiers copy whole latent blocks as they copy K and V: a prompt's blocks pushed out
    of a small pool come back from host RAM, and in a new engine from flash, and give the
    tokens a cold engine computes."""
    directory, _ = tiny
    loaded = load_model(str(directory), torch.float32)
    small = {"dtype": "float32", "num_kv_blocks": 24, "max_model_len": 256}
    g = torch.Generator().manual_seed(9)
    prompt, *others = (torch.randint(3, VOCAB, (n,), generator=g).tolist()
                       for n in (160, 200, 200))
    expected = LLM(loaded, enable_prefix_caching=False, **small).generate(
        [prompt], GREEDY)[0].output_token_ids
    flash = str(tmp_path / "flash")
    tiered = LLM(loaded, kv_host_bytes=16 << 20, kv_flash_dir=flash, kv_flash_bytes=64 << 20,
                 **small)
    assert tiered.generate([prompt], GREEDY)[0].output_token_ids == expected
    for other in others:  # push the prompt's blocks out of the pool
        tiered.generate([other], GREEDY)
    out = tiered.generate([prompt], GREEDY)[0]
    assert tiered.engine.tiers is not None and tiered.engine.tiers.stats.host_hits == 9
    assert out.num_cached_tokens == 144 and out.output_token_ids == expected
    tiered.close()
    restarted = LLM(loaded, kv_flash_dir=flash, kv_flash_bytes=64 << 20, **small)
    out = restarted.generate([prompt], GREEDY)[0]
    assert restarted.engine.tiers is not None and restarted.engine.tiers.stats.flash_hits == 9
    assert out.num_cached_tokens == 144 and out.output_token_ids == expected
    restarted.close()


def test_the_router_stays_float32_in_a_bf16_model(tiny: tuple[Path, Any]) -> None:
    """As transformers keeps it: the scores that pick experts, and the correction bias stored
    in float32, are not rounded to bf16."""
    directory, hf = tiny
    loaded = load_model(str(directory), torch.bfloat16)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert loaded.weights["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert torch.equal(loaded.weights[bias], hf.state_dict()[bias])
    assert loaded.weights["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
    experts = LLM(loaded, dtype="bfloat16", num_kv_blocks=8).engine.runner.model.layers[1].experts
    assert experts is not None and experts.score_bias is not None
    assert experts.router.dtype == experts.score_bias.dtype == torch.float32


def test_random_weights_of_its_shape_run(tiny: tuple[Path, Any]) -> None:
    """`bench engine --random-weights --shape`: the engine takes each random weight over as it
    builds (release_weights), so every weight must be read exactly once."""
    directory, _ = tiny
    loaded = load_model(str(directory), torch.float32)
    model = random_model("tiny-deepseek", loaded.config, torch.float32, loaded.tokenizer)
    llm = LLM(model, dtype="float32", num_kv_blocks=16)
    out = llm.generate([_prompts()[1]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 4
    assert not model.weights  # every weight was taken over
