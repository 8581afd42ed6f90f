"""The warm weights cache on the real model: written once, mapped after, identical to a cold
load; a corrupt, truncated or foreign file is ignored and rebuilt, never used."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from minimill.models.gguf_loader import load_gguf
from minimill.models.types import LoadedModel
from minimill.models.warm_cache import cache_path, load_gguf_warm

DTYPE = torch.bfloat16
TEXTS = ["Hello, world!", "<|im_start|>user\nDeux bières, s'il vous plaît.<|im_end|>",
         "def f(x):\n    return x ** 2  # 🙂"]


@pytest.fixture(scope="module")
def cold(model_file: Path) -> LoadedModel:
    return load_gguf(model_file, DTYPE, name="m")


def assert_same(warm: LoadedModel, cold: LoadedModel) -> None:
    assert warm.config == cold.config
    assert warm.weights.keys() == cold.weights.keys()
    for name, tensor in cold.weights.items():
        assert warm.weights[name].dtype == DTYPE
        assert torch.equal(warm.weights[name], tensor), name
    assert warm.chat_template == cold.chat_template
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id",
                 "eos_token_id", "special_token_ids", "vocab_size"):
        assert getattr(warm.tokenizer, attr) == getattr(cold.tokenizer, attr), attr
    for text in TEXTS:
        ids = cold.tokenizer.encode(text)
        assert warm.tokenizer.encode(text) == ids
        assert warm.tokenizer.encode(text, add_special_tokens=True) == \
            cold.tokenizer.encode(text, add_special_tokens=True)
        assert warm.tokenizer.decode(ids) == cold.tokenizer.decode(ids)
    messages = [{"role": "user", "content": "Hi"}]
    assert warm.tokenizer.apply_chat_template(messages) == \
        cold.tokenizer.apply_chat_template(messages)


def test_written_once_then_mapped_and_identical(model_file: Path, tmp_path: Path,
                                                cold: LoadedModel) -> None:
    first = load_gguf_warm(model_file, DTYPE, "m", tmp_path)
    assert first.extra["warm_cache"].startswith("cold, cached as")
    path = cache_path(model_file, DTYPE, tmp_path)
    assert path.is_file() and path.parent == tmp_path
    assert DTYPE is torch.bfloat16 and ".bfloat16." in path.name
    written_at = path.stat().st_mtime_ns
    started = time.perf_counter()
    warm = load_gguf_warm(model_file, DTYPE, "m", tmp_path)
    took = time.perf_counter() - started
    assert warm.extra["warm_cache"] == f"warm cache {path.name}"
    assert path.stat().st_mtime_ns == written_at  # read, not rewritten
    assert_same(warm, cold)
    assert warm.extra["format"] == "gguf" and warm.source_path == str(model_file)
    print(f"warm load {took:.2f}s")


def corrupt_one_byte(path: Path) -> None:
    with path.open("r+b") as f:
        f.seek(path.stat().st_size - 1000)  # inside the last tensor's bytes
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def truncate(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)


def garble_header(path: Path) -> None:
    with path.open("r+b") as f:
        f.write(b"\xff" * 64)


def foreign(path: Path) -> None:
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4, dtype=DTYPE)}, str(path),
              metadata={"format": "something else"})


@pytest.mark.parametrize("damage", [corrupt_one_byte, truncate, garble_header, foreign])
def test_a_damaged_or_foreign_file_is_ignored_and_rebuilt(
        model_file: Path, tmp_path: Path, cold: LoadedModel, damage: object,
        caplog: pytest.LogCaptureFixture) -> None:
    load_gguf_warm(model_file, DTYPE, "m", tmp_path)
    path = cache_path(model_file, DTYPE, tmp_path)
    damage(path)  # type: ignore[operator]
    with caplog.at_level(logging.WARNING, logger="minimill.models"):
        rebuilt = load_gguf_warm(model_file, DTYPE, "m", tmp_path)
    assert "ignoring the warm cache file" in caplog.text
    assert rebuilt.extra["warm_cache"].startswith("cold, cached as")
    assert_same(rebuilt, cold)
    assert load_gguf_warm(model_file, DTYPE, "m", tmp_path).extra["warm_cache"].startswith(
        "warm cache")


def test_a_file_made_for_another_dtype_or_source_is_not_used(model_file: Path,
                                                               tmp_path: Path) -> None:
    load_gguf_warm(model_file, torch.float32, "m", tmp_path)
    f32 = cache_path(model_file, torch.float32, tmp_path)
    bf16 = cache_path(model_file, DTYPE, tmp_path)
    shutil.copy(f32, bf16)  # the float32 file under the bfloat16 name
    assert load_gguf_warm(model_file, DTYPE, "m", tmp_path).extra["warm_cache"].startswith(
        "cold")
    # A changed source (here: a copy with a new mtime) gets its own file; the old one goes.
    source = tmp_path / "copy" / model_file.name
    source.parent.mkdir()
    shutil.copy(model_file, source)
    load_gguf_warm(source, DTYPE, "m", tmp_path)
    before = cache_path(source, DTYPE, tmp_path)
    os.utime(source, (time.time() + 5, time.time() + 5))
    after = cache_path(source, DTYPE, tmp_path)
    assert after != before
    assert load_gguf_warm(source, DTYPE, "m", tmp_path).extra["warm_cache"].startswith("cold")
    assert after.is_file() and not before.exists()


def test_turned_off(model_file: Path, tmp_path: Path,
                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIMILL_WARM_CACHE", "0")
    loaded = load_gguf_warm(model_file, DTYPE, "m", tmp_path)
    assert "warm_cache" not in loaded.extra and list(tmp_path.iterdir()) == []
