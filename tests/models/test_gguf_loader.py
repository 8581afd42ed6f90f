"""GGUF loading: config from metadata, HF naming, Q/K un-permutation, parity with transformers."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import RopeScalingType

from gguf_factory import (
    HEADS,
    KV_HEADS,
    LAYERS,
    llama_cpp_permute,
    tiny_hf_weights,
    write_tiny_gguf,
)
from minimill.models.gguf_loader import load_gguf, unpermute_rope_rows
from minimill.models.types import LoadedModel


def test_config_from_metadata(loaded_f32: LoadedModel) -> None:
    c = loaded_f32.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (
        "llama", 30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.max_position_embeddings, c.rope_theta) == (49152, 8192, 100000.0)
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert c.bos_token_id == 1
    assert c.eos_token_ids == (2, 0)  # <|im_end|> (the file's eos), then <|endoftext|>
    assert "lm_head.weight" not in loaded_f32.weights
    assert loaded_f32.chat_template and "<|im_start|>" in loaded_f32.chat_template
    assert loaded_f32.config.num_params == 134_479_872


def test_weights_equal_what_transformers_loads(loaded_f32: LoadedModel,
                                               hf_gguf_model: Any) -> None:
    reference = hf_gguf_model.state_dict()
    assert set(loaded_f32.weights) == set(reference) - {"lm_head.weight"}
    mismatched = [name for name, w in loaded_f32.weights.items()
                  if not torch.equal(w, reference[name])]
    assert mismatched == []


def test_unpermute_inverts_llama_cpp_permute() -> None:
    for heads, rows in ((9, 576), (3, 192)):
        weight = torch.arange(rows * 5, dtype=torch.float32).reshape(rows, 5)
        assert torch.equal(unpermute_rope_rows(llama_cpp_permute(weight, heads), heads), weight)
        bias = torch.arange(rows, dtype=torch.float32)
        assert torch.equal(unpermute_rope_rows(llama_cpp_permute(bias, heads), heads), bias)
    # And it is not the identity: Q/K rows really move.
    weight = torch.arange(128, dtype=torch.float32).reshape(64, 2)
    assert not torch.equal(llama_cpp_permute(weight, 1), weight)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_gives_back_the_hf_weights(arch: str, tmp_path: Path, model_file: Path) -> None:
    weights = tiny_hf_weights(49152, bias=arch == "qwen2")
    path = tmp_path / f"tiny-{arch}.gguf"
    extra = {"add_rope_scaling_type": RopeScalingType.LINEAR, "add_rope_scaling_factor": 4.0}
    write_tiny_gguf(path, arch, weights, model_file, pre="qwen2" if arch == "qwen2" else "smollm",
                    extra=extra if arch == "llama" else None)
    loaded = load_gguf(path, torch.float32)
    assert loaded.config.architecture == arch
    assert loaded.config.attention_bias == (arch == "qwen2")
    assert (loaded.config.num_attention_heads, loaded.config.num_key_value_heads) == (
        HEADS, KV_HEADS)
    assert loaded.config.num_hidden_layers == LAYERS and loaded.config.rope_theta == 50000.0
    expected_scaling = {"rope_type": "linear", "factor": 4.0} if arch == "llama" else None
    assert loaded.config.rope_scaling == expected_scaling
    assert set(loaded.weights) == set(weights)
    assert all(torch.equal(loaded.weights[k], w) for k, w in weights.items())


def test_load_time_and_dtype(model_file: Path) -> None:
    start = time.perf_counter()
    loaded = load_gguf(model_file, torch.bfloat16)
    seconds = time.perf_counter() - start
    print(f"load_gguf bf16: {seconds:.2f} s")
    assert {w.dtype for w in loaded.weights.values()} == {torch.bfloat16}
    # Dequantizing all 30 layers takes about a second; generous bound for a busy machine.
    assert seconds < 20
