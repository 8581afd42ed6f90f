"""max_memory_gb (engine/memory_budget.py): a model whose weights do not fit one process's
budget is served by pipeline stages that each read only their own weights from the checkpoint
and size their KV pool to what the budget leaves, with the single engine's greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from minimill.engine.llm import LLM
from minimill.engine.memory_budget import GIB
from minimill.engine.params import InvalidRequestError, SamplingParams
from minimill.models.loader import load_model
from minimill.models.types import LoadedModel
from tiny_hf import save_tiny

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SETTINGS = {"dtype": "float32", "num_threads": 1}


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory, smol_f32: LoadedModel) -> Path:
    """A checkpoint whose embedding and vocabulary projection are two tensors: most of its
    bytes, one at each end of the model."""
    directory = tmp_path_factory.mktemp("untied-llama")
    save_tiny("llama", directory, smol_f32, num_hidden_layers=6, tie_word_embeddings=False)
    return directory


def checkpoint_bytes(directory: Path) -> int:
    """Bytes of every weight of a float32 checkpoint, from its files' headers."""
    total = 0
    for shard in directory.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            total += sum(torch.Size(f.get_slice(name).get_shape()).numel() * 4
                         for name in f.keys())
    return total


def test_a_model_over_one_process_s_budget_is_served_by_two_stages_within_it(
        untied: Path) -> None:
    weights = checkpoint_bytes(untied)  # float32 on disk and in the engine
    budget_gb = 0.8 * weights / GIB  # the weights alone exceed one process's budget
    prompts = [[1, 450, 7051, 310, 3444, 338], [1, 822, 18755], list(range(5, 40))]
    single = LLM(str(untied), **SETTINGS)
    expected = [o.output_token_ids for o in single.generate(prompts, GREEDY)]
    single.close()

    llm = LLM(str(untied), max_memory_gb=budget_gb, **SETTINGS)
    try:
        runner = llm.engine.runner
        assert runner.pipelined and runner.plan.num_stages == 2
        assert [o.output_token_ids for o in llm.generate(prompts, GREEDY)] == expected
        memory = runner.stage_memory
        assert len(memory) == 2
        # Each stage read only its own weights: together, the checkpoint once.
        assert sum(w for w, _ in memory) == weights
        for weight_bytes, kv_bytes in memory:
            assert kv_bytes > 0
            assert weight_bytes + kv_bytes <= budget_gb * GIB
    finally:
        llm.close()


def test_a_budget_one_layer_does_not_fit_is_refused_by_name(untied: Path) -> None:
    with pytest.raises(InvalidRequestError, match=r"max_memory_gb \(--max-memory-gb\)"):
        LLM(str(untied), max_memory_gb=0.001, **SETTINGS)
    # A model loaded already holds every weight in this process: no budget can cut it.
    loaded = load_model(str(untied), torch.float32)
    with pytest.raises(InvalidRequestError, match="by name or path"):
        LLM(loaded, max_memory_gb=0.8 * checkpoint_bytes(untied) / GIB, **SETTINGS)


def test_a_model_within_the_budget_stays_one_process_its_pool_what_is_left(
        untied: Path) -> None:
    weights = checkpoint_bytes(untied)
    budget_gb = (weights + (4 << 20)) / GIB
    llm = LLM(str(untied), max_memory_gb=budget_gb, **SETTINGS)
    try:
        runner = llm.engine.runner
        assert not runner.pipelined
        kv_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
        assert 0 < kv_bytes <= 4 << 20
        assert weights + kv_bytes <= budget_gb * GIB
    finally:
        llm.close()


def test_a_gguf_model_s_stages_read_their_own_tensors_from_its_warm_file(
        model_file: Path, smol_f32: LoadedModel) -> None:
    weights = sum(t.numel() * t.element_size() for t in smol_f32.weights.values())
    budget_gb = 0.8 * weights / GIB
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    single = LLM(smol_f32, **SETTINGS)
    expected = [o.output_token_ids for o in single.generate(prompts, params)]
    single.close()
    llm = LLM(str(model_file), max_memory_gb=budget_gb, **SETTINGS)
    try:
        runner = llm.engine.runner
        assert runner.pipelined and runner.plan.num_stages == 2
        assert [o.output_token_ids for o in llm.generate(prompts, params)] == expected
        for weight_bytes, kv_bytes in runner.stage_memory:
            assert weight_bytes < 0.7 * weights  # its own layers, not the whole model
            assert weight_bytes + kv_bytes <= budget_gb * GIB
    finally:
        llm.close()
