"""The warm weights cache: a GGUF model loaded once (dequantized, un-permuted, in the dtype
asked for) is written as one safetensors file, which later starts memory-map instead of
dequantizing again. Dequantizing takes seconds when other processes share the cores; mapping
the file takes milliseconds, so a restarted worker is taking leases again within seconds.

The file sits in the model's directory of the model cache (or `models/warm/` for a model
given by path) and is named `<stem>.<dtype>.<identity>.safetensors`, where the identity hashes
the source file's path, size and mtime. Its metadata repeats those, and carries everything
else a LoadedModel needs (config, tokenizer, chat template) plus a digest of every tensor's
bytes. A file that cannot be read, does not describe this source and dtype, or whose bytes do
not match the digest is ignored (logged) and rebuilt from the source, never used. Files are
written to a temporary name and renamed, so a reader never sees half of one; older files of
the same model and dtype are removed when a new one is written.

MINIMILL_WARM_CACHE=0 turns the cache off (every start dequantizes, nothing is written).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import tokenizers
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minimill.models.gguf_deepseek2 import FLOAT32_SUFFIXES
from minimill.models.shape_check import check_shapes
from minimill.models.tokenizer import Tokenizer
from minimill.models.types import LoadedModel, ModelConfig, kept_extra

log = logging.getLogger("minimill.models")

FORMAT = "minimill-warm-1"
_SPECIALS = ("bos_token", "eos_token", "pad_token", "unk_token")


class WarmCacheMiss(Exception):
    """A cache file that must not be used; the message says why."""


def enabled() -> bool:
    return os.environ.get("MINIMILL_WARM_CACHE", "1") != "0"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _identity(source: Path) -> dict[str, str]:
    stat = source.stat()
    return {"source": str(source.resolve()), "source_size": str(stat.st_size),
            "source_mtime_ns": str(stat.st_mtime_ns)}


def cache_path(source: Path, dtype: torch.dtype, cache_dir: Path) -> Path:
    """Where the warm file of `source` in `dtype` lives (whether or not it exists)."""
    key = hashlib.sha256("\0".join(_identity(source).values()).encode()).hexdigest()[:16]
    return cache_dir / f"{source.stem}.{_dtype_name(dtype)}.{key}.safetensors"


def _digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A digest of the tensors' names and bytes, in name order."""
    h = hashlib.sha1(usedforsecurity=False)
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        _digest_one(h, name, tensor)
    return h.hexdigest()


def _digest_one(h: Any, name: str, tensor: torch.Tensor) -> None:
    h.update(name.encode() + b"\0")
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    h.update(flat.numpy().data)


def _metadata(loaded: LoadedModel, source: Path, dtype: torch.dtype) -> dict[str, str]:
    tokenizer = loaded.tokenizer
    return {
        "format": FORMAT, **_identity(source), "dtype": _dtype_name(dtype),
        "config": json.dumps(dataclasses.asdict(loaded.config)),
        "tokenizer": tokenizer.backend.to_str(),
        "special_tokens": json.dumps({k: getattr(tokenizer, k) for k in _SPECIALS}),
        "chat_template": json.dumps(loaded.chat_template),
        "extra": json.dumps(loaded.extra),
        "digest": _digest(loaded.weights.items()),
    }


