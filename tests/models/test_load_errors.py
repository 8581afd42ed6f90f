"""Bad model files give a ModelFileError naming the file, never a raw traceback from a parser."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from minimill.models.loader import load_model
from minimill.models.types import (
    ModelError,
    ModelFileError,
    ModelNotPulledError,
    UnknownModelError,
)


def _copy_prefix(src: Path, dst: Path, num_bytes: int) -> Path:
    with src.open("rb") as f:
        dst.write_bytes(f.read(num_bytes))
    return dst


@pytest.mark.parametrize("num_bytes", [10, 1_000, 500_000, 60_000_000])
def test_truncated_gguf(num_bytes: int, tmp_path: Path, model_file: Path) -> None:
    # Cut inside the magic, the metadata, the tokenizer arrays, and the tensor data.
    path = _copy_prefix(model_file, tmp_path / "cut.gguf", num_bytes)
    with pytest.raises(ModelFileError) as info:
        load_model(str(path))
    assert str(path) in str(info.value)


def test_garbage_and_empty_gguf(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a model at all " * 100)
    with pytest.raises(ModelFileError, match=r"garbage\.gguf.*not a GGUF"):
        load_model(str(garbage))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelFileError, match=r"empty\.gguf"):
        load_model(str(empty))
    # Right magic, absurd counts: must not try to allocate or loop forever.
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (2**40).to_bytes(8, "little") * 2
                      + b"\xff" * 64)
    with pytest.raises(ModelFileError, match=r"bogus\.gguf"):
        load_model(str(bogus))


def test_gguf_with_flipped_tokenizer_bytes(tmp_path: Path, model_file: Path) -> None:
    # Corrupt a string length deep in the vocabulary: the header no longer parses.
    path = tmp_path / "corrupt.gguf"
    shutil.copyfile(model_file, path)
    with path.open("r+b") as f:
        f.seek(300_000)
        f.write(b"\xff" * 16)
    with pytest.raises(ModelFileError, match=r"corrupt\.gguf"):
        load_model(str(path))


def _hf_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "hf"
    directory.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 4}
    (directory / "config.json").write_text(json.dumps(config))
    vocab = {"a": 0, "b": 1, "c": 2, "d": 3}
    tokenizer = {"version": "1.0", "model": {"type": "WordLevel", "vocab": vocab,
                                             "unk_token": "a"}}
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    return directory


def test_hf_dir_missing_weights(tmp_path: Path) -> None:
    directory = _hf_dir(tmp_path)
    with pytest.raises(ModelFileError, match=rf"{directory}.*safetensors"):
        load_model(str(directory))


def test_hf_dir_invalid_config_json(tmp_path: Path) -> None:
    directory = _hf_dir(tmp_path)
    (directory / "config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match=r"config\.json.*not valid JSON"):
        load_model(str(directory))
    (directory / "config.json").unlink()
    with pytest.raises(ModelFileError, match=r"config\.json.*missing"):
        load_model(str(directory))


def test_hf_dir_truncated_safetensors(tmp_path: Path) -> None:
    directory = _hf_dir(tmp_path)
    shard = directory / "model.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(4, 8)}, str(shard))
    shard.write_bytes(shard.read_bytes()[:-20])
    with pytest.raises(ModelFileError, match=r"model\.safetensors"):
        load_model(str(directory))


def test_hf_dir_missing_tensors_and_unsupported_arch(tmp_path: Path) -> None:
    directory = _hf_dir(tmp_path)
    save_file({"model.embed_tokens.weight": torch.zeros(4, 8)},
              str(directory / "model.safetensors"))
    with pytest.raises(ModelFileError, match="lack"):
        load_model(str(directory))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"architectures": ["GPT2LMHead"]}))
    with pytest.raises(ModelFileError, match="not supported"):
        load_model(str(directory))


def test_names_and_missing_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIMILL_HOME", str(tmp_path))
    with pytest.raises(ModelNotPulledError, match="minimill pull smollm2-135m"):
        load_model("smollm2-135m")
    with pytest.raises(UnknownModelError):
        load_model(str(tmp_path / "nope.gguf"))
    assert issubclass(ModelFileError, ModelError)


def test_known_name_loads_from_the_cache(minimill_home: Path) -> None:
    loaded = load_model("smollm2-135m")
    assert loaded.name == "smollm2-135m"
    assert loaded.source_path.startswith(str(minimill_home))
    assert loaded.weights["model.embed_tokens.weight"].dtype == torch.bfloat16
