"""Engine fixtures: the default model in float32 (exact comparisons), an engine over it,
transformers' model holding the same weights (the reference), and a tiny 6-layer checkpoint
for the pipeline's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from minimill.engine.llm import LLM
from minimill.models.loader import load_model
from minimill.models.types import LoadedModel
from tiny_hf import save_tiny


@pytest.fixture(scope="session")
def smol_f32(model_file: Path) -> LoadedModel:
    return load_model(str(model_file), torch.float32)


@pytest.fixture(scope="session")
def llm(smol_f32: LoadedModel) -> LLM:
    """One float32 engine shared by the tests that only read from it."""
    return LLM(smol_f32, dtype="float32", num_kv_blocks=2048, max_model_len=2048)


@pytest.fixture(scope="session")
def llm_bf16(model_file: Path) -> LLM:
    """A bfloat16 engine (the dtype most CPUs and GPUs serve in)."""
    return LLM(load_model(str(model_file), torch.bfloat16), dtype="bfloat16",
               num_kv_blocks=1024, max_model_len=2048)


@pytest.fixture(scope="session")
def hf_model(smol_f32: LoadedModel) -> Any:
    from minimill.bench.hf_baseline import build_hf_model

    return build_hf_model(smol_f32, torch.float32)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smol_f32: LoadedModel
               ) -> LoadedModel:
    """A random 6-layer Llama with SmolLM2's tokenizer, saved as an HF directory (pipeline
    stages load it by path) and loaded in float32."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny("llama", directory, smol_f32, num_hidden_layers=6)
    return load_model(str(directory), torch.float32)
