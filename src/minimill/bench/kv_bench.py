"""`minimill bench kv`: what each KV cache dtype costs and buys, measured in one run.

For the model's own dtype (the reference) and every compressed one: bytes per token of KV;
perplexity of the model on a public-domain text (the King James Version's Genesis and Exodus,
shipped with minimill) read through the cache in chunks of 256 tokens, as an agent's turns
would come: every token attends to the earlier chunks through the compressed cache (an int4
cache reads a step's own tokens at full precision, so there a chunk's own tokens are exact;
int8 reads them back from the cache too); greedy agreement with the reference over prompts
from the same text; and, at one fixed KV memory budget, how many sequences fit at once and
the output tokens/s a workload reaches. Beside them, what the budget holds by the engine's
arithmetic (kv_capacity.py); with `shape` (a named shape, models/shapes.py), only that: no
weights are loaded, so a model too big for this machine can be sized.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minimill.bench.stages import stage

TEXT = Path(__file__).parent / "data" / "kjv-genesis-exodus.txt"
TARGETS: dict[str, dict[str, float]] = {
    "int8": {"bytes_ratio": 1.9, "perplexity_increase": 0.005},
    # int4 also targets serving: at the budget, 3x the sequences and more tok/s than bf16.
    "int4": {"bytes_ratio": 3.5, "perplexity_increase": 0.03, "concurrent_ratio": 3.0,
             "tok_s_ratio": 1.0},
}


@dataclass(frozen=True, slots=True)
class KvBenchOptions:
    json_out: bool = False
    model: str = "smollm2-135m"
    dtype: str = "auto"
    kv_dtypes: tuple[str, ...] = ("int8", "int4")
    perplexity_tokens: int = 16384
    window_tokens: int = 2048  # each window is one sequence, read in chunks through the cache
    chunk_tokens: int = 256
    prompts: int = 64
    new_tokens: int = 128
    budget_mb: float = 48.0
    workload_requests: int = 128
    shape: str | None = None  # a named shape: the capacity arithmetic only
    context_tokens: int = 4096  # a sequence's tokens, for the capacity arithmetic


def run_kv_bench(options: KvBenchOptions) -> None:
    from rich.console import Console

    from minimill.engine.params import EngineError
    from minimill.models.types import ModelError

    err = Console(stderr=True)
    try:
        report = _bench(options, err)
    except (ModelError, EngineError, OSError, ValueError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise SystemExit(1) from exc
    if options.json_out:
        print(json.dumps(report))
        return
    for key, value in report.items():
        print(f"{key:>24}: {value}")


def _shape_capacity(options: KvBenchOptions) -> dict[str, Any]:
    from minimill.bench.kv_capacity import capacity
    from minimill.engine.config import EngineConfig
    from minimill.models.shapes import NAMED_SHAPES

    if options.shape not in NAMED_SHAPES:
        raise ValueError(f"unknown shape {options.shape!r}; known: {', '.join(NAMED_SHAPES)}")
    mc = NAMED_SHAPES[options.shape]
    dtype = EngineConfig(dtype=options.dtype).dtype
    return {"shape": options.shape, "architecture": mc.architecture, "dtype": dtype,
            "layers": mc.num_hidden_layers,
            **capacity(mc, dtype, options.kv_dtypes, int(options.budget_mb * (1 << 20)),
                       options.context_tokens)}


def _bench(options: KvBenchOptions, err: Any) -> dict[str, Any]:
    from minimill.bench.kv_capacity import capacity
    from minimill.engine.hardware import cpu_report
    from minimill.engine.llm import LLM
    from minimill.engine.loading import load_with_config

    if options.shape is not None:
        return _shape_capacity(options)
    loaded, config = load_with_config(options.model, {"dtype": options.dtype}, auto_pull=True)
    sized = capacity(loaded.config, config.dtype, options.kv_dtypes,
                     int(options.budget_mb * (1 << 20)), options.context_tokens)
    # What this model cannot cache (int4 for MLA) is reported, not run.
    kv_dtypes = tuple(k for k in options.kv_dtypes if sized["kv"][k].get("supported", True))
    text_ids = loaded.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    ppl_ids = text_ids[:options.perplexity_tokens]
    stride = max(1, (len(text_ids) - 96) // options.prompts)
    prompts = [text_ids[i * stride:i * stride + 64] for i in range(options.prompts)]
    reference = config.dtype
    results: dict[str, dict[str, Any]] = {}
    greedy: dict[str, list[list[int]]] = {}
    for kv_dtype in (reference, *kv_dtypes):
        with stage(err, f"KV {kv_dtype}: perplexity and greedy runs ..."):
            llm = LLM(loaded, dtype=config.dtype, kv_dtype=kv_dtype, num_kv_blocks=2048,
                      max_model_len=4096)
            row: dict[str, Any] = {
                "bytes_per_token": llm.config.kv_bytes_per_token(loaded.config),
                "perplexity": round(_perplexity(llm, ppl_ids, options.window_tokens,
                                                options.chunk_tokens), 4),
            }
            greedy[kv_dtype] = _greedy(llm, prompts, options.new_tokens)
            del llm
        with stage(err, f"KV {kv_dtype}: throughput at {options.budget_mb} MB ..."):
            row.update(_at_budget(loaded, config.dtype, kv_dtype, options))
        results[kv_dtype] = row
    base = results[reference]
    for kv_dtype in kv_dtypes:
        row = results[kv_dtype]
        row["bytes_ratio"] = round(base["bytes_per_token"] / row["bytes_per_token"], 3)
        row["perplexity_increase"] = round(row["perplexity"] / base["perplexity"] - 1, 5)
        row["greedy_agreement"] = round(_agreement(greedy[kv_dtype], greedy[reference]), 4)
        row["greedy_identical"] = sum(a == b for a, b in zip(greedy[kv_dtype],
                                                              greedy[reference], strict=True))
        row["concurrent_ratio"] = round(row["max_concurrent_seqs"]
                                        / max(1, base["max_concurrent_seqs"]), 3)
        row["mean_concurrent_ratio"] = round(row["mean_concurrent_seqs"]
                                             / max(1, base["mean_concurrent_seqs"]), 3)
        row["tok_s_ratio"] = round(row["output_tok_s"] / base["output_tok_s"], 3)
        target = TARGETS.get(kv_dtype)
        if target:
            row["targets"] = target
            row["meets_targets"] = (
                row["bytes_ratio"] >= target["bytes_ratio"]
                and row["perplexity_increase"] <= target["perplexity_increase"]
                and row["concurrent_ratio"] >= target.get("concurrent_ratio", 0.0)
                and row["tok_s_ratio"] >= target.get("tok_s_ratio", 0.0))
    return {"model": options.model, "dtype": config.dtype, "reference_kv": reference,
            "cpu": cpu_report(),
            "text": TEXT.name, "perplexity_tokens": len(ppl_ids),
            "prompts": len(prompts), "new_tokens": options.new_tokens,
            "budget_mb": options.budget_mb, "kv": results, "capacity": sized}


def _perplexity(llm: Any, ids: list[int], window: int, chunk: int) -> float:
    """exp(mean negative log-likelihood) of `ids`, in windows (one sequence each) fed in
    chunks through the engine's cache: each chunk attends to the earlier ones as stored
    (compressed) in the KV pool."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        window_nll, window_count = _window_nll(llm, ids[start:start + window + 1], chunk)
        nll += window_nll
        count += window_count
    return math.exp(nll / count)


