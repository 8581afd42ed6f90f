"""HF-style directories written by transformers' own save_pretrained, loaded back by minimill."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from minimill.models.loader import load_model
from minimill.models.types import LoadedModel


def _write_tokenizer(directory: Path, loaded: LoadedModel, *, template_file: bool) -> None:
    loaded.tokenizer.backend.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {"bos_token": {"content": "<|im_start|>"},
                              "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}
    if template_file:
        (directory / "chat_template.jinja").write_text(loaded.chat_template or "")
    else:
        config["chat_template"] = loaded.chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def _save_tiny(directory: Path, arch: str, **config_kwargs: Any) -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg_cls: Any
    model_cls: Any
    cfg_cls, model_cls = ((Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2"
                          else (LlamaConfig, LlamaForCausalLM))
    cfg = cfg_cls(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  eos_token_id=2, bos_token_id=1, **config_kwargs)
    model = model_cls(cfg).eval()
    # Small shards, so the sharded (index.json) layout is what gets loaded.
    model.save_pretrained(directory, max_shard_size="2MB", safe_serialization=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sharded_dir_round_trip(arch: str, tmp_path: Path, loaded_f32: LoadedModel) -> None:
    scaling = {"rope_type": "linear", "factor": 2.0}
    reference = _save_tiny(tmp_path, arch, tie_word_embeddings=arch == "llama",
                           rope_scaling=scaling, rope_theta=20000.0)
    assert (tmp_path / "model.safetensors.index.json").exists()
    _write_tokenizer(tmp_path, loaded_f32, template_file=arch == "qwen2")
    loaded = load_model(str(tmp_path), torch.float32)
    c = loaded.config
    assert c.architecture == arch
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (64, 96, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert c.attention_bias == (arch == "qwen2")
    assert c.tie_word_embeddings == (arch == "llama")
    assert c.rope_theta == 20000.0 and c.max_position_embeddings == 1024
    assert c.rope_scaling is not None and c.rope_scaling["factor"] == 2.0
    assert c.rope_scaling["rope_type"] == "linear"
    assert c.bos_token_id == 1 and c.eos_token_ids[0] == 2
    expected = {k: v for k, v in reference.items()
                if not (c.tie_word_embeddings and k == "lm_head.weight")}
    assert set(loaded.weights) == set(expected)
    assert all(torch.equal(loaded.weights[k], v) for k, v in expected.items())
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in loaded.weights
    tok = loaded.tokenizer
    assert tok.encode("Hello 😀") == loaded_f32.tokenizer.encode("Hello 😀")
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == loaded_f32.tokenizer.apply_chat_template(messages)


def test_single_file_dir_in_bfloat16(tmp_path: Path, loaded_f32: LoadedModel) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path, loaded_f32, template_file=False)
    # Most published checkpoints use the older keys: rope_theta + rope_scaling (kept as given).
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters", None)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config |= {"rope_theta": 500000.0, "rope_scaling": llama3}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(tmp_path), torch.bfloat16)
    assert (tmp_path / "model.safetensors").exists()
    assert {w.dtype for w in loaded.weights.values()} == {torch.bfloat16}
    assert "lm_head.weight" in loaded.weights and not loaded.config.tie_word_embeddings
    assert loaded.config.num_key_value_heads == 2  # defaults to the head count
    assert loaded.config.rope_theta == 500000.0 and loaded.config.rope_scaling == llama3
