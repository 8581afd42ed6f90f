"""Engine fixtures: the default model in float32 (exact comparisons), an engine over it, and
transformers' model holding the same weights (the reference)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from minimill.engine.llm import LLM
from minimill.models.loader import load_model
from minimill.models.types import LoadedModel


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