def _window_nll(llm: Any, ids: list[int], chunk: int) -> tuple[float, int]:
    from minimill.engine.params import SamplingParams
    from minimill.engine.sequence import Sequence

    core = llm.engine
    runner, blocks = core.runner, core.scheduler.block_manager
    seq = Sequence("perplexity", ids, SamplingParams(), 0, frozenset())
    nll, count = 0.0, 0
    try:
        with torch.inference_mode():
            for start in range(0, len(ids) - 1, chunk):
                new = ids[start:min(start + chunk, len(ids) - 1)]
                if not blocks.allocate_slots(seq, len(new)):
                    raise ValueError("the KV pool is too small for a perplexity window")
                end = start + len(new)
                meta = runner.metadata([len(new)], [end], [seq.block_table],
                                       [seq.stage_units], [seq.window_table])
                logits = runner.model.forward(
                    torch.tensor(new, device=runner.device),
                    torch.arange(start, end, device=runner.device), meta, runner.kv_cache,
                    torch.arange(len(new), device=runner.device))
                seq.num_computed_tokens = end
                if blocks.window is not None:  # window blocks the window passed
                    blocks.window.release_passed(seq)
                targets = torch.tensor(ids[start + 1:end + 1], device=runner.device)
                logp = torch.log_softmax(logits.float(), dim=-1)
                nll -= float(logp.gather(1, targets[:, None]).sum())
                count += len(targets)
    finally:
        blocks.free(seq)
    return nll, count


def _greedy(llm: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from minimill.engine.params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [o.output_token_ids for o in llm.generate(prompts, params)]


def _agreement(runs: list[list[int]], reference: list[list[int]]) -> float:
    """Mean share of each run's tokens before it first differs from the reference's."""
    shares = []
    for a, b in zip(runs, reference, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        shares.append(same / len(b))
    return sum(shares) / len(shares)


def _at_budget(loaded: Any, dtype: str, kv_dtype: str, options: KvBenchOptions
               ) -> dict[str, Any]:
    """The workload's prompts (the text's, 64 tokens) x new_tokens at a fixed KV budget:
    sequences running at once (at most, and on average over steps) and output tokens/s."""
    from minimill.engine.llm import LLM
    from minimill.engine.params import SamplingParams

    llm = LLM(loaded, dtype=dtype, kv_dtype=kv_dtype, max_num_seqs=1024,
              kv_cache_memory_bytes=int(options.budget_mb * (1 << 20)))
    tok = loaded.tokenizer
    ids = tok.encode(TEXT.read_text()[:200_000], add_special_tokens=False)
    stride = max(1, (len(ids) - 96) // options.workload_requests)
    prompts = [ids[i * stride:i * stride + 64] for i in range(options.workload_requests)]
    params = SamplingParams(max_tokens=options.new_tokens, temperature=0.0, ignore_eos=True)
    scheduler = llm.engine.scheduler
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    scheduler.max_num_running = scheduler.running_seq_steps = scheduler.num_steps = 0
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.output_token_ids) for o in outs)
    peak = scheduler.max_num_running
    return {"kv_blocks": llm.config.num_kv_blocks,
            "block_bytes": llm.config.kv_block_bytes(loaded.config),
            "stage_unit_bytes": llm.config.kv_stage_unit_bytes(loaded.config),
            "max_concurrent_seqs": peak,
            # The peak counts sequences just admitted; the mean over steps is what ran on.
            "mean_concurrent_seqs": round(scheduler.running_seq_steps
                                          / max(1, scheduler.num_steps), 1),
            "preemptions": scheduler.num_preemptions,
            "output_tok_s": round(tokens / seconds, 2)}
