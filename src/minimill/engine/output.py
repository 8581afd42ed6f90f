"""Per-request text state: incremental detokenizing, stop strings, deltas for the caller.

Stop strings are found in the decoded text, so they may span tokens. The returned text never
contains the stop string, and while a request runs, the last `max(len(stop)) - 1` characters
are held back: they might turn out to be the start of a stop string.
"""

from __future__ import annotations

from minimill.engine.params import FinishReason, TokenDelta, TokenLogprob
from minimill.engine.sequence import RequestStatus, Sequence
from minimill.models.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestText:
    """Text of one request's outputs; the resumed tokens are decoded but not re-emitted."""

    __slots__ = ("_detok", "_emitted", "_hold", "_stops", "num_emitted_tokens", "text")

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...],
                 resume_token_ids: list[int]) -> None:
        self._detok: IncrementalDetokenizer = tokenizer.detokenizer()
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = self._detok.add(resume_token_ids) if resume_token_ids else ""
        self._emitted = len(self.text)  # characters already handed out (or resumed)
        self.num_emitted_tokens = len(resume_token_ids)

    def add(self, new_token_ids: list[int]) -> bool:
        """Decode new tokens; True when a stop string appeared (text is cut before it)."""
        before = len(self.text)
        self.text += self._detok.add(new_token_ids)
        if not self._stops:
            return False
        # Only a window that contains new characters can hold a new match.
        start = max(0, before - self._hold)
        found = [i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
        if found:
            self.text = self.text[:min(found)]
            return True
        return False

    def finish(self, stopped_by_string: bool) -> None:
        if not stopped_by_string:
            self.text += self._detok.flush()

    def take_delta(self, finished: bool) -> str:
        """New text since the last call, holding back a possible stop-string prefix."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta


class OutputProcessor:
    """Turns sequences that got tokens into TokenDeltas; owns every running request's text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.texts: dict[str, RequestText] = {}

    def add_request(self, seq: Sequence) -> None:
        self.texts[seq.request_id] = RequestText(self.tokenizer, seq.params.stop,
                                                 seq.output_token_ids)

    def process(self, seq: Sequence) -> bool:
        """Decode the sequence's newest tokens; True when a stop string ends it."""
        state = self.texts[seq.request_id]
        new_ids = seq.token_ids[seq.num_prompt_tokens + state.num_emitted_tokens:]
        state.num_emitted_tokens += len(new_ids)
        if seq.status == RequestStatus.FINISHED_STOPPED and new_ids:
            # Stopped by a token (eos or a stop id): it adds no text, as in vLLM.
            return state.add(new_ids[:-1])
        return state.add(new_ids)

    def delta(self, seq: Sequence, new_token_ids: list[int], finish_reason: FinishReason | None,
              logprobs: list[TokenLogprob] | None, stopped_by_string: bool = False) -> TokenDelta:
        state = self.texts[seq.request_id]
        if finish_reason is not None:
            state.finish(stopped_by_string)
        text = state.take_delta(finish_reason is not None)
        return TokenDelta(seq.request_id, new_token_ids, text, finish_reason, logprobs,
                          seq.num_prompt_tokens, seq.seed)

    def text(self, request_id: str) -> str:
        return self.texts[request_id].text

    def remove(self, request_id: str) -> None:
        self.texts.pop(request_id, None)
