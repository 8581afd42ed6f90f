"""Tiny HF checkpoints of Gemma 3 and gpt-oss written as GGUF the way llama.cpp's converter
(convert_hf_to_gguf.py) writes them: its metadata keys, the gguf package's tensor names, Gemma's
norms stored as 1 + w, gpt-oss's experts split into gate / up / down stacks ([experts, out, in])
and quantized to MXFP4."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import (
    MODEL_ARCH,
    ExpertGatingFuncType,
    GGMLQuantizationType,
    GGUFWriter,
    RopeScalingType,
    get_tensor_name_map,
)
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from gguf_factory import add_tokenizer, finish

GEMMA3_NORM_SHIFT = 1.0


def _state(directory: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, as the converter reads them from the safetensors files."""
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def _f32(tensor: torch.Tensor) -> np.ndarray:
    return tensor.float().numpy().astype(np.float32)


def _common(writer: GGUFWriter, cfg: Any) -> None:
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def add_spm_tokenizer(writer: GGUFWriter, tokens: list[str], scores: list[float],
                      types: list[int], bos: int, eos: int, unk: int, pad: int) -> None:
    """A SentencePiece vocabulary as llama.cpp's _set_vocab_sentencepiece writes it (Gemma:
    no space prefix, a bos token before the text)."""
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_unk_token_id(unk)
    writer.add_pad_token_id(pad)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)


def write_gemma3_gguf(path: Path, directory: Path, hf: Any, vocab: tuple[list[str], list[float],
                      list[int]], special_ids: dict[str, int]) -> None:
    cfg = hf.config
    names = get_tensor_name_map(MODEL_ARCH.GEMMA3, cfg.num_hidden_layers)
    writer = GGUFWriter(path, arch="gemma3")
    _common(writer, cfg)
    writer.add_rope_freq_base(float(cfg.rope_parameters["full_attention"]["rope_theta"]))
    writer.add_sliding_window(cfg.sliding_window)
    add_spm_tokenizer(writer, *vocab, **special_ids)
    for name, tensor in _state(directory).items():
        if name == "lm_head.weight":  # tied: llama.cpp skips it
            continue
        if name.endswith("norm.weight"):
            tensor = tensor + GEMMA3_NORM_SHIFT
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, _f32(tensor))
    finish(writer)


def _mxfp4_round(tensor: torch.Tensor) -> torch.Tensor:
    """The MXFP4 value nearest each element (blocks of 32 along the last dimension)."""
    array = _f32(tensor)
    back = dequantize(quantize(array, GGMLQuantizationType.MXFP4), GGMLQuantizationType.MXFP4)
    return torch.from_numpy(np.ascontiguousarray(back.reshape(array.shape)))


def gpt_oss_stacks(state: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """One layer's HF experts as llama.cpp's converter splits them: gate and up (even and odd
    columns of gate_up_proj), down; weights [experts, out, in]."""
    p = f"model.layers.{layer}.mlp.experts."
    gate_up, gate_up_bias = state[p + "gate_up_proj"], state[p + "gate_up_proj_bias"]
    b = f"blk.{layer}."
    return {b + "ffn_gate_exps.weight": gate_up.transpose(1, 2)[:, ::2, :],
            b + "ffn_up_exps.weight": gate_up.transpose(1, 2)[:, 1::2, :],
            b + "ffn_down_exps.weight": state[p + "down_proj"].transpose(1, 2),
            b + "ffn_gate_exps.bias": gate_up_bias[:, ::2],
            b + "ffn_up_exps.bias": gate_up_bias[:, 1::2],
            b + "ffn_down_exps.bias": state[p + "down_proj_bias"]}


def round_gpt_oss_experts_to_mxfp4(hf: Any, directory: Path) -> None:
    """Make the checkpoint's expert weights exactly what MXFP4 keeps, and save it again: its
    GGUF (MXFP4 experts) then holds the same model, not an approximation of it."""
    with torch.no_grad():
        for layer in hf.model.layers:
            experts = layer.mlp.experts
            gate_up = experts.gate_up_proj.transpose(1, 2)  # [experts, 2 * width, hidden]
            experts.gate_up_proj.copy_(_mxfp4_round(gate_up).transpose(1, 2))
            down = experts.down_proj.transpose(1, 2)  # [experts, hidden, width]
            experts.down_proj.copy_(_mxfp4_round(down).transpose(1, 2))
    for old in directory.glob("*.safetensors*"):
        old.unlink()
    hf.save_pretrained(directory, max_shard_size="2MB")


def write_gpt_oss_gguf(path: Path, directory: Path, hf: Any, tokenizer_source: Path,
                       experts_type: GGMLQuantizationType = GGMLQuantizationType.MXFP4,
                       drop: tuple[str, ...] = ()) -> None:
    """`drop`: GGUF tensor names left out (a file that lacks them)."""
    cfg = hf.config
    names = get_tensor_name_map(MODEL_ARCH.GPT_OSS, cfg.num_hidden_layers)
    writer = GGUFWriter(path, arch="gpt-oss")
    _common(writer, cfg)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.intermediate_size)
    add_tokenizer(writer, tokenizer_source)
    state = _state(directory)
    for name, tensor in state.items():
        if ".mlp.experts." in name:
            continue
        if name.endswith(".sinks"):  # the converter names it as a weight
            name += ".weight"
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, _f32(tensor))
    for layer in range(cfg.num_hidden_layers):
        for gguf_name, tensor in gpt_oss_stacks(state, layer).items():
            if gguf_name in drop:
                continue
            if gguf_name.endswith(".weight") and experts_type != GGMLQuantizationType.F32:
                writer.add_tensor(gguf_name, quantize(_f32(tensor), experts_type),
                                  raw_dtype=experts_type)
            else:
                writer.add_tensor(gguf_name, _f32(tensor))
    finish(writer)


