"""A model's tokenizer from its files alone, without its weights or torch: what the control
plane loads to count tokens (control/prompt_count.py) and the HF loader uses too.

GGUF files carry their vocabulary in their metadata (read without touching the tensors); HF
directories carry tokenizer.json and tokenizer_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers

from minimill.models.gguf_file import read_gguf_header
from minimill.models.gguf_tokenizer import tokenizer_from_gguf
from minimill.models.tokenizer import Tokenizer
from minimill.models.types import ModelFileError


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file; ModelFileError naming the file otherwise."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelFileError(f"{path}: file is missing") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelFileError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_hf_tokenizer(directory: Path) -> Tokenizer:
    """Tokenizer from tokenizer.json plus tokenizer_config.json (special tokens, template)."""
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelFileError(f"{tokenizer_file}: file is missing")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust side raises bare Exception subclasses
        raise ModelFileError(f"{tokenizer_file}: not a valid tokenizer file ({exc})") from exc
    config_file = directory / "tokenizer_config.json"
    tcfg = read_json(config_file) if config_file.exists() else {}
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    return Tokenizer(
        backend,
        bos_token=_token_text(tcfg.get("bos_token")),
        eos_token=_token_text(tcfg.get("eos_token")),
        pad_token=_token_text(tcfg.get("pad_token")),
        unk_token=_token_text(tcfg.get("unk_token")),
        chat_template=template if isinstance(template, str) else None,
    )


def load_tokenizer(path: Path) -> tuple[Tokenizer, int | None]:
    """The tokenizer of a model file or directory, and its context length (None: unknown)."""
    if path.is_dir():
        config = path / "config.json"
        positions = read_json(config).get("max_position_embeddings") if config.is_file() \
            else None
        return load_hf_tokenizer(path), positions if isinstance(positions, int) else None
    header = read_gguf_header(path)
    arch = header.metadata.get("general.architecture")
    context = header.metadata.get(f"{arch}.context_length")
    return (tokenizer_from_gguf(header.metadata, path),
            int(context) if isinstance(context, int) else None)
