"""What the control plane may know of a model without loading it: its context length.

Read from the GGUF header's metadata or an HF directory's config.json (a few kilobytes either
way); a model that is not on this machine is simply not known here.
"""

from __future__ import annotations

import json
from functools import lru_cache

from minimill.models.gguf_file import read_gguf_header
from minimill.models.registry import resolve_model
from minimill.models.types import ModelError


@lru_cache(maxsize=64)
def context_length(name_or_path: str) -> int | None:
    """The model's context length in tokens, or None where the model is not on this machine
    or does not say."""
    try:
        path = resolve_model(name_or_path)
        if path.is_dir():
            config = json.loads((path / "config.json").read_text())
            value = config.get("max_position_embeddings") if isinstance(config, dict) else None
        else:
            meta = read_gguf_header(path).metadata
            value = meta.get(f"{meta.get('general.architecture')}.context_length")
    except (ModelError, OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None