def write_deepseek2_gguf(path: Path, directory: Path, hf: Any, tokenizer_source: Path,
                         split_kv_b: bool = True, sigmoid_gating: bool = True,
                         mtp_layers: int = 0) -> None:
    """DeepSeek-V3 as llama.cpp's `deepseek2`: MLA as multi-query attention over the latent,
    kv_b_proj split into attn_k_b (transposed) and attn_v_b (`split_kv_b`; older converters
    keep attn_kv_b), experts stacked, the correction bias as exp_probs_b (`sigmoid_gating`
    false: no gating key, as DeepSeek-V2's files; `mtp_layers`: that many multi-token
    prediction blocks after the decoder's, copies of its last)."""
    cfg = hf.config
    names = get_tensor_name_map(MODEL_ARCH.DEEPSEEK2, cfg.num_hidden_layers + mtp_layers)
    writer = GGUFWriter(path, arch="deepseek2")
    writer.add_block_count(cfg.num_hidden_layers + mtp_layers)
    if mtp_layers:
        writer.add_nextn_predict_layers(mtp_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    writer.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    if cfg.q_lora_rank is not None:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    writer.add_value_length(cfg.kv_lora_rank)
    writer.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    writer.add_value_length_mla(cfg.v_head_dim)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    writer.add_expert_weights_norm(cfg.norm_topk_prob)
    writer.add_expert_group_count(cfg.n_group)
    writer.add_expert_group_used_count(cfg.topk_group)
    if sigmoid_gating:
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    add_tokenizer(writer, tokenizer_source)
    state = _state(directory)
    last = f"model.layers.{cfg.num_hidden_layers - 1}."
    for extra in range(cfg.num_hidden_layers, cfg.num_hidden_layers + mtp_layers):
        state |= {k.replace(last, f"model.layers.{extra}."): t
                  for k, t in list(state.items()) if k.startswith(last)}
    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    for name, tensor in _stacked_experts(state, cfg.num_hidden_layers + mtp_layers,
                                         cfg.n_routed_experts).items():
        if name.endswith("e_score_correction_bias"):
            layer = name.split(".")[2]
            writer.add_tensor(f"blk.{layer}.exp_probs_b.bias", _f32(tensor))
            continue
        if split_kv_b and name.endswith("kv_b_proj.weight"):
            kv_b = tensor.view(heads, nope + v, tensor.shape[-1])
            k_b, v_b = torch.split(kv_b, [nope, v], dim=1)
            for part, value in (("k_b_proj", k_b.transpose(1, 2)), ("v_b_proj", v_b)):
                gguf_name = names.get_name(name.replace("kv_b_proj", part),
                                           try_suffixes=(".weight",))
                writer.add_tensor(gguf_name, _f32(value.contiguous()))
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, _f32(tensor))
    finish(writer)


def _stacked_experts(state: dict[str, torch.Tensor], num_layers: int, num_experts: int
                     ) -> dict[str, torch.Tensor]:
    """HF's per-expert weights stacked per layer and projection, as the converter merges them."""
    out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    for layer in range(num_layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names = [f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                     for e in range(num_experts)]
            if names[0] in state:
                out[f"model.layers.{layer}.mlp.experts.{proj}.weight"] = torch.stack(
                    [state[n] for n in names])
    return out
