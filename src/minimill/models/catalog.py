"""What the model cache holds (`minimill models list`), and adding a model on this machine to
it by path (`minimill pull PATH`).

A model pulled by path stays where it is: the cache gets a link named after it
(MINIMILL_HOME/models/NAME), so `--model NAME` finds it and nothing of gigabytes is copied.
It is checked first: an HF directory's architecture must be one the engine runs, its weights
and tokenizer present.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from minimill.models.gguf_file import read_gguf_header
from minimill.models.hf_config import config_from_hf
from minimill.models.registry import CACHE_NAME, KNOWN_MODELS, minimill_home
from minimill.models.types import ModelConfig, ModelError, ModelFileError


@dataclass(frozen=True, slots=True)
class CachedModel:
    name: str
    path: Path  # the GGUF file or HF directory
    format: str  # "gguf" or "safetensors"
    architecture: str
    params_total: int
    params_active: int
    size_bytes: int


def models_root() -> Path:
    return minimill_home() / "models"


def _hf_params(config: ModelConfig) -> tuple[int, int]:
    # ModelConfig counts the vocabulary matrix once; an untied lm_head is a second one.
    extra = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return config.num_params + extra, config.num_active_params + extra


def _describe_hf(name: str, directory: Path) -> CachedModel:
    config_path = directory / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{config_path}: not a readable config.json: {exc}") from exc
    config = config_from_hf(raw, config_path)
    total, active = _hf_params(config)
    size = sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
    return CachedModel(name, directory, "safetensors", config.architecture, total, active, size)


def _describe_gguf(name: str, path: Path) -> CachedModel:
    header = read_gguf_header(path)
    total = sum(math.prod(info.shape) for info in header.tensors.values())
    arch = str(header.metadata.get("general.architecture", "?"))
    return CachedModel(name, path, "gguf", arch, total, total, path.stat().st_size)


def describe(name: str, path: Path) -> CachedModel:
    """The entry for a GGUF file or an HF directory (errors name what is wrong)."""
    if path.is_dir():
        return _describe_hf(name, path)
    return _describe_gguf(name, path)


def list_cached() -> tuple[list[CachedModel], list[str]]:
    """(every model in the cache, one line per entry that could not be read)."""
    root = models_root()
    found: list[CachedModel] = []
    problems: list[str] = []
    if not root.is_dir():
        return found, problems
    for entry in sorted(root.iterdir()):
        if entry.name in KNOWN_MODELS:
            path = entry / KNOWN_MODELS[entry.name].filename
            if not path.is_file():
                continue  # a pull that never finished
        elif (entry / "config.json").is_file():
            path = entry
        else:
            continue  # the warm weights cache and other working files
        try:
            found.append(describe(entry.name, path))
        except (ModelError, OSError, ValueError) as exc:
            problems.append(f"{entry.name}: {exc}")
    return found, problems


def check_hf_dir(directory: Path) -> CachedModel:
    """The directory's entry, once it is known to hold what loading needs."""
    entry = _describe_hf(directory.name, directory)
    if not any(directory.glob("*.safetensors")):
        raise ModelFileError(f"{directory}: no *.safetensors weight files")
    if not (directory / "tokenizer.json").is_file():
        raise ModelFileError(f"{directory}: no tokenizer.json")
    return entry


def pull_path(path: Path, name: str | None = None) -> tuple[str, Path]:
    """Add the HF directory at `path` to the cache as `name` (default: the directory's name);
    returns (name, the cache entry)."""
    directory = path.expanduser().resolve()
    if not directory.is_dir():
        raise ModelFileError(f"{path}: not an HF model directory (GGUF files are used by "
                             "path: --model FILE.gguf)")
    name = name or directory.name
    if not CACHE_NAME.match(name) or name in KNOWN_MODELS:
        raise ModelFileError(f"{name!r} cannot name a cached model: letters, digits, '.', '_' "
                             "and '-' only, and not a known model's name")
    check_hf_dir(directory)
    link = models_root() / name
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() and link.resolve() == directory:
        return name, link
    if link.exists() or link.is_symlink():
        raise ModelFileError(f"{link}: already holds a model named {name!r}")
    link.symlink_to(directory, target_is_directory=True)
    return name, link
