"""Request state inside the engine: tokens so far, how many have KV computed, status, blocks."""

from __future__ import annotations

import enum
import hashlib
from typing import TYPE_CHECKING

from minimill.engine.params import FinishReason, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from minimill.engine.guided import Guide


class RequestStatus(enum.IntEnum):
    """Ordered: every status after PREEMPTED is finished."""

    WAITING = 0  # admitted, no KV yet
    RUNNING = 1  # holds KV blocks, scheduled every step
    PREEMPTED = 2  # lost its KV to a more senior request; waits to be recomputed
    FINISHED_STOPPED = 3  # eos, a stop token id or a stop string
    FINISHED_LENGTH = 4  # max_tokens reached or the context is full
    FINISHED_ABORTED = 5  # cancelled by the caller

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


def prefix_root(cache_salt: str | None) -> int | None:
    """What a sequence's first block hash chains from: its salt's hash (None: no salt), so
    that the same tokens under two salts hash apart and never share cached blocks."""
    if cache_salt is None:
        return None
    return int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=16,
                                          person=b"minimill-salt").digest(), "little")


class Sequence:
    """One request: `num_computed_tokens` of `num_tokens` have their KV in the cache."""

    __slots__ = (
        "block_table", "embedding", "eos_token_ids", "guide", "lane", "logprobs",
        "num_cached_prompt_tokens", "num_cached_tokens", "num_computed_tokens",
        "num_prompt_tokens", "output_counts", "params", "prefix_root", "rank", "request_id",
        "seed", "stage_units", "status", "token_ids", "window_table",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 seed: int, eos_token_ids: frozenset[int],
                 resume_token_ids: list[int] | None = None) -> None:
        self.request_id = request_id
        # Prompt then outputs; a resumed request's checkpointed outputs count as outputs.
        self.token_ids: list[int] = [*prompt_token_ids, *(resume_token_ids or ())]
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # of the computed ones, how many came from the prefix cache
        # Prompt tokens found cached when first admitted: what the client is told and billed.
        self.num_cached_prompt_tokens = 0
        self.block_table: list[int] = []
        # int4 cache: the staging units (slices of pool blocks) holding its open block, in token
        # order, one per INT4_STAGE_UNIT tokens (kv_int4.py).
        self.stage_units: list[int] = []
        # Its sliding-window layers' blocks, one pool block per sliding group for each
        # block_size tokens, None once the window passed them (window_pool.py).
        self.window_table: list[tuple[int, ...] | None] = []
        # The engine lane (one per core, core.py) that runs it while lanes are in use; -1: none.
        self.lane = -1
        # The expert-parallel rank that runs it and holds its KV (expert_dealer.py); 0 else.
        self.rank = 0
        self.params = params
        # What its first KV block's hash chains from (block_manager.chain_hash).
        self.prefix_root = prefix_root(params.cache_salt)
        # The grammar state of a guided request (params.guided), advanced past every output.
        self.guide: Guide | None = None
        # An embedding request's pooled vector, once its prompt is computed (params.embed).
        self.embedding: list[float] | None = None
        self.seed = seed
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.status = RequestStatus.WAITING
        self.logprobs: list[TokenLogprob] = []  # of the outputs sampled here (not resumed ones)
        # How often each token occurs among the outputs (resumed ones included): what the
        # penalties read. Kept only when the request uses them.
        self.output_counts: dict[int, int] | None = None
        if params.uses_penalties:
            self.output_counts = {}
            for token in resume_token_ids or ():
                self.output_counts[token] = self.output_counts.get(token, 0) + 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.output_counts is not None:
            self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.name}, "
                f"{self.num_computed_tokens}/{self.num_tokens} computed)")
