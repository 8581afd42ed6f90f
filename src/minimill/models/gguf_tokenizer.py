"""Building a Tokenizer from a GGUF file's `tokenizer.*` metadata: byte-level BPE vocabularies
here, SentencePiece ones in gguf_spm_tokenizer.py.

llama.cpp names the pre-tokenizer (`tokenizer.ggml.pre`) instead of storing it; each supported
name maps to the split the vocabulary's merges were learned with, as in the models' own
`tokenizer.json` files.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers, processors

from minimill.models.gguf_spm_tokenizer import CONTROL, add_typed_tokens, spm_backend
from minimill.models.tokenizer import Tokenizer
from minimill.models.types import ModelFileError

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEX_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Names whose split is GPT-2's own regex (ByteLevel with use_regex=True), optionally after
# splitting every digit apart.
_GPT2_SPLITS = {"default": False, "gpt-2": False, "gpt2": False, "smollm": True}


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character table that byte-level BPE vocabularies are spelled in."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in visible}
    others = [b for b in range(256) if b not in table]
    table.update({b: chr(256 + n) for n, b in enumerate(others)})
    return table


def _byte_spelling(text: str) -> str:
    table = _bytes_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


def _pre_tokenizer(pre: str, path: Path) -> pre_tokenizers.PreTokenizer:
    if pre in _GPT2_SPLITS:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if not _GPT2_SPLITS[pre]:
            return byte_level
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _REGEX_SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    supported = ", ".join(sorted([*_GPT2_SPLITS, *_REGEX_SPLITS]))
    raise ModelFileError(f"{path}: tokenizer pre-tokenizer {pre!r} is not supported "
                         f"(supported: {supported})")


def _gpt2_backend(metadata: dict[str, Any], path: Path) -> tokenizers.Tokenizer:
    """A byte-level BPE vocabulary with its merges (`tokenizer.ggml.model = "gpt2"`)."""
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    raw_merges: list[str] = metadata.get("tokenizer.ggml.merges") or []
    if not tokens or not raw_merges:
        raise ModelFileError(f"{path}: GGUF metadata has no tokenizer tokens or merges")
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = set(_bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for index, (token, token_type) in enumerate(zip(tokens, token_types, strict=True)):
        # Control tokens keep their spelling so chat templates match them as written.
        keep = token_type == CONTROL or set(token) <= alphabet
        vocab[token if keep else _byte_spelling(token)] = index
    merges: list[tuple[str, str]] = []
    for merge in raw_merges:
        left, sep, right = merge.partition(" ")
        if not sep or " " in right:
            raise ModelFileError(f"{path}: malformed tokenizer merge {merge!r}")
        merges.append((left, right))
    backend = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
        end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "default")),
                                           path)
    backend.decoder = decoders.ByteLevel()
    add_typed_tokens(backend, tokens, token_types)
    return backend


# tokenizer.ggml.model -> the builder of its backend.
_BACKENDS = {"gpt2": _gpt2_backend, "llama": spm_backend}


def tokenizer_from_gguf(metadata: dict[str, Any], path: Path) -> Tokenizer:
    """The Tokenizer a GGUF file describes; ModelFileError for what it cannot build."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in _BACKENDS:
        raise ModelFileError(f"{path}: tokenizer model {kind!r} is not supported (supported: "
                             "'gpt2' byte-level BPE, 'llama' SentencePiece)")
    backend = _BACKENDS[kind](metadata, path)
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []

    def token_of(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is None:
            return None
        if not 0 <= int(token_id) < len(tokens):
            raise ModelFileError(f"{path}: tokenizer.ggml.{key} {token_id} is out of range")
        return tokens[int(token_id)]

    bos = token_of("bos_token_id")
    if bos is not None and metadata.get("tokenizer.ggml.add_bos_token", False):
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B",
            special_tokens=[(bos, int(metadata["tokenizer.ggml.bos_token_id"]))])
    return Tokenizer(
        backend, bos_token=bos, eos_token=token_of("eos_token_id"),
        pad_token=token_of("padding_token_id"), unk_token=token_of("unknown_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"),
    )
