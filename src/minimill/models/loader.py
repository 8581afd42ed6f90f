"""One entry point from a model name or path to a LoadedModel (GGUF file or HF directory).

GGUF models load through the warm weights cache (warm_cache.py): dequantized once, mapped on
every later start."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from minimill.models.registry import (
    KNOWN_MODELS,
    minimill_home,
    model_dir,
    pull_model,
    resolve_model,
)
from minimill.models.types import LoadedModel, ModelFileError, ModelNotPulledError
from minimill.models.warm_cache import load_gguf_warm


def load_model(name_or_path: str, dtype: torch.dtype = torch.bfloat16, *,
               auto_pull: bool = False, keep: Callable[[str], bool] | None = None
               ) -> LoadedModel:
    """Resolve and load a model; `auto_pull` fetches a known model that is not cached yet.

    `keep`: only the weights it names (a pipeline stage's). A model directory's are read by
    name and the others never are; a GGUF model's, one by one from its warm file (its first
    start dequantizes it whole, once)."""
    try:
        path = resolve_model(name_or_path)
    except ModelNotPulledError:
        if not auto_pull:
            raise
        path = pull_model(name_or_path)
    name = name_or_path if name_or_path in KNOWN_MODELS else Path(path).name
    if path.is_dir():
        from minimill.models.hf_loader import load_hf_dir

        return load_hf_dir(path, dtype, name=name, keep=keep)
    if path.suffix.lower() == ".gguf":
        # A pulled model's warm file sits beside it; one given by path, in a shared directory.
        cache_dir = (model_dir(name_or_path) if name_or_path in KNOWN_MODELS
                     else minimill_home() / "models" / "warm")
        return load_gguf_warm(path, dtype, name, cache_dir, keep)
    raise ModelFileError(f"{path}: not a .gguf file or a model directory")
