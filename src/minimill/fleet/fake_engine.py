"""A fake engine for fleet tests and simulator agreement: `minimill worker --engine fake:RATE`.

A test double, not an engine: it loads no model and computes nothing. Each choice streams
`max_tokens` made-up tokens ("t<id>", the id a hash of the choice's seed and position, so a
resumed choice continues exactly as the uninterrupted one would), then finishes with
"length". It exists so that many sites can run as real worker processes on one small machine,
where a real model per site could not, e.g. to drive the live control plane with the same
scenario as `minimill sim` and compare where the work went.

Timing: `fake:RATE` declares the site's busy throughput, RATE output tokens/s with a full batch
(`capacity` requests). Every request streams at its share of a full batch, RATE / capacity
tokens/s, whatever else runs, so a request always takes max_tokens * capacity / RATE seconds
and a test's timing does not depend on how the work happened to arrive. The rate it reports to
the control plane is the declared one, from the first lease call on (a fake has nothing to
measure; the simulator also knows each site's rate from the start). Plain `fake` streams
every token at once and reports no rate.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import AsyncIterator, Callable

from minimill.fleet.choices import ChoiceJob, resumed_token_count
from minimill.fleet.engines import ChoiceUpdate, EngineStartError
from minimill.models.tool_calls import ToolFormat

PREFIX = "fake"
# Tokens a request without max_tokens gets: the fake's whole "context".
DEFAULT_MAX_TOKENS = 64
# Made-up token ids stay below this (the size of a small model's vocabulary).
VOCAB = 32_000


def parse_rate(engine: str) -> float | None:
    """The declared tokens/s of `fake` (None: instant) or `fake:RATE`."""
    if engine == PREFIX:
        return None
    _, _, text = engine.partition(":")
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not (math.isfinite(rate) and rate > 0):
        raise EngineStartError(f"--engine fake:RATE needs a number of tokens/s > 0, "
                               f"got {engine!r}")
    return rate


def fake_token_id(seed: int, position: int) -> int:
    """The token at `position` of a choice with `seed`: depends on nothing else."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % VOCAB


class FakeEngineAdapter:
    """Deterministic made-up tokens at a declared rate; see the module docstring."""

    def __init__(self, model: str, capacity: int, tokens_per_s: float | None) -> None:
        self._models = [model]
        self._capacity = capacity
        self._rate = tokens_per_s
        self._aborted: set[str] = set()

    @classmethod
    def start(cls, engine: str, *, model: str, capacity: int) -> FakeEngineAdapter:
        return cls(model, capacity, parse_rate(engine))

    @property
    def models(self) -> list[str]:
        return list(self._models)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def default_max_tokens(self) -> int:
        return DEFAULT_MAX_TOKENS

    @property
    def tool_format(self) -> ToolFormat | None:
        return None  # it sees text only: tools and response_format are refused (choices.py)

    @property
    def guides(self) -> bool:
        return False

    @property
    def embeds(self) -> bool:
        return False

    def _token_gap_s(self) -> float:
        """Seconds between two tokens of one request: its share of a full batch."""
        return 0.0 if self._rate is None else self._capacity / self._rate

    async def generate(self, job: ChoiceJob) -> AsyncIterator[ChoiceUpdate]:
        self._aborted.discard(job.engine_request_id)
        seed = job.params.seed or 0
        start, end = resumed_token_count(job), job.params.max_tokens
        gap = self._token_gap_s()
        # Paced against a start time, not token by token, so that sleep overshoot does not
        # slow a long request below its share.
        began = asyncio.get_running_loop().time()
        try:
            for position in range(start, end):
                if gap > 0:
                    due = began + (position - start + 1) * gap
                    await asyncio.sleep(max(0.0, due - asyncio.get_running_loop().time()))
                if job.engine_request_id in self._aborted:
                    return
                token_id = fake_token_id(seed, position)
                yield ChoiceUpdate(
                    new_token_ids=[token_id], new_text=f" t{token_id}", num_new_tokens=1,
                    logprobs=[{"token_id": token_id, "token": f" t{token_id}", "logprob": 0.0,
                               "top_logprobs": []}] if job.params.logprobs else None,
                    finish_reason="length" if position == end - 1 else None,
                    # One made-up prompt token: usage stays plausible without a tokenizer.
                    num_prompt_tokens=1 if position == start else 0)
            if start >= end:  # resumed with every token already made
                yield ChoiceUpdate(finish_reason="length", num_prompt_tokens=1)
        finally:
            self._aborted.discard(job.engine_request_id)

    def abort(self, engine_request_id: str) -> None:
        self._aborted.add(engine_request_id)

    def on_death(self, callback: Callable[[str], None]) -> None:
        """Never called: nothing of it can die apart from the worker."""

    def tokens_per_s(self) -> float | None:
        return self._rate

    async def close(self) -> None:
        return None
