"""A small SentencePiece-style vocabulary in Gemma's shape, for GGUF tokenizer tests: a BPE
with byte fallback trained here on a few sentences, saved as the `tokenizer.json` that
transformers makes of Gemma's tokenizer.model (specials, `<0xNN>` byte pieces, then the
learned pieces; spaces spelled "▁"; no pre-tokenizer), and the pieces, scores and token types
that llama.cpp's converter writes of the same vocabulary."""

from __future__ import annotations

import json

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, processors, trainers

SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")
PAD_ID, EOS_ID, BOS_ID, UNK_ID = range(4)
# llama.cpp token types: normal, unknown, control, byte.
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A token factory turns requests into tokens, and tokens into answers.",
    "Sliding windows and global layers take turns in the decoder.",
    "Les modèles de langue prédisent le prochain mot.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Numbers like 12345 and 2026 are split into pieces too.",
    "hello hello hello world world, tokens tokens tokens!",
]
# Strings whose ids the GGUF tokenizer must give as the tokenizer.json does: learned pieces,
# spaces, and characters no piece spells (byte fallback).
PROBES = [
    "The quick brown fox jumps over the lazy dog.",
    "  two spaces, then tokens and turns",
    "prédisent über 2026",
    "日本語のテキスト and emoji 🦊!",
    "unseen words: zyzzyva qoph",
]


def gemma_style_tokenizer(vocab_pieces: int = 300) -> tokenizers.Tokenizer:
    """The reference tokenizer (what an HF directory of the model holds)."""
    spelled = [line.replace(" ", "\u2581") for line in CORPUS]
    trainer_model = tokenizers.Tokenizer(models.BPE())
    trainer_model.train_from_iterator(spelled, trainers.BpeTrainer(
        vocab_size=vocab_pieces, show_progress=False, special_tokens=[],
        max_token_length=6))
    learned = json.loads(trainer_model.to_str())["model"]
    pieces = sorted(learned["vocab"], key=learned["vocab"].__getitem__)
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    vocab = {token: index for index, token in enumerate([*SPECIALS, *bytes_, *pieces])}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in learned["merges"]]
    tokenizer = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "),
                                           decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in SPECIALS])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)])
    return tokenizer


def spm_pieces(tokenizer: tokenizers.Tokenizer) -> tuple[list[str], list[float], list[int]]:
    """(pieces, scores, token types) as a SentencePiece BPE model keeps them: a learned piece
    scores by its rank (the earlier learned, the higher)."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.__getitem__)
    scores, types = [], []
    for index, token in enumerate(tokens):
        if token in SPECIALS:
            scores.append(0.0)
            types.append(UNKNOWN if index == UNK_ID else CONTROL)
        elif token.startswith("<0x") and len(token) == 6:
            scores.append(0.0)
            types.append(BYTE)
        else:
            scores.append(-float(index))
            types.append(NORMAL)
    return tokens, scores, types
