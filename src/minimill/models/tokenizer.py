"""The tokenizer a model is served with: encode, decode, streaming decode, chat template.

A thin wrapper over a `tokenizers.Tokenizer` (built from a GGUF file's vocabulary or read from
an HF `tokenizer.json`), plus the special tokens and chat template that live beside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers

from minimill.models.chat_template import ChatTemplateError, render_chat_template

_REPLACEMENT = "\ufffd"
# Chat end-of-turn tokens that also end generation when a vocabulary has them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>",
                      "<|end|>", "<end_of_turn>", "<|eom_id|>")


class Tokenizer:
    """Text <-> token ids for one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.chat_template = chat_template
        self.bos_token_id = self.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = self.token_to_id(eos_token) if eos_token else None
        self.pad_token_id = self.token_to_id(pad_token) if pad_token else None
        self.special_token_ids = frozenset(
            token_id for token_id, added in backend.get_added_tokens_decoder().items()
            if added.special
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of `text`; special-token text in it (e.g. `<|im_end|>`) maps to its single id."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False
                     ) -> list[list[int]]:
        """`encode` of many texts at once (parallel inside the tokenizers library)."""
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD."""
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        """Id of a token spelled as in the vocabulary, or None."""
        token_id = self.backend.token_to_id(token)
        return None if token_id is None else int(token_id)

    def token_to_str(self, token_id: int) -> str:
        """Readable text of one token (as a streamed delta would show it, specials included)."""
        return self.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for a conversation, rendered with the model's chat template."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template")
        special: Mapping[str, str | None] = {
            "bos_token": self.bos_token, "eos_token": self.eos_token,
            "pad_token": self.pad_token, "unk_token": self.unk_token,
        }
        return render_chat_template(self.chat_template, messages,
                                    add_generation_prompt=add_generation_prompt,
                                    special_tokens=special, **extra)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh streaming decoder for one sequence of generated ids."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas, never splitting a UTF-8 character.

    Concatenating every `add` delta and the final `flush` gives exactly `decode(all ids)`.
    Each step decodes only a short window: the tokens since the last emitted point plus the
    ones just before it, so decoders that treat the first token specially (leading-space
    stripping) see the same context twice and the difference is the new text.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: tokens before it are emitted and settled
        self._read_offset = 0  # tokens before it are emitted
        self._emitted = 0  # characters of decode(ids[prefix_offset:]) already emitted

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def add(self, new_ids: Sequence[int]) -> str:
        """Append ids; returns the text they complete (may be "" while a character is split)."""
        self._ids.extend(new_ids)
        text = self._window_text()
        if text.endswith(_REPLACEMENT):
            # Possibly a multi-byte character cut in the middle: wait for more ids.
            return ""
        delta = text[self._emitted:]
        # Keep one emitted token of context before the next window.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._emitted = len(self._window_text()) if self._prefix_offset < self._read_offset else 0
        return delta

    def prime(self, ids: Sequence[int]) -> str:
        """Add ids generated earlier (a resumed request) and return the text an uninterrupted
        run's deltas would have handed out for them: a character still split at the end is
        left for the next `add`, as it would have been."""
        if not ids:
            return ""
        settled = len(ids)
        # A UTF-8 character spans at most 4 byte tokens: step back past a split one.
        while settled > 0 and len(ids) - settled < 4 and self._tokenizer.decode(
                list(ids[:settled]), skip_special_tokens=self._skip_special).endswith(_REPLACEMENT):
            settled -= 1
        text = self.add(ids[:settled]) if settled else ""
        if settled < len(ids):
            text += self.add(ids[settled:])
        return text

    def flush(self) -> str:
        """The rest of the text at the end of the sequence (held-back replacement chars)."""
        text = self._window_text()
        delta = text[self._emitted:]
        self._emitted = len(text)
        return delta

    def _window_text(self) -> str:
        return self._tokenizer.decode(self._ids[self._prefix_offset:],
                                      skip_special_tokens=self._skip_special)
