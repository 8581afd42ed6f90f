"""`minimill bench engine`: offline throughput of the builtin engine on a Batch-API workload,
against the speed of light (matmul FLOP/s of this machine, measured in the same run) and
against HF transformers `generate` on the same weights, prompts and dtype."""

from __future__ import annotations

import json
import resource
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# The targets the engine is held to.
TARGET_SOL_FRACTION = 0.6
TARGET_HF_SPEEDUP = 2.0
# HF generate runs in left-padded batches of its best width on CPU. Measured on 2 cores
# (bf16, this workload): 64 -> ~247 tok/s, 128 -> ~260 tok/s, 256 -> ~35 tok/s (its
# DynamicCache re-allocates tensors over 32 MB every step, and each comes with fresh pages).
HF_BATCH_SIZE = 128
MATMUL_SECONDS = 3.0


@dataclass(slots=True)
class WorkItem:
    custom_id: str
    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float


def read_workload(path: Path, limit: int | None) -> list[WorkItem]:
    """Lines of an OpenAI batch input file (custom_id, body with messages, max_tokens)."""
    from minimill.engine.params import InvalidRequestError

    items: list[WorkItem] = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                body = row["body"]
                items.append(WorkItem(str(row["custom_id"]), list(body["messages"]),
                                      int(body.get("max_tokens") or 16),
                                      float(body.get("temperature") or 0.0)))
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidRequestError(
                    f"{path}:{number}: not a batch request line: {exc}") from exc
            if limit is not None and len(items) >= limit:
                break
    if not items:
        raise InvalidRequestError(f"{path}: no requests")
    return items


def run_engine_bench(workload: Path, *, json_out: bool, model: str, dtype: str,
                     limit: int | None, skip_hf: bool) -> None:
    """Run the workload through `LLM.generate` (ignore_eos, each request's max_tokens) and print
    one JSON object (or a short table) with the figures and the ones they are compared with."""
    from rich.console import Console

    from minimill.engine.params import EngineError
    from minimill.models.types import ModelError

    err = Console(stderr=True)
    try:
        report = _bench(workload, model=model, dtype=dtype, limit=limit, skip_hf=skip_hf,
                        quiet=json_out, err=err)
    except (ModelError, EngineError, OSError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise SystemExit(1) from exc
    if json_out:
        print(json.dumps(report))
        return
    for key, value in report.items():
        print(f"{key:>28}: {value}")


def _bench(workload: Path, *, model: str, dtype: str, limit: int | None, skip_hf: bool,
           quiet: bool, err: Any) -> dict[str, Any]:
    from minimill.bench.hf_baseline import flops_per_token, measure_matmul_flops
    from minimill.engine.llm import LLM, load
    from minimill.engine.params import SamplingParams

    items = read_workload(workload, limit)
    with err.status(f"loading {model} ...") if not quiet else nullcontext():
        loaded, config = load(model, {"dtype": dtype}, auto_pull=True)
        llm = LLM(loaded, dtype=dtype)
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(i.messages, add_generation_prompt=True),
                          add_special_tokens=False) for i in items]
    params = [SamplingParams(max_tokens=i.max_tokens, temperature=i.temperature,
                             ignore_eos=True, seed=n) for n, i in enumerate(items)]
    llm.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not quiet)
    seconds = time.perf_counter() - start
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(o.output_token_ids) for o in outputs)
    output_tok_s = output_tokens / seconds

    matmul_flops = measure_matmul_flops(config.torch_dtype, seconds=MATMUL_SECONDS)
    model_flops = flops_per_token(loaded.config)
    sol_tok_s = matmul_flops / model_flops * output_tokens / (prompt_tokens + output_tokens)
    report: dict[str, Any] = {
        "model": model, "dtype": dtype, "device": config.device,
        "threads": torch.get_num_threads(), "requests": len(items),
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "seconds": round(seconds, 3), "output_tok_s": round(output_tok_s, 2),
        "matmul_gflop_s": round(matmul_flops / 1e9, 2),
        "model_gflop_per_token": round(model_flops / 1e9, 4),
        "sol_tok_s": round(sol_tok_s, 2),
        "sol_fraction": round(output_tok_s / sol_tok_s, 3),
        "sol_fraction_target": TARGET_SOL_FRACTION,
        "peak_rss_mb": round(peak_rss_mb, 1),
    }
    del llm
    if not skip_hf:
        hf = _hf_baseline(loaded, config.torch_dtype, prompts, items, quiet, err)
        report.update({
            "hf_output_tok_s": round(hf, 2), "hf_batch_size": HF_BATCH_SIZE,
            "hf_speedup": round(output_tok_s / hf, 3) if hf > 0 else None,
            # HF's own share of the speed of light: the speedup over HF can be at most
            # 1 / hf_sol_fraction.
            "hf_sol_fraction": round(hf / sol_tok_s, 3),
            "hf_speedup_target": TARGET_HF_SPEEDUP,
        })
    report["meets_targets"] = (report["sol_fraction"] >= TARGET_SOL_FRACTION
                               and (skip_hf or (report["hf_speedup"] or 0) >= TARGET_HF_SPEEDUP))
    return report


def _hf_baseline(loaded: Any, dtype: torch.dtype, prompts: list[list[int]],
                 items: list[WorkItem], quiet: bool, err: Any) -> float:
    """HF generate's output tokens/s over the same prompts (grouped by max_tokens)."""
    from minimill.bench.hf_baseline import build_hf_model, hf_generate_throughput

    model = build_hf_model(loaded, dtype)
    tokenizer = loaded.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
        tokenizer.eos_token_id or 0)
    groups: dict[int, list[list[int]]] = {}
    for prompt, item in zip(prompts, items, strict=True):
        groups.setdefault(item.max_tokens, []).append(prompt)
    hf_generate_throughput(model, prompts[:1], 2, 1, pad)  # warm-up, as for the engine
    total_tokens, total_seconds = 0, 0.0
    with err.status("HF transformers baseline ...") if not quiet else nullcontext():
        for max_tokens, group in groups.items():
            result = hf_generate_throughput(model, group, max_tokens, HF_BATCH_SIZE, pad)
            total_tokens += int(result["output_tokens"])
            total_seconds += float(result["seconds"])
    return total_tokens / total_seconds if total_seconds > 0 else 0.0


if __name__ == "__main__":  # pragma: no cover - manual runs
    run_engine_bench(Path(sys.argv[1]), json_out=True, model="smollm2-135m", dtype="bfloat16",
                     limit=None, skip_hf=False)
