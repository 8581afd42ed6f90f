"""Qwen3 and Qwen3-MoE from GGUF: a tiny random checkpoint written as llama.cpp names its
tensors (the gguf package's own name map; experts stacked per layer and projection) loads
into the same config and weights as its HF directory, and generates what transformers does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine_helpers import assert_greedy_close
from gguf import MODEL_ARCH, GGUFWriter, get_tensor_name_map
from safetensors.torch import load_file

from gguf_factory import add_tokenizer, finish
from minimill.engine.llm import LLM
from minimill.engine.params import SamplingParams
from minimill.models.loader import load_model
from minimill.models.types import LoadedModel, ModelFileError
from tiny_hf import VOCAB, hf_greedy, save_tiny

GGUF_ARCH = {"qwen3": MODEL_ARCH.QWEN3, "qwen3_moe": MODEL_ARCH.QWEN3MOE}
# llama.cpp's qwen3moe routes in every layer: no dense layer here.
OVERRIDES: dict[str, dict[str, Any]] = {"qwen3": {}, "qwen3_moe": {"mlp_only_layers": []}}
COMPARED = ("architecture", "vocab_size", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "max_position_embeddings", "tie_word_embeddings",
            "attention_bias", "qk_norm", "num_experts", "num_experts_per_tok",
            "moe_intermediate_size", "norm_topk_prob", "dense_layers", "expert_style")


def _stacked(state: dict[str, torch.Tensor], num_layers: int, num_experts: int
             ) -> dict[str, torch.Tensor]:
    """HF's per-expert weights stacked as llama.cpp's converter stacks them."""
    out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    for layer in range(num_layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names = [f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                     for e in range(num_experts)]
            if names and names[0] in state:
                out[f"model.layers.{layer}.mlp.experts.{proj}.weight"] = torch.stack(
                    [state[n] for n in names])
    return out


def write_gguf(path: Path, arch: str, directory: Path, hf: Any, tokenizer_source: Path,
               expert_count: int | None = None) -> None:
    """The HF checkpoint in `directory` (transformers' model of it: `hf`) as llama.cpp's
    converter writes it (`expert_count`: what the metadata says, where not the true count)."""
    cfg = hf.config
    num_experts = int(getattr(cfg, "num_experts", 0) or 0)
    names = get_tensor_name_map(GGUF_ARCH[arch], cfg.num_hidden_layers)
    writer = GGUFWriter(path, arch=GGUF_ARCH[arch].name.lower())
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    rope = getattr(cfg, "rope_parameters", None) or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta") or cfg.rope_theta))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if num_experts:
        writer.add_expert_count(expert_count or num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    add_tokenizer(writer, tokenizer_source)
    # The checkpoint's files, as llama.cpp's converter reads them (one tensor per expert).
    state = {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}
    for name, tensor in _stacked(state, cfg.num_hidden_layers, num_experts).items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, tensor.float().numpy().astype(np.float32))
    finish(writer)


@pytest.fixture(scope="module", params=list(GGUF_ARCH))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         smol_f32: LoadedModel, model_file: Path) -> tuple[str, Any, LoadedModel, LoadedModel]:
    arch = request.param
    directory = tmp_path_factory.mktemp(arch)
    hf = save_tiny(arch, directory, smol_f32, **OVERRIDES[arch])
    gguf_path = directory / f"{arch}.gguf"
    write_gguf(gguf_path, arch, directory, hf, model_file)
    return (arch, hf, load_model(str(directory), torch.float32),
            load_model(str(gguf_path), torch.float32))


def test_the_gguf_loads_the_config_and_weights_of_the_hf_directory(
        pair: tuple[str, Any, LoadedModel, LoadedModel]) -> None:
    arch, _, from_hf, from_gguf = pair
    assert from_gguf.config.architecture == arch
    for field in COMPARED:
        # GGUF keeps floats in 32 bits.
        expected = getattr(from_hf.config, field)
        if isinstance(expected, float):
            expected = pytest.approx(expected, rel=1e-6)
        assert getattr(from_gguf.config, field) == expected, field
    if arch == "qwen3_moe":
        assert from_gguf.config.num_experts == 8 and from_gguf.config.dense_layers == ()
    assert from_gguf.weights.keys() == from_hf.weights.keys()
    for name, tensor in from_hf.weights.items():
        assert torch.equal(from_gguf.weights[name], tensor), name


def test_the_gguf_generates_what_transformers_does(
        pair: tuple[str, Any, LoadedModel, LoadedModel]) -> None:
    arch, hf, _, from_gguf = pair
    prompt = torch.randint(3, VOCAB, (37,), generator=torch.Generator().manual_seed(2)).tolist()
    llm = LLM(from_gguf, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, top_logprobs=5)
    out = llm.generate([prompt], params)[0]
    ref_tokens, ref_top = hf_greedy(hf, prompt, 16)
    assert out.logprobs is not None
    equal = assert_greedy_close(out.output_token_ids, [lp.top for lp in out.logprobs],
                                ref_tokens, ref_top, f"{arch}: matmul shapes differ from HF's")
    assert equal >= 8


def test_stacked_experts_of_another_count_than_the_metadata_s_are_refused(
        tmp_path: Path, smol_f32: LoadedModel, model_file: Path) -> None:
    hf = save_tiny("qwen3_moe", tmp_path, smol_f32, **OVERRIDES["qwen3_moe"])
    path = tmp_path / "wrong.gguf"
    write_gguf(path, "qwen3_moe", tmp_path, hf, model_file, expert_count=6)  # the tensors stack 8
    with pytest.raises(ModelFileError, match="metadata implies 6 experts"):
        load_model(str(path), torch.float32)


def test_a_gguf_mixture_of_experts_over_expert_parallel_ranks(
        tmp_path: Path, smol_f32: LoadedModel, model_file: Path) -> None:
    # llama.cpp stacks each layer's experts in one tensor: a rank still reads only its own.
    hf = save_tiny("qwen3_moe", tmp_path, smol_f32, **OVERRIDES["qwen3_moe"])
    path = tmp_path / "qwen3_moe.gguf"
    write_gguf(path, "qwen3_moe", tmp_path, hf, model_file)
    from_gguf = load_model(str(path), torch.float32)
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (29, 6, 17)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    single = LLM(from_gguf, dtype="float32", num_kv_blocks=64)
    expected = [o.output_token_ids for o in single.generate(prompts, params)]
    llm = LLM(from_gguf.source_path, expert_parallel=2, dtype="float32", num_kv_blocks=64,
              num_threads=1)
    try:
        runner = llm.engine.runner
        assert runner.ranks[0].experts == [0, 1, 2, 3]
        assert runner.ranks[1].experts == [4, 5, 6, 7]
        assert [o.output_token_ids for o in llm.generate(prompts, params)] == expected
    finally:
        llm.close()
