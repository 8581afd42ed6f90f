"""Per-request text state: incremental detokenizing, stop strings, deltas for the caller.

Stop strings are found in the decoded text, so they may span tokens. The returned text never
contains the stop string, and while a request runs, the last `max(len(stop)) - 1` characters
are held back: they might turn out to be the start of a stop string. Only text not yet handed
out is kept, so the work per step is proportional to the new tokens, not to the output so far.

A resumed request (continuing from a checkpoint) is told which text was already handed out
for its resumed tokens; whatever the decoding of those tokens holds beyond it (a held-back
stop-string prefix, the end of a split UTF-8 character) is handed out later, exactly as the
uninterrupted request would have, so checkpoint text + deltas equals the uninterrupted text.
"""

from __future__ import annotations

from minimill.engine.params import FinishReason, TokenDelta, TokenLogprob
from minimill.engine.sequence import RequestStatus, Sequence
from minimill.models.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestText:
    """The not-yet-emitted text of one request's outputs."""

    __slots__ = ("_detok", "_hold", "_pending", "_stops", "handed_out", "num_emitted_tokens")

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...],
                 resume_token_ids: list[int], resume_text: str | None = None) -> None:
        self._detok: IncrementalDetokenizer = tokenizer.detokenizer()
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        decoded = self._detok.prime(resume_token_ids)
        if resume_text is None:
            resume_text = decoded  # nothing was held back: all of it counts as handed out
        # Decoded but not handed out yet. If the handed-out text is not a prefix of the
        # decoding (a text-only checkpoint re-tokenized), what was handed out stands.
        self._pending = decoded[len(resume_text):] if decoded.startswith(resume_text) else ""
        self.handed_out = resume_text
        self.num_emitted_tokens = len(resume_token_ids)

    def add(self, new_token_ids: list[int]) -> bool:
        """Decode new tokens; True when a stop string appeared (text is cut before it)."""
        before = len(self._pending)
        self._pending += self._detok.add(new_token_ids)
        if not self._stops:
            return False
        # Handed-out text never holds the start of a stop string, so a new match lies in the
        # pending text, starting at most `hold` characters before the new ones.
        start = max(0, before - self._hold)
        found = [i for i in (self._pending.find(s, start) for s in self._stops) if i >= 0]
        if found:
            self._pending = self._pending[:min(found)]
            return True
        return False

    def finish(self, stopped_by_string: bool) -> None:
        if not stopped_by_string:
            self._pending += self._detok.flush()

    def take_delta(self, finished: bool) -> str:
        """New text since the last call, holding back a possible stop-string prefix."""
        keep = 0 if finished else min(self._hold, len(self._pending))
        cut = len(self._pending) - keep
        delta, self._pending = self._pending[:cut], self._pending[cut:]
        return delta


class OutputProcessor:
    """Turns sequences that got tokens into TokenDeltas; owns every running request's text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.texts: dict[str, RequestText] = {}

    def add_request(self, seq: Sequence, resume_text: str | None = None) -> str:
        """Track a request's text; returns the text counted as handed out for its resumed
        tokens (`resume_text`, or their decoding when not given)."""
        state = RequestText(self.tokenizer, seq.params.stop,
                            seq.token_ids[seq.num_prompt_tokens:], resume_text)
        self.texts[seq.request_id] = state
        return state.handed_out

    def process(self, seq: Sequence) -> bool:
        """Decode the sequence's newest tokens; True when a stop string ends it."""
        state = self.texts[seq.request_id]
        new_ids = seq.token_ids[seq.num_prompt_tokens + state.num_emitted_tokens:]
        state.num_emitted_tokens += len(new_ids)
        if seq.status == RequestStatus.FINISHED_STOPPED and new_ids and (
                new_ids[-1] in seq.eos_token_ids or new_ids[-1] in seq.params.stop_token_ids):
            # Stopped by a token (eos or a stop id): it adds no text, as in vLLM. (A request
            # whose grammar completed stops after a token that is part of its text.)
            return state.add(new_ids[:-1])
        return state.add(new_ids)

    def delta(self, seq: Sequence, new_token_ids: list[int], finish_reason: FinishReason | None,
              logprobs: list[TokenLogprob] | None, stopped_by_string: bool = False) -> TokenDelta:
        state = self.texts[seq.request_id]
        if finish_reason is not None:
            state.finish(stopped_by_string)
        text = state.take_delta(finish_reason is not None)
        return TokenDelta(seq.request_id, new_token_ids, text, finish_reason, logprobs,
                          seq.num_prompt_tokens, seq.seed, seq.num_cached_prompt_tokens,
                          seq.embedding)

    def remove(self, request_id: str) -> None:
        self.texts.pop(request_id, None)
