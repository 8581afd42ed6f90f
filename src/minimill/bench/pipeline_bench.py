"""`minimill bench pipeline`: the same workload through a pipeline of stages, each on one
core, and through one engine with as many cores, in the same run.

Rounds alternate which engine goes first (whatever favours the first or the second run of a
pair, a warm cache or the VM's drift, favours neither side). Each pipeline run reports, per
stage and per step, the time spent computing, waiting for work (the bubble) and
communicating (stage_stats, pipeline_link.py).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# What issue 34 asks of two one-core stages against one two-core engine.
TARGET_RATIO = 0.85


@dataclass(frozen=True, slots=True)
class PipelineBenchOptions:
    workload: Path
    model: str = "smollm2-135m"
    dtype: str = "auto"
    stages: int = 2
    limit: int | None = 128
    rounds: int = 2


def run_pipeline_bench(options: PipelineBenchOptions) -> dict[str, Any]:
    """Run the bench; returns the report (the CLI prints it)."""
    import torch

    from minimill.bench.engine_bench import read_workload
    from minimill.engine.hardware import cpu_report
    from minimill.engine.llm import LLM
    from minimill.engine.loading import load_with_config
    from minimill.engine.params import SamplingParams
    from minimill.models.prompt import render_chat_prompt

    items = read_workload(options.workload, options.limit)
    loaded, config = load_with_config(options.model, {"dtype": options.dtype}, auto_pull=True)
    single = LLM(loaded, dtype=config.dtype, num_threads=options.stages)
    pipeline = LLM(loaded, dtype=config.dtype, num_threads=1,
                   pipeline_stages=options.stages)
    try:
        prompts = [render_chat_prompt(single.tokenizer, item.messages) for item in items]
        # The same tokens on both sides: greedy, and never cut short by an end of text.
        params = [SamplingParams(max_tokens=item.max_tokens, temperature=0.0,
                                 ignore_eos=True) for item in items]
        for llm in (single, pipeline):  # warm-up: kernels, first touches of the pools
            llm.generate(prompts[:4], SamplingParams(max_tokens=4))
        runner: Any = pipeline.engine.runner
        single_tok_s: list[float] = []
        pipeline_tok_s: list[float] = []
        stage_rounds: list[list[dict[str, float | int]]] = []

        def timed(llm: LLM) -> float:
            # The thread count is the process's: each engine gets its own back before it
            # runs (the single engine its cores, stage 0 one), pinned as its start pinned it.
            torch.set_num_threads(options.stages if llm is single else 1)
            llm.engine.runner.kernels.pin_threads()
            llm.reset_prefix_cache()
            started = time.perf_counter()
            outs = llm.generate(prompts, params)
            return sum(len(o.output_token_ids) for o in outs) / (time.perf_counter() - started)

        def run_pipeline() -> None:
            runner.stage_stats(reset=True)
            pipeline_tok_s.append(timed(pipeline))
            stage_rounds.append(runner.stage_stats())

        for round_no in range(max(1, options.rounds)):
            if round_no % 2 == 0:
                single_tok_s.append(timed(single))
                run_pipeline()
            else:
                run_pipeline()
                single_tok_s.append(timed(single))
        plan = runner.plan
    finally:
        pipeline.close()
        single.close()
    ratios = [p / s for p, s in zip(pipeline_tok_s, single_tok_s, strict=True)]
    ratio = statistics.median(ratios)
    torch.set_num_threads(options.stages)
    return {
        "model": options.model, "dtype": config.dtype, "cpu": cpu_report(),
        "requests": len(items), "output_tokens": sum(p.max_tokens for p in params),
        "stages": options.stages,
        "stage_layers": [[r.start, r.stop] for r in plan.layers],
        "stage_estimated_cost_imbalance": round(plan.imbalance(), 3),
        "single_engine_cores": options.stages,
        "single_tok_s": round(statistics.median(single_tok_s), 1),
        "pipeline_tok_s": round(statistics.median(pipeline_tok_s), 1),
        "ratio": round(ratio, 3), "ratio_target": TARGET_RATIO,
        "rounds": [{"single_tok_s": round(s, 1), "pipeline_tok_s": round(p, 1),
                    "ratio": round(r, 3),
                    "stages": [{k: round(v, 2) if isinstance(v, float) else v
                                for k, v in stage.items()} for stage in stages]}
                   for s, p, r, stages in zip(single_tok_s, pipeline_tok_s, ratios,
                                              stage_rounds, strict=True)],
        "meets_target": ratio >= TARGET_RATIO,
    }
