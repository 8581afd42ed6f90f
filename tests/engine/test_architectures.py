"""Qwen3, Gemma 3 and Qwen3-MoE against transformers: tiny random checkpoints saved as HF
directories, loaded by minimill, logits and greedy tokens compared (float32), on the portable
and on the compiled CPU kernels, over prompts longer than Gemma's sliding window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import assert_greedy_close, assert_logits_match, engine_logits

from minimill.engine.llm import LLM
from minimill.engine.params import SamplingParams
from minimill.models.loader import load_model
from minimill.models.types import LoadedModel
from tiny_hf import ARCHITECTURES, VOCAB, WINDOW, hf_greedy, save_tiny

WHY = "the engine's matmul and attention shapes differ from HF's"


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         smol_f32: LoadedModel) -> tuple[str, Path, Any]:
    arch = request.param
    directory = tmp_path_factory.mktemp(arch)
    return arch, directory, save_tiny(arch, directory, smol_f32)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    # Both well past the sliding window (8), so windowed layers drop keys.
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (45, 23)]


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_logits_and_greedy_match_transformers(tiny: tuple[str, Path, Any], kernels: str) -> None:
    arch, directory, hf = tiny
    loaded = load_model(str(directory), torch.float32)
    assert loaded.config.architecture == arch
    if arch == "gemma3":
        assert loaded.config.layer_types == ("sliding", "full", "sliding")
        assert loaded.config.sliding_window == WINDOW
    llm = LLM(loaded, dtype="float32", num_kv_blocks=64, kernels=kernels)
    prompts = _prompts()
    assert_logits_match(llm, hf, prompts, f"{arch}/{kernels}")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, top_logprobs=5)
    out = llm.generate([prompts[0]], params)[0]
    ref_tokens, ref_top = hf_greedy(hf, prompts[0], 16)
    assert out.logprobs is not None
    equal = assert_greedy_close(out.output_token_ids, [lp.top for lp in out.logprobs],
                                ref_tokens, ref_top, WHY)
    assert equal >= 8


def test_a_sequence_computes_the_same_alone_or_in_a_batch(tiny: tuple[str, Path, Any]
                                                          ) -> None:
    arch, directory, _ = tiny
    llm = LLM(load_model(str(directory), torch.float32), dtype="float32", num_kv_blocks=64,
              kernels="native")
    first, second = _prompts()
    alone = engine_logits(llm, [first])[0]
    crowded = engine_logits(llm, [second, first, second[:7]])[1]
    # Bit for bit: what makes a resumed request continue exactly (experts included).
    assert torch.equal(alone, crowded), arch


def test_the_benchmark_s_transformers_model_is_the_checkpoint_s(tiny: tuple[str, Path, Any]
                                                                ) -> None:
    """bench engine compares with transformers on a model it builds from the engine's config
    and weights (random-weight shapes have no checkpoint): it must be the same model."""
    from minimill.bench.hf_baseline import build_hf_model

    _, directory, hf = tiny
    rebuilt = build_hf_model(load_model(str(directory), torch.float32), torch.float32)
    prompt = torch.tensor([_prompts()[0]])
    with torch.inference_mode():
        torch.testing.assert_close(rebuilt(prompt).logits, hf(prompt).logits)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_experts_on_amx_tiles_keep_a_sequence_s_numbers_its_own(
        arch: str, tmp_path: Path, smol_f32: LoadedModel, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """bfloat16 experts whose widths the AMX tiles divide are packed for them where the CPU
    has them (csrc/amx_gemm.cpp): a sequence's logits are the same bits alone and in a batch,
    and as near the float32 engine's as with oneDNN's GEMMs for the experts."""
    from minimill.engine.kernels import CpuKernels, TorchKernels
    from minimill.engine.native import load_cpu_kernels

    save_tiny(arch, tmp_path, smol_f32, moe_intermediate_size=32)
    first, second = _prompts()

    def bf16_logits() -> tuple[torch.Tensor, list[Any]]:
        llm = LLM(load_model(str(tmp_path), torch.bfloat16), dtype="bfloat16",
                  num_kv_blocks=64, kernels="native")
        alone = engine_logits(llm, [first])[0]
        assert torch.equal(alone, engine_logits(llm, [second, first, second[:7]])[1]), arch
        return alone.float(), [la.experts for la in llm.engine.runner.model.layers
                                if la.experts]

    tiles = load_cpu_kernels().available and CpuKernels()._amx_tiles
    on_tiles, experts = bf16_logits()
    assert experts and all((w.dim() == 4) == tiles for e in experts for w in e.gate_up + e.down)
    monkeypatch.setattr(CpuKernels, "prepare_expert_weights",
                        TorchKernels.prepare_expert_weights)
    on_onednn, experts = bf16_logits()
    assert all(w.dim() == 2 for e in experts for w in e.gate_up + e.down)
    f32 = LLM(load_model(str(tmp_path), torch.float32), dtype="float32", num_kv_blocks=64,
              kernels="native")
    reference = engine_logits(f32, [first])[0]
    tiles_error = float((on_tiles - reference).abs().mean())
    onednn_error = float((on_onednn - reference).abs().mean())
    assert tiles_error <= 1.5 * onednn_error, (arch, tiles_error, onednn_error)
