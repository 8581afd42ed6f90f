"""Embeddings (SamplingParams.embed) against transformers on a tiny random checkpoint: the
final normed hidden state of the last prompt token, L2-normalised (Qwen3-Embedding's recipe)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from minimill.engine.llm import LLM
from minimill.engine.params import SamplingParams
from minimill.models.loader import load_model
from minimill.models.types import LoadedModel

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings", "a " * 40]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, smol_f32: LoadedModel
         ) -> tuple[LLM, Any]:
    """An engine over a random 2-layer Qwen2 saved by transformers, and that HF model."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    directory = tmp_path_factory.mktemp("tiny-qwen2")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, eos_token_id=2, bos_token_id=1)
    hf = Qwen2ForCausalLM(cfg).eval()
    hf.save_pretrained(directory, safe_serialization=True)
    smol_f32.tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": smol_f32.chat_template}))
    llm = LLM(load_model(str(directory), torch.float32), dtype="float32",
              num_kv_blocks=256, max_model_len=1024)
    return llm, hf


def _hf_embedding(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(hidden, dim=-1)


def test_embedding_is_the_normalised_last_hidden_state(tiny: tuple[LLM, Any]) -> None:
    llm, hf = tiny
    prompts = [llm.tokenizer.encode(t, add_special_tokens=True) for t in TEXTS]
    vectors = llm.embed(prompts)
    for ids, vector in zip(prompts, vectors, strict=True):
        ours = torch.tensor(vector)
        assert ours.shape == (64,)
        assert abs(float(ours.norm()) - 1.0) < 1e-5
        ref = _hf_embedding(hf, ids)
        assert float((ours - ref).abs().max()) < 1e-4, "not HF's pooled hidden state"
    # Distinct texts give distinct vectors (a constant vector would pass the norm check).
    assert float((torch.tensor(vectors[0]) - torch.tensor(vectors[1])).abs().max()) > 1e-2


def test_embeddings_share_steps_with_generation(tiny: tuple[LLM, Any]) -> None:
    """An embedding request in the same steps as generating ones: each gets its own output,
    the generation is what it is alone, and the embedding samples no token."""
    llm, hf = tiny
    ids = llm.tokenizer.encode(TEXTS[0], add_special_tokens=True)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = llm.generate([ids], greedy)[0]
    mixed = llm.generate([ids, ids, TEXTS[2]], [greedy, SamplingParams(embed=True), greedy])
    assert mixed[0].output_token_ids == alone.output_token_ids
    assert mixed[1].output_token_ids == [] and mixed[1].text == ""
    assert mixed[1].embedding is not None and mixed[0].embedding is None
    assert float((torch.tensor(mixed[1].embedding) - _hf_embedding(hf, ids)).abs().max()) < 1e-4
    assert len(mixed[2].output_token_ids) == 8
    # No KV held after: every embedding request has left the scheduler.
    assert not llm.engine.scheduler.has_unfinished