def write(loaded: LoadedModel, source: Path, dtype: torch.dtype, cache_dir: Path) -> Path:
    """Write the warm file for `loaded` (read from `source`); older ones of it go."""
    target = cache_path(source, dtype, cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")
    try:
        save_file({k: v.contiguous() for k, v in loaded.weights.items()}, str(partial),
                  metadata=_metadata(loaded, source, dtype))
        partial.chmod(0o644)  # readable as the model file beside it is
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    for old in cache_dir.glob(f"{source.stem}.{_dtype_name(dtype)}.*.safetensors"):
        if old != target:
            old.unlink(missing_ok=True)
    return target


def read(path: Path, source: Path, dtype: torch.dtype, name: str,
         keep: Callable[[str], bool] | None = None) -> LoadedModel:
    """The LoadedModel in the warm file `path`; WarmCacheMiss if it is not one to use.
    `keep`: only the tensors it names are kept, the others read one at a time for the
    digest and dropped."""
    h = hashlib.sha1(usedforsecurity=False)
    weights: dict[str, torch.Tensor] = {}
    shapes: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            meta: dict[str, Any] = f.metadata() or {}
            for key in sorted(f.keys()):
                tensor = f.get_tensor(key)
                _digest_one(h, key, tensor)
                shapes[key] = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
                if keep is None:
                    weights[key] = tensor
                elif keep(key):
                    # A copy: the tensors safetensors hands out map the whole file, and every
                    # page of it was read for the digest; once no tensor maps it the file's
                    # pages leave this process.
                    weights[key] = tensor.clone()
    except Exception as exc:  # a truncated or garbled file: safetensors says so its own way
        raise WarmCacheMiss(f"unreadable ({type(exc).__name__}: {exc})") from None
    if meta.get("format") != FORMAT:
        raise WarmCacheMiss(f"not a warm cache file (format {meta.get('format')!r})")
    expected = {**_identity(source), "dtype": _dtype_name(dtype)}
    wrong = [k for k, v in expected.items() if meta.get(k) != v]
    if wrong:
        raise WarmCacheMiss(f"made for another source or dtype ({', '.join(wrong)} differ)")
    # DeepSeek's router tensors are float32 whatever the dtype, as the loader keeps them.
    if any(t.dtype != dtype and not (t.dtype == torch.float32 and k.endswith(FLOAT32_SUFFIXES))
           for k, t in shapes.items()):
        raise WarmCacheMiss("tensors of another dtype")
    try:
        raw = json.loads(meta["config"])
        # JSON gave lists back for the config's tuples.
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                  for k, v in raw.items()}
        config = ModelConfig(**fields)
        specials = json.loads(meta["special_tokens"])
        chat_template = json.loads(meta["chat_template"])
        tokenizer = Tokenizer(tokenizers.Tokenizer.from_str(meta["tokenizer"]),
                              chat_template=chat_template,
                              **{k: specials.get(k) for k in _SPECIALS})
        extra = json.loads(meta["extra"])
        check_shapes(path, config, shapes)
    except Exception as exc:
        raise WarmCacheMiss(f"inconsistent ({type(exc).__name__}: {exc})") from None
    if h.hexdigest() != meta.get("digest"):
        raise WarmCacheMiss("its bytes do not match their digest (corrupt)")
    return LoadedModel(name=name, config=config, weights=weights, tokenizer=tokenizer,
                       chat_template=chat_template, source_path=str(source),
                       extra={**extra, "warm_cache": f"warm cache {path.name}",
                              **kept_extra(weights, shapes)})



def load_gguf_warm(source: Path, dtype: torch.dtype, name: str, cache_dir: Path,
                   keep: Callable[[str], bool] | None = None) -> LoadedModel:
    """`load_gguf`, through the warm cache when it is enabled. `keep`: only the weights it
    names, read one by one from the warm file; a cold start dequantizes the whole model once
    (to write the warm file) and then drops the others."""
    # Only a cold load reads GGUF: a warm start does without the gguf package's import.
    from minimill.models.gguf_loader import load_gguf

    if not enabled():
        return _kept(load_gguf(source, dtype, name=name), keep)
    path = cache_path(source, dtype, cache_dir)
    if path.is_file():
        try:
            return read(path, source, dtype, name, keep)
        except WarmCacheMiss as exc:
            log.warning("ignoring the warm cache file %s: %s; rebuilding it", path, exc)
    else:
        log.info("first start of %s in %s: dequantizing it once; later starts map %s",
                 source.name, _dtype_name(dtype), path)
    loaded = load_gguf(source, dtype, name=name)
    try:
        written = write(loaded, source, dtype, cache_dir)
    except OSError as exc:  # a read-only or full disk: serve anyway, cold next time too
        log.warning("cannot write the warm cache in %s: %s", cache_dir, exc)
        loaded.extra["warm_cache"] = "cold, cache not written"
        return _kept(loaded, keep)
    loaded.extra["warm_cache"] = f"cold, cached as {written.name}"
    return _kept(loaded, keep)


def _kept(loaded: LoadedModel, keep: Callable[[str], bool] | None) -> LoadedModel:
    if keep is None:
        return loaded
    shapes = {k: torch.empty(t.shape, dtype=t.dtype, device="meta")
              for k, t in loaded.weights.items()}
    loaded.weights = {k: t for k, t in loaded.weights.items() if keep(k)}
    loaded.extra.update(kept_extra(loaded.weights, shapes))
    return loaded
