"""Grammar-constrained sampling: a matcher per guided request and the token masks of a step.

The grammar engine is llguidance (models/grammar.py builds its grammars). A request with
`SamplingParams.guided` gets a `Guide`: its matcher, advanced by every token the request
samples (and, on admission, by a resumed request's checkpointed tokens, so that a request
resumed on another site continues exactly as the uninterrupted one). Before a step samples, each
guided row's allowed tokens are written into a bitmask (one bit per vocabulary id, 32 per int32
word); the sampler sets every other logit to -inf.

Masks are filled on the engine's calling thread while the step's forward pass runs on the
cores (core.py starts the lane first, then fills; the lane waits for `StepMasks.ready` only at
its sampling), so on a machine with a thread to spare they cost the step nothing. Compiled
grammars are cached by their grammar text: a request with a schema seen before deep-copies a
compiled matcher instead of compiling.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

import llguidance
import torch

from minimill.engine.params import InvalidRequestError
from minimill.models.grammar import GrammarError, GuidedDecoding, parser_limits, to_grammar
from minimill.models.tokenizer import Tokenizer

# Compiled grammars kept per engine (each a matcher in its start state, copied per request).
_CACHE_SIZE = 256


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask."""
    return (vocab_size + 31) // 32


class Guide:
    """One request's grammar state."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar refuses it (the request fails)."""
        return bool(self.matcher.consume_token(token_id)) and not self.matcher.is_error()

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but the end of the output may follow."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    def fill(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row` (a contiguous int32 [words] tensor)."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


class Guides:
    """The engine's grammar engine: a tokenizer view for it (built on first use: ~0.2 s) and
    compiled grammars cached by text."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]
                 ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        eos = tokenizer.eos_token_id
        self._eos = eos if eos is not None else min(eos_token_ids, default=0)
        self._lltok: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (not found in the cache), since start

    def prepare(self) -> None:
        """Build the grammar engine's view of the tokenizer now (else on first use)."""
        self._llg_tokenizer()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._lltok is None:
            self._lltok = llguidance.LLTokenizer(self._tokenizer.backend.to_str(),
                                                 n_vocab=self.vocab_size, eos_token=self._eos)
        return self._lltok

    def start(self, spec: GuidedDecoding, token_ids: Iterable[int] = ()) -> Guide:
        """A guide for a new request, advanced past `token_ids` (a resumed request's outputs).
        Raises InvalidRequestError for a grammar that does not compile or tokens it refuses."""
        try:
            grammar = to_grammar(spec)
        except (GrammarError, ValueError) as exc:
            raise InvalidRequestError(f"the output's schema or tools cannot be enforced: "
                                      f"{exc}") from None
        with self._lock:  # admission may run on a front end's thread
            template = self._compiled.get(grammar)
            if template is None:
                template = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0,
                                                limits=parser_limits())
                if template.is_error():
                    raise InvalidRequestError("the output's schema or tools cannot be "
                                              f"enforced: {template.get_error()}")
                self.compiles += 1
                self._compiled[grammar] = template
                if len(self._compiled) > _CACHE_SIZE:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(grammar)
            guide = Guide(template.deep_copy())
        for token_id in token_ids:
            if not guide.accept(token_id):
                raise InvalidRequestError("the checkpoint's tokens do not match the request's "
                                          "schema or tools")
        return guide


class StepMasks:
    """The bitmask rows of one step's guided samples, filled while the forward pass runs."""

    def __init__(self, guides: list[Guide], vocab_size: int) -> None:
        self.guides = guides
        self.words = torch.empty(len(guides), mask_words(vocab_size), dtype=torch.int32)
        self.ready = threading.Event()

    def fill(self) -> None:
        try:
            for i, guide in enumerate(self.guides):
                guide.fill(self.words[i])
        finally:
            self.ready.set()  # a lane waiting to sample must never hang
