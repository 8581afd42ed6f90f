"""Streaming decode: concatenated deltas equal decode(all ids), never a broken character."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from minimill.models.types import LoadedModel

SAMPLE = "naïve 日本語 😀👍🏽 family 👨‍👩‍👧‍👦 <|im_end|> code: x**2\n\tdone"


def stream(loaded: LoadedModel, ids: list[int], chunks: list[int],
           skip_special_tokens: bool = True) -> list[str]:
    detok = loaded.tokenizer.detokenizer(skip_special_tokens=skip_special_tokens)
    deltas, pos, i = [], 0, 0
    while pos < len(ids):
        size = chunks[i % len(chunks)] if chunks else 1
        deltas.append(detok.add(ids[pos:pos + size]))
        pos += size
        i += 1
    deltas.append(detok.flush())
    return deltas


def test_token_by_token_emits_whole_characters(loaded_f32: LoadedModel) -> None:
    tok = loaded_f32.tokenizer
    ids = tok.encode(SAMPLE)
    deltas = stream(loaded_f32, ids, [1])
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    # Emoji are several byte-level tokens: some steps must have held text back.
    assert deltas.count("") > 1
    with_specials = stream(loaded_f32, ids, [1], skip_special_tokens=False)
    assert "".join(with_specials) == SAMPLE


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_ids_any_chunking(loaded_f32: LoadedModel, data: st.DataObject) -> None:
    tok = loaded_f32.tokenizer
    # Byte pieces of multi-byte characters and random ids, specials included.
    pool = tok.encode(SAMPLE) + list(range(0, 300))
    ids = data.draw(st.lists(st.one_of(st.sampled_from(pool),
                                       st.integers(0, tok.vocab_size - 1)), max_size=40))
    chunks = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=6))
    skip = data.draw(st.booleans())
    deltas = stream(loaded_f32, ids, chunks, skip_special_tokens=skip)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
