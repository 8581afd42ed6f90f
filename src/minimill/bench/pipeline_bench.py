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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from minimill.bench.stages import stage

if TYPE_CHECKING:
    from minimill.engine.llm import LLM

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
    from minimill.bench.engine_bench import read_workload
    from minimill.engine.hardware import cpu_report
    from minimill.engine.llm import LLM
    from minimill.engine.loading import load_with_config

    items = read_workload(options.workload, options.limit)
    loaded, config = load_with_config(options.model, {"dtype": options.dtype}, auto_pull=True)
    single = LLM(loaded, dtype=config.dtype, num_threads=options.stages)
    pipeline = LLM(loaded, dtype=config.dtype, num_threads=1,
                   pipeline_stages=options.stages)
    try:
        runner: Any = pipeline.engine.runner

        def with_stage_stats(run: Callable[[], float]) -> tuple[float, Any]:
            runner.stage_stats(reset=True)
            tok_s = run()
            return tok_s, runner.stage_stats()

        rounds = alternate_rounds(single, pipeline, options.stages, items, options.rounds,
                                  with_stage_stats)
        plan = runner.plan
    finally:
        pipeline.close()
        single.close()
    ratios = rounds.ratios
    ratio = statistics.median(ratios)
    return {
        "model": options.model, "dtype": config.dtype, "cpu": cpu_report(),
        "requests": len(items), "output_tokens": sum(item.max_tokens for item in items),
        "stages": options.stages,
        "stage_layers": [[r.start, r.stop] for r in plan.layers],
        "stage_estimated_cost_imbalance": round(plan.imbalance(), 3),
        "single_engine_cores": options.stages,
        "single_tok_s": round(statistics.median(rounds.single_tok_s), 1),
        "pipeline_tok_s": round(statistics.median(rounds.split_tok_s), 1),
        "ratio": round(ratio, 3), "ratio_target": TARGET_RATIO,
        "rounds": [{"single_tok_s": round(s, 1), "pipeline_tok_s": round(p, 1),
                    "ratio": round(r, 3),
                    "stages": [{k: round(v, 2) if isinstance(v, float) else v
                                for k, v in stage.items()} for stage in stages]}
                   for s, p, r, stages in zip(rounds.single_tok_s, rounds.split_tok_s,
                                              ratios, rounds.split_notes, strict=True)],
        "meets_target": ratio >= TARGET_RATIO,
    }


@dataclass(slots=True)
class Rounds:
    """Each round's output tokens/s of the single engine and of the split one (stages or
    ranks), and what the split run's measurement noted beside its rate."""

    single_tok_s: list[float]
    split_tok_s: list[float]
    split_notes: list[Any]

    @property
    def ratios(self) -> list[float]:
        return [p / s for p, s in zip(self.split_tok_s, self.single_tok_s, strict=True)]


def alternate_rounds(single: LLM, split: LLM, cores: int, items: list[Any], rounds: int,
                     measure_split: Callable[[Callable[[], float]], tuple[float, Any]]
                     ) -> Rounds:
    """The workload's items, greedy and never cut short by an end of text (the same tokens on
    both sides), through `single` (`cores` threads) and `split` (one thread in this process),
    after a warm-up of each, `rounds` times, alternating which goes first. `measure_split`
    runs the split engine's timed run it is given and returns (its rate, a note)."""
    import torch

    from minimill.engine.params import SamplingParams
    from minimill.models.prompt import render_chat_prompt

    prompts = [render_chat_prompt(single.tokenizer, item.messages) for item in items]
    params = [SamplingParams(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True)
              for item in items]
    for llm in (single, split):  # warm-up: kernels, first touches of the pools
        llm.generate(prompts[:4], SamplingParams(max_tokens=4))
    out = Rounds([], [], [])
    err = Console(stderr=True)

    def timed(llm: LLM) -> float:
        # The thread count is the process's: each engine gets its own back before it runs
        # (the single engine its cores, the split one's first process one), pinned as its
        # start pinned it.
        torch.set_num_threads(cores if llm is single else 1)
        llm.engine.runner.kernels.pin_threads()
        llm.reset_prefix_cache()
        which = f"{cores} cores, one engine" if llm is single else "split"
        round_no = min(len(out.single_tok_s), len(out.split_tok_s)) + 1
        with stage(err, f"round {round_no} of {max(1, rounds)}: {which}, "
                        f"{len(prompts)} requests ..."):
            started = time.perf_counter()
            outs = llm.generate(prompts, params)
            seconds = time.perf_counter() - started
        return sum(len(o.output_token_ids) for o in outs) / seconds

    def run_split() -> None:
        tok_s, note = measure_split(lambda: timed(split))
        out.split_tok_s.append(tok_s)
        out.split_notes.append(note)

    try:
        for round_no in range(max(1, rounds)):
            if round_no % 2 == 0:
                out.single_tok_s.append(timed(single))
                run_split()
            else:
                run_split()
                out.single_tok_s.append(timed(single))
    finally:
        torch.set_num_threads(cores)
    return out
