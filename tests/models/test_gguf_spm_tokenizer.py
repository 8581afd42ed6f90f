"""SentencePiece vocabularies in GGUF (`tokenizer.ggml.model = "llama"`) against the
tokenizer.json of the same vocabulary; an unknown tokenizer model is refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from minimill.models.gguf_tokenizer import tokenizer_from_gguf
from minimill.models.types import ModelFileError
from tiny_spm import BOS_ID, EOS_ID, PROBES, UNK_ID, gemma_style_tokenizer, spm_pieces


def _metadata(**overrides: Any) -> dict[str, Any]:
    tokens, scores, types = spm_pieces(gemma_style_tokenizer())
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": BOS_ID, "tokenizer.ggml.eos_token_id": EOS_ID,
            "tokenizer.ggml.unknown_token_id": UNK_ID, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_space_prefix": False, **overrides}


def test_pieces_and_scores_give_the_ids_of_the_vocabulary_s_tokenizer_json() -> None:
    reference = gemma_style_tokenizer()
    tokenizer = tokenizer_from_gguf(_metadata(), Path("gemma.gguf"))
    for text in PROBES:
        ids = reference.encode(text).ids
        assert tokenizer.encode(text, add_special_tokens=True) == ids, text
        assert tokenizer.decode(ids) == text
    # Characters no piece spells come as their UTF-8 bytes.
    assert tokenizer.backend.encode("日", add_special_tokens=False).tokens == [
        "<0xE6>", "<0x97>", "<0xA5>"]
    assert tokenizer.bos_token_id == BOS_ID and tokenizer.eos_token_id == EOS_ID


def test_a_space_prefix_is_added_and_taken_off_again_where_the_file_asks() -> None:
    tokenizer = tokenizer_from_gguf(_metadata(**{"tokenizer.ggml.add_space_prefix": True}),
                                    Path("llama2.gguf"))
    ids = tokenizer.encode("token factory")
    assert tokenizer.backend.encode("token factory", add_special_tokens=False
                                    ).tokens[0].startswith("\u2581")
    assert tokenizer.decode(ids) == "token factory"


@pytest.mark.parametrize("kind", ["bert", None])
def test_an_unknown_tokenizer_model_is_refused_by_name(kind: str | None) -> None:
    with pytest.raises(ModelFileError, match=f"tokenizer model {kind!r} is not supported"):
        tokenizer_from_gguf(_metadata(**{"tokenizer.ggml.model": kind}), Path("x.gguf"))


def test_a_vocabulary_without_a_score_per_token_is_refused() -> None:
    with pytest.raises(ModelFileError, match="a score and a token type per token"):
        tokenizer_from_gguf(_metadata(**{"tokenizer.ggml.scores": [0.0]}), Path("x.gguf"))
