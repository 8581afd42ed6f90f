"""`minimill bench pipeline --expert-parallel N`: the same workload through N expert-parallel
ranks of one core each and through one engine of N cores, in the same run, on a mixture of
experts' shape with random weights (models/shapes.py; both draw the same weights from one
seed, each rank only its share of the experts).

Rounds alternate which engine goes first, as `bench pipeline`'s do
(pipeline_bench.alternate_rounds).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minimill.bench.pipeline_bench import alternate_rounds

KV_POOL_BYTES = 512 << 20


@dataclass(frozen=True, slots=True)
class ExpertBenchOptions:
    workload: Path
    shape: str = "qwen3-moe-2.9b-a0.7b"
    layers: int | None = 8  # the shape's first layers only (None: all of them)
    dtype: str = "auto"
    ranks: int = 2
    limit: int | None = 128
    rounds: int = 2


def run_expert_bench(options: ExpertBenchOptions) -> dict[str, Any]:
    """Run the bench; returns the report (the CLI prints it)."""
    import torch

    from minimill.bench.engine_bench import read_workload
    from minimill.engine.config import EngineConfig
    from minimill.engine.expert_share import ExpertShare
    from minimill.engine.hardware import cpu_report
    from minimill.engine.llm import LLM
    from minimill.models.loader import load_model
    from minimill.models.shapes import NAMED_SHAPES, random_model

    if options.shape not in NAMED_SHAPES:
        raise ValueError(f"unknown shape {options.shape!r}; known: {', '.join(NAMED_SHAPES)}")
    shape = NAMED_SHAPES[options.shape]
    if not shape.num_experts:
        raise ValueError(f"shape {options.shape!r} is a dense model: expert parallelism needs "
                         "a mixture of experts")
    if options.layers is not None:
        shape = dataclasses.replace(shape, num_hidden_layers=options.layers)
    items = read_workload(options.workload, options.limit)
    dtype = EngineConfig(dtype=options.dtype).dtype
    tokenizer = load_model("smollm2-135m", torch.float32, auto_pull=True).tokenizer
    name = f"{options.shape} (random weights)"
    args = (name, shape, EngineConfig(dtype=dtype).torch_dtype, tokenizer)
    # The same pool each (every rank holds one as large as rank 0's), enough for the
    # workload's requests at once: the engines, not the pools, are what is compared.
    kv = {"kv_cache_memory_bytes": KV_POOL_BYTES}
    single = LLM(random_model(*args), dtype=dtype, num_threads=options.ranks, **kv)
    ranked = LLM(random_model(*args, keep=ExpertShare(0, options.ranks, shape.num_experts)),
                 dtype=dtype, num_threads=1, expert_parallel=options.ranks, **kv)
    try:
        runner: Any = ranked.engine.runner

        def with_seq_steps(run: Callable[[], float]) -> tuple[float, Any]:
            before = list(runner.seq_steps)
            tok_s = run()
            return tok_s, [a - b for a, b in zip(runner.seq_steps, before, strict=True)]

        rounds = alternate_rounds(single, ranked, options.ranks, items, options.rounds,
                                  with_seq_steps)
        held = [(r.weight_bytes, r.kv_bytes) for r in runner.ranks]
    finally:
        ranked.close()
        single.close()
    ratios = rounds.ratios
    gib = float(1 << 30)
    return {
        "shape": options.shape, "layers": shape.num_hidden_layers,
        "experts": shape.num_experts, "experts_per_token": shape.num_experts_per_tok,
        "dtype": dtype, "cpu": cpu_report(), "requests": len(items),
        "output_tokens": sum(item.max_tokens for item in items), "ranks": options.ranks,
        "rank_weights_gib": [round(w / gib, 3) for w, _ in held],
        "rank_kv_gib": [round(k / gib, 3) for _, k in held],
        "single_engine_cores": options.ranks,
        "single_tok_s": round(statistics.median(rounds.single_tok_s), 1),
        "expert_parallel_tok_s": round(statistics.median(rounds.split_tok_s), 1),
        "ratio": round(statistics.median(ratios), 3),
        "rounds": [{"single_tok_s": round(s, 1), "expert_parallel_tok_s": round(p, 1),
                    "ratio": round(r, 3), "sequence_steps_per_rank": steps}
                   for s, p, r, steps in zip(rounds.single_tok_s, rounds.split_tok_s, ratios,
                                             rounds.split_notes, strict=True)],
    }
