"""Model fixtures: the default model loaded by minimill, and transformers' own view of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from minimill.models.loader import load_model
from minimill.models.types import LoadedModel


@pytest.fixture(scope="session")
def loaded_f32(model_file: Path) -> LoadedModel:
    """The default model, dequantized to float32 (exact, comparable with transformers)."""
    return load_model(str(model_file), torch.float32)


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(model_file: Path) -> Any:
    """transformers' tokenizer converted from the same GGUF file (the reference)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_file.parent), gguf_file=model_file.name)


@pytest.fixture(scope="session")
def hf_gguf_model(model_file: Path) -> Any:
    """transformers' own float32 model loaded from the same GGUF file (the reference)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(model_file.parent), gguf_file=model_file.name, dtype=torch.float32).eval()
