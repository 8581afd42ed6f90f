"""Writes tiny GGUF files (real format, via the gguf package's writer) for loader tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFWriter

from minimill.models.gguf_file import read_gguf_header

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 96, 2
HEAD_DIM = HIDDEN // HEADS


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf's `permute` of Q/K rows (the reference being undone)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def tiny_hf_weights(vocab: int, *, bias: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights in HF naming and layout for a 2-layer decoder."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.05

    weights = {"model.embed_tokens.weight": rand(vocab, HIDDEN),
               "model.norm.weight": 1 + rand(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": 1 + rand(HIDDEN),
            p + "post_attention_layernorm.weight": 1 + rand(HIDDEN),
            p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, FFN),
        }
        if bias:
            weights |= {p + "self_attn.q_proj.bias": rand(HEADS * HEAD_DIM),
                        p + "self_attn.k_proj.bias": rand(KV_HEADS * HEAD_DIM),
                        p + "self_attn.v_proj.bias": rand(KV_HEADS * HEAD_DIM)}
    return weights


_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
            "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
            "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_TO_GGUF[module]}.{kind}"


def write_tiny_gguf(path: Path, arch: str, weights: dict[str, torch.Tensor],
                    tokenizer_source: Path, *, pre: str = "smollm",
                    extra: dict[str, Any] | None = None) -> None:
    """A GGUF of `arch` with `weights` (HF layout; permuted for llama as llama.cpp does) and
    the tokenizer metadata of `tokenizer_source` (a real GGUF)."""
    writer = GGUFWriter(path, arch=arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    for key, value in (extra or {}).items():
        getattr(writer, key)(value)
    add_tokenizer(writer, tokenizer_source, pre)
    for name, tensor in weights.items():
        if arch == "llama" and ".q_proj." in name:
            tensor = llama_cpp_permute(tensor, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            tensor = llama_cpp_permute(tensor, KV_HEADS)
        writer.add_tensor(gguf_name(name), tensor.numpy().astype(np.float32))
    finish(writer)


def add_tokenizer(writer: GGUFWriter, source: Path, pre: str | None = None) -> None:
    """The byte-level BPE tokenizer of `source` (a real GGUF), with its pre-tokenizer or
    `pre`."""
    meta = read_gguf_header(source).metadata
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(meta["tokenizer.chat_template"])


def finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
