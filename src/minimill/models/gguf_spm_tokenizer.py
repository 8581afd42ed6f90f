"""A SentencePiece vocabulary in GGUF (`tokenizer.ggml.model = "llama"`: Llama 2, Gemma) as a
`tokenizers` BPE with byte fallback.

The file keeps pieces, scores and token types, no merges: llama.cpp's tokenizer joins the
adjacent pair whose joined piece scores highest, again and again. A BPE whose merges are every
split of every piece into two pieces, ranked by the joined piece's score, joins the same pairs
in the same order (how transformers converts SentencePiece models to `tokenizer.json`). A
character that no piece spells becomes its UTF-8 bytes' `<0xNN>` pieces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers

from minimill.models.types import ModelFileError

# llama.cpp token types (llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's visible space


def _merges(tokens: list[str], scores: list[float], token_types: list[int]
            ) -> list[tuple[str, str]]:
    """Every (left, right) pair of pieces that joins into a normal piece, the best-scored
    joined piece first (ties: the lower id, then the lower left id)."""
    ids = {token: index for index, token in enumerate(tokens)
           if token_types[index] in (NORMAL, USER_DEFINED, UNUSED)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for index, piece in enumerate(tokens):
        if token_types[index] != NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[index], index, ids[left], left, right))
    ranked.sort(key=lambda entry: entry[:3])
    return [(left, right) for *_, left, right in ranked]


def spm_backend(metadata: dict[str, Any], path: Path) -> tokenizers.Tokenizer:
    """The tokenizers backend of a GGUF SentencePiece vocabulary (no post-processor)."""
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelFileError(f"{path}: GGUF metadata has no tokenizer tokens")
    scores: list[float] = metadata.get("tokenizer.ggml.scores") or []
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or []
    if len(scores) != len(tokens) or len(token_types) != len(tokens):
        raise ModelFileError(f"{path}: a SentencePiece vocabulary needs a score and a token "
                             f"type per token ({len(tokens)} tokens, {len(scores)} scores, "
                             f"{len(token_types)} types)")
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    backend = tokenizers.Tokenizer(models.BPE(
        vocab={token: index for index, token in enumerate(tokens)},
        merges=_merges(tokens, scores, token_types), dropout=None, unk_token=unk,
        fuse_unk=True, byte_fallback=True))
    # llama.cpp's default (Llama 2) puts a space before the text; Gemma's files say not to.
    prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", SPACE)
    backend.normalizer = (normalizers.Sequence([normalizers.Prepend(SPACE), replace])
                          if prefix_space else replace)
    steps: list[decoders.Decoder] = [decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    add_typed_tokens(backend, tokens, token_types)
    return backend


def add_typed_tokens(backend: tokenizers.Tokenizer, tokens: list[str],
                     token_types: list[int]) -> None:
    """The vocabulary's control tokens as special tokens and its user-defined ones as added
    tokens, both matched verbatim in the text (any GGUF tokenizer model)."""
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, token_types, strict=True)
                                if kind == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, token_types, strict=True)
                        if kind == USER_DEFINED])
