"""Shared test prompts, and comparing two greedy runs the way vLLM's tests do.

Two correct float implementations may order their sums differently, so at a position where
the two best tokens are nearly tied, each may pick a different one. After such a split the
continuations differ and comparing further says nothing. A split is accepted only where each
run's token is among the other run's top-5 at that position, and comparison stops there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from minimill.engine.llm import LLM
from minimill.engine.params import SamplingParams
from minimill.engine.sequence import Sequence as EngineSequence

TOP_N = 5

# Prompts of different lengths and kinds; each continues for a while without an eos.
PROMPTS = [
    "The history of the Roman Empire began",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here is a list of ten fruits: apple, banana,",
    "In a quiet village at the foot of the mountains, there lived an old clockmaker who",
]

TopLogprobs = Sequence[Sequence[tuple[int, float]]]  # per position: [(token_id, logprob)...]


def assert_greedy_close(tokens_a: Sequence[int], top_a: TopLogprobs, tokens_b: Sequence[int],
                        top_b: TopLogprobs, why_near_tie: str) -> int:
    """Assert the runs agree up to a genuine near-tie; returns the number of equal tokens.

    `why_near_tie` says why the two runs' arithmetic differs at all (shown on failure).
    """
    n = min(len(tokens_a), len(tokens_b))
    for i in range(n):
        a, b = tokens_a[i], tokens_b[i]
        if a == b:
            continue
        ids_a = [t for t, _ in top_a[i][:TOP_N]]
        ids_b = [t for t, _ in top_b[i][:TOP_N]]
        assert a in ids_b and b in ids_a, (
            f"runs diverge at output position {i}: {a} vs {b}, and that is not a near-tie "
            f"(top-{TOP_N} {top_a[i][:TOP_N]} vs {top_b[i][:TOP_N]}); the runs may differ "
            f"only because {why_near_tie}")
        return i
    assert len(tokens_a) == len(tokens_b), (
        f"equal for {n} tokens but lengths differ: {len(tokens_a)} vs {len(tokens_b)}")
    return n


def engine_logits(llm: LLM, prompts: list[list[int]], chunk: int | None = None
                  ) -> list[torch.Tensor]:
    """Logits at every prompt position, all prompts in one batch (optionally in two chunks:
    the second attends to the first through the paged cache)."""
    core = llm.engine
    runner, bm = core.runner, core.scheduler.block_manager
    seqs = [EngineSequence(f"parity-{i}", p, SamplingParams(), 0, frozenset())
            for i, p in enumerate(prompts)]
    results: list[list[torch.Tensor]] = [[] for _ in seqs]
    bounds = [(0, chunk), (chunk, None)] if chunk else [(0, None)]
    try:
        for lo, hi in bounds:
            ids: list[int] = []
            pos: list[int] = []
            q_lens: list[int] = []
            seq_lens: list[int] = []
            for s in seqs:
                new = s.token_ids[lo:hi]
                assert bm.allocate_slots(s, len(new))
                ids += new
                pos += range(lo, lo + len(new))
                q_lens.append(len(new))
                seq_lens.append(lo + len(new))
            meta = runner.metadata(q_lens, seq_lens, [s.block_table for s in seqs],
                                   [s.stage_units for s in seqs],
                                   [s.window_table for s in seqs])
            with torch.inference_mode():
                logits = runner.model.forward(torch.tensor(ids), torch.tensor(pos), meta,
                                              runner.kv_cache, torch.arange(len(ids)))
            start = 0
            for i, q_len in enumerate(q_lens):
                results[i].append(logits[start:start + q_len])
                start += q_len
                seqs[i].num_computed_tokens += q_len
                if bm.window is not None:  # window blocks the window passed
                    bm.window.release_passed(seqs[i])
    finally:
        for s in seqs:
            bm.free(s)
    return [torch.cat(r) for r in results]


def assert_logits_match(llm: LLM, hf: Any, prompts: list[list[int]], label: str,
                        tolerance: float = 1e-4) -> None:
    """The engine's logits at every prompt position within `tolerance` (relative, per
    position) of the transformers model `hf`'s, with the prompts whole and in two chunks (the
    second attends to the first through the paged cache)."""
    with torch.inference_mode():
        refs = [hf(torch.tensor([p])).logits[0] for p in prompts]
    for chunk in (None, 20):
        for ours, ref in zip(engine_logits(llm, prompts, chunk), refs, strict=True):
            err = ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max()
            assert err < tolerance, f"{label} chunk {chunk}: relative error {err:.2e}"
