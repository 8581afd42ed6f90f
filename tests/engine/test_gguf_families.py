"""Gemma 3, gpt-oss and DeepSeek-V3 from GGUF: a tiny random checkpoint saved as an HF directory
and written as llama.cpp's converter writes it (Gemma: norms stored as 1 + w, a SentencePiece
vocabulary; gpt-oss: sinks, biased experts split into gate / up / down stacks in MXFP4;
DeepSeek: `deepseek2`, MLA with kv_b split or whole, stacked and shared experts, the correction
bias) loads into the HF directory's config and weights, tokenizes as its tokenizer.json does,
and generates what the directory and transformers do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import assert_greedy_close

from gguf_from_hf import (
    round_gpt_oss_experts_to_mxfp4,
    write_deepseek2_gguf,
    write_gemma3_gguf,
    write_gpt_oss_gguf,
)
from minimill.engine.llm import LLM
from minimill.engine.params import SamplingParams
from minimill.models.loader import load_model
from minimill.models.types import LoadedModel, ModelFileError
from minimill.models.warm_cache import load_gguf_warm
from tiny_hf import WINDOW, hf_greedy, save_tiny
from tiny_spm import BOS_ID, EOS_ID, PAD_ID, PROBES, UNK_ID, gemma_style_tokenizer, spm_pieces

COMPARED = ("architecture", "vocab_size", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "max_position_embeddings", "tie_word_embeddings",
            "attention_bias", "qk_norm", "gemma_norms", "hidden_act", "scale_embeddings",
            "attention_scale", "sliding_window", "layer_types", "sliding_rope_theta",
            "num_experts", "num_experts_per_tok", "moe_intermediate_size", "dense_layers",
            "expert_style", "o_proj_bias", "attention_sinks", "swiglu_alpha", "swiglu_limit",
            "rope_scaling", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "rope_interleave", "norm_topk_prob",
            "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor")
# Six layers, so that llama.cpp's every-sixth-layer-global rule gives Gemma 3 one global layer.
GEMMA3_LAYERS = 6
Pair = tuple[str, Any, LoadedModel, LoadedModel]


def _gemma3(directory: Path, smol_f32: LoadedModel) -> tuple[Any, Path]:
    reference = gemma_style_tokenizer()
    hf = save_tiny(
        "gemma3", directory, smol_f32, vocab_size=reference.get_vocab_size(),
        num_hidden_layers=GEMMA3_LAYERS,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        # llama.cpp scales Gemma 3's attention by the head width (27B aside).
        query_pre_attn_scalar=32, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID)
    reference.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
         "unk_token": "<unk>"}))
    path = directory / "gemma3.gguf"
    write_gemma3_gguf(path, directory, hf, spm_pieces(reference),
                      {"bos": BOS_ID, "eos": EOS_ID, "unk": UNK_ID, "pad": PAD_ID})
    return hf, path


def _gpt_oss(directory: Path, smol_f32: LoadedModel, model_file: Path) -> tuple[Any, Path]:
    # llama.cpp's SwiGLU limit is gpt-oss's own 7 (a GGUF has no key to say another).
    hf = save_tiny("gpt_oss", directory, smol_f32, swiglu_limit=7.0)
    round_gpt_oss_experts_to_mxfp4(hf, directory)
    path = directory / "gpt_oss.gguf"
    write_gpt_oss_gguf(path, directory, hf, model_file)
    return hf, path


def _deepseek_v3(directory: Path, smol_f32: LoadedModel, model_file: Path, variant: str
                 ) -> tuple[Any, Path]:
    """With a query bottleneck and kv_b split (llama.cpp's converter today), or a plain q_proj
    and kv_b whole (its older files)."""
    overrides = {"q_lora_rank": None} if variant == "plain_q" else {}
    hf = save_tiny("deepseek_v3", directory, smol_f32, **overrides)
    path = directory / "deepseek2.gguf"
    write_deepseek2_gguf(path, directory, hf, model_file, split_kv_b=variant != "plain_q")
    return hf, path


@pytest.fixture(scope="module",
                params=["gemma3", "gpt_oss", "deepseek_v3", "deepseek_v3/plain_q"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         smol_f32: LoadedModel, model_file: Path) -> Pair:
    arch, _, variant = request.param.partition("/")
    directory = tmp_path_factory.mktemp(arch)
    if arch == "gemma3":
        hf, path = _gemma3(directory, smol_f32)
    elif arch == "gpt_oss":
        hf, path = _gpt_oss(directory, smol_f32, model_file)
    else:
        hf, path = _deepseek_v3(directory, smol_f32, model_file, variant)
    return (arch, hf, load_model(str(directory), torch.float32),
            load_model(str(path), torch.float32))


def test_the_gguf_loads_the_config_and_weights_of_the_hf_directory(pair: Pair) -> None:
    arch, _, from_hf, from_gguf = pair
    assert from_gguf.config.architecture == arch
    for field in COMPARED:
        expected = getattr(from_hf.config, field)
        if isinstance(expected, float):  # GGUF keeps floats in 32 bits
            expected = pytest.approx(expected, rel=1e-6)
        assert getattr(from_gguf.config, field) == expected, field
    if arch == "gemma3":
        assert from_gguf.config.layer_types == ("sliding",) * 5 + ("full",)
        assert from_gguf.config.sliding_window == WINDOW
    if arch == "gpt_oss":
        assert from_gguf.extra["ggml_types"] == ["F32", "MXFP4"]
        assert from_gguf.config.layer_types == ("sliding", "full", "sliding")
    if arch == "deepseek_v3":
        assert from_gguf.config.is_mla and from_gguf.config.dense_layers == (0,)
        assert from_gguf.weights["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert from_gguf.weights.keys() == from_hf.weights.keys()
    for name, tensor in from_hf.weights.items():
        if arch == "gemma3" and name.endswith("norm.weight"):
            # Stored as 1 + w and taken back: w to float32's rounding at 1.
            torch.testing.assert_close(from_gguf.weights[name], tensor, rtol=0, atol=2e-7)
        else:
            assert torch.equal(from_gguf.weights[name], tensor), name


def test_a_second_start_maps_the_warm_cache_with_the_same_weights(
        pair: Pair, tmp_path: Path) -> None:
    """In bfloat16, DeepSeek's router tensors stay float32: the warm file keeps them so, and
    is used."""
    arch, _, _, from_gguf = pair
    source = Path(from_gguf.source_path)
    cold = load_gguf_warm(source, torch.bfloat16, "m", tmp_path)
    warm = load_gguf_warm(source, torch.bfloat16, "m", tmp_path)
    assert cold.extra["warm_cache"].startswith("cold, cached")
    assert warm.extra["warm_cache"].startswith("warm cache"), warm.extra["warm_cache"]
    assert warm.config == cold.config
    for name, tensor in cold.weights.items():
        assert warm.weights[name].dtype == tensor.dtype and torch.equal(warm.weights[name],
                                                                        tensor), name
    if arch == "deepseek_v3":
        assert warm.weights["model.layers.1.mlp.gate.weight"].dtype == torch.float32


def test_the_gguf_tokenizes_as_the_hf_directory_does(pair: Pair) -> None:
    """Gemma 3: SentencePiece pieces and scores against the tokenizer.json; gpt-oss: the
    default model's byte-level BPE, as the Qwen3 files have it."""
    arch, _, from_hf, from_gguf = pair
    for text in PROBES:
        ids = from_hf.tokenizer.encode(text, add_special_tokens=True)
        assert from_gguf.tokenizer.encode(text, add_special_tokens=True) == ids, text
        assert from_gguf.tokenizer.decode(ids) == text
    assert from_gguf.tokenizer.bos_token_id == from_hf.tokenizer.bos_token_id
    if arch == "gemma3":
        assert from_gguf.tokenizer.bos_token_id == BOS_ID


def test_the_gguf_generates_what_the_hf_directory_and_transformers_do(pair: Pair) -> None:
    arch, hf, from_hf, from_gguf = pair
    vocab = from_gguf.config.vocab_size
    # Past the sliding window, so the sliding layers drop keys.
    prompt = torch.randint(3, vocab, (37,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, top_logprobs=5)
    out = LLM(from_gguf, dtype="float32", num_kv_blocks=64).generate([prompt], params)[0]
    same_model = LLM(from_hf, dtype="float32", num_kv_blocks=64).generate([prompt], params)[0]
    assert out.output_token_ids == same_model.output_token_ids
    ref_tokens, ref_top = hf_greedy(hf, prompt, 16)
    assert out.logprobs is not None
    equal = assert_greedy_close(out.output_token_ids, [lp.top for lp in out.logprobs],
                                ref_tokens, ref_top, f"{arch}: the GGUF model is not HF's")
    assert equal >= 8


def test_gpt_oss_experts_without_their_biases_are_refused(
        tmp_path: Path, smol_f32: LoadedModel, model_file: Path) -> None:
    hf = save_tiny("gpt_oss", tmp_path, smol_f32, swiglu_limit=7.0)
    path = tmp_path / "no_bias.gguf"
    write_gpt_oss_gguf(path, tmp_path, hf, model_file, drop=("blk.1.ffn_up_exps.bias",))
    with pytest.raises(ModelFileError, match=r"layer 1 lacks its experts' .*up\.bias"):
        load_model(str(path), torch.float32)


def test_deepseek_s_softmax_routing_is_refused_by_name(
        tmp_path: Path, smol_f32: LoadedModel, model_file: Path) -> None:
    """A deepseek2 file without expert_gating_func is DeepSeek-V2's softmax routing to
    llama.cpp; the engine routes DeepSeek by sigmoid only."""
    hf = save_tiny("deepseek_v3", tmp_path, smol_f32)
    path = tmp_path / "v2.gguf"
    write_deepseek2_gguf(path, tmp_path, hf, model_file, sigmoid_gating=False)
    with pytest.raises(ModelFileError, match="expert_gating_func 'softmax' is not supported"):
        load_model(str(path), torch.float32)


@pytest.mark.parametrize("pair", ["deepseek_v3", "deepseek_v3/plain_q"], indirect=True)
def test_deepseek_s_multi_token_prediction_blocks_are_left_out(
        pair: Pair, tmp_path: Path, model_file: Path) -> None:
    """A file may carry them after the decoder's blocks (nextn_predict_layers); the engine
    does not run them, as it does not from an HF directory."""
    arch, hf, _, from_gguf = pair
    assert arch == "deepseek_v3"
    directory = Path(from_gguf.source_path).parent
    path = tmp_path / "mtp.gguf"
    write_deepseek2_gguf(path, directory, hf, model_file, mtp_layers=1,
                         split_kv_b=hf.config.q_lora_rank is not None)
    with_mtp = load_model(str(path), torch.float32)
    assert with_mtp.config == from_gguf.config
    assert with_mtp.weights.keys() == from_gguf.weights.keys()
