"""`minimill bench engine`: offline throughput of the builtin engine on a Batch-API workload,
against the speed of light of this machine for the same work (bench/sol.py), HF transformers
`generate` on the same weights and prompts at its best batch size, and optionally vLLM run
from its own environment (bench/peer.py) — every figure measured in the same run."""

from __future__ import annotations

import gc
import json
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from minimill.bench.stages import request_progress, stage
from minimill.bench.steal import StealMeter
from minimill.engine.memory import release_freed_memory

if TYPE_CHECKING:
    from minimill.bench.sol import SpeedOfLight
    from minimill.engine.model_runner import StepShape
    from minimill.engine.params import RequestOutput

# The targets the engine is held to (issue: the bus at the speed of light).
TARGET_SOL_FRACTION = 0.75
# Measurements of the yardstick after the first, while a fraction comes out above 1.
YARDSTICK_RETRIES = 2
# Measurements of the yardstick before its check (best of them at every shape).
YARDSTICK_FIRST_MEASUREMENTS = 2
TARGET_HF_SPEEDUP = 2.0
TARGET_PEER_SPEEDUP = 1.15
# HF generate batch widths tried on a sample of the workload; the best one runs it all.
HF_BATCH_SIZES = (32, 64, 128, 256)
HF_SWEEP_PROMPTS = 64
HF_SWEEP_TOKENS = 16


@dataclass(slots=True)
class WorkItem:
    custom_id: str
    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float


# vLLM's CPU build takes this much KV space unless told otherwise (VLLM_CPU_KVCACHE_SPACE).
KV_CACHE_GIB = 4


@dataclass(frozen=True, slots=True)
class EngineBenchOptions:
    workload: Path
    json_out: bool = False
    model: str = "smollm2-135m"
    dtype: str = "auto"
    limit: int | None = None
    skip_hf: bool = False
    shape: str | None = None
    config: Path | None = None
    random_weights: bool = False
    kernels: str = "auto"
    kv_dtype: str = "auto"
    kv_prefault: bool = True
    # The KV pool of both engines on a CPU, GiB: minimill's and vLLM's (VLLM_CPU_KVCACHE_SPACE,
    # whose default this is; whole GiB, as it takes them), so that neither runs fewer requests at
    # once for want of room.
    kv_cache_gib: int = KV_CACHE_GIB
    lanes: bool = True
    # Random-weights mixtures of experts: routers redrawn to spread tokens as trained ones do
    # (bench/routing.py); False keeps them as drawn.
    balanced_routers: bool = True
    peer: str | None = None
    peer_python: str | None = None
    # Timed runs of the workload; the headline is the median one (these VMs vary by 10% from
    # one run to the next: a neighbour's burst, the hypervisor's steal).
    rounds: int = 3


@dataclass(slots=True)
class _Round:
    """One timed run of the workload."""

    steps: list[StepShape]
    seconds: float
    steal_share: float | None  # None where the OS does not say
    output_tokens: int
    sol: SpeedOfLight | None = None  # set once the yardstick is measured

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def sol_tok_s(self) -> float:
        assert self.sol is not None, "the yardstick is not measured yet"
        return self.output_tokens / self.sol.seconds


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


def _output_tokens(out: RequestOutput) -> int:
    return len(out.output_token_ids)


def run_engine_bench(options: EngineBenchOptions) -> None:
    """Run the workload through `LLM.generate` (ignore_eos, each request's max_tokens) and print
    one JSON object (or a table) with the figures beside the ones they are compared with."""
    from rich.console import Console

    from minimill.bench.peer import PeerError
    from minimill.engine.params import EngineError
    from minimill.models.types import ModelError

    err = Console(stderr=True)
    try:
        report = _bench(options, err)
    except (ModelError, EngineError, PeerError, OSError, ValueError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise SystemExit(1) from exc
    if options.json_out:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>28}: {value}")
    if "peer_error" in report:  # minimill's figures are printed; the comparison failed
        err.print(f"[red]error:[/red] {report['peer_error']}")
        raise SystemExit(1)


def _load(options: EngineBenchOptions) -> tuple[Any, Any, str]:
    """(LoadedModel, EngineConfig, what was measured)."""
    from minimill.engine.config import EngineConfig
    from minimill.engine.loading import load_with_config
    from minimill.models.loader import load_model
    from minimill.models.shapes import NAMED_SHAPES, random_model, shape_from_hf_config

    overrides: dict[str, Any] = {"dtype": options.dtype, "kernels": options.kernels,
                                 "kv_dtype": options.kv_dtype, "lanes": options.lanes}
    if options.shape is None and options.config is None:
        if options.random_weights:
            raise ValueError("--random-weights needs --shape or --config")
        loaded, config = load_with_config(options.model, overrides, auto_pull=True)
        return loaded, config, options.model
    if not options.random_weights:
        raise ValueError("--shape and --config measure random weights: add --random-weights")
    if options.config is not None:
        shape, name = shape_from_hf_config(options.config), options.config.parent.name
    elif options.shape in NAMED_SHAPES:
        shape, name = NAMED_SHAPES[options.shape], options.shape
    else:
        raise ValueError(f"unknown shape {options.shape!r}; known: {', '.join(NAMED_SHAPES)}")
    probe = EngineConfig(**overrides)
    tokenizer = load_model("smollm2-135m", torch.float32, auto_pull=True).tokenizer
    loaded = random_model(f"{name} (random weights)", shape, probe.torch_dtype, tokenizer)
    return loaded, EngineConfig(**overrides, model=loaded.name, model_config=shape), name


def _balance_routers(options: EngineBenchOptions, loaded: Any, config: Any,
                     prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """A random-weights mixture of experts' routers, balanced on the workload's prompts
    (bench/routing.py); nothing for other models or --drawn-routers."""
    from minimill.bench.routing import balance_routers

    if not (options.random_weights and options.balanced_routers
            and loaded.config.num_experts):
        return {}
    return balance_routers(loaded, prompts, config.torch_dtype,
                           seed=int(loaded.extra.get("random_seed", 0)))


def _bench(options: EngineBenchOptions, err: Any) -> dict[str, Any]:
    from minimill.bench import breakdown
    from minimill.bench.peer import PeerError, check_peer
    from minimill.bench.sol import TARGET_NOTE, best_of, measure, speed_of_light
    from minimill.engine.hardware import cpu_report
    from minimill.engine.llm import LLM
    from minimill.engine.params import SamplingParams

    if options.peer:
        check_peer(options.peer, options.peer_python)
    items = read_workload(options.workload, options.limit)
    with stage(err, "loading the model ..."):
        loaded, config, measured = _load(options)
        vocab = loaded.config.vocab_size
        tok = loaded.tokenizer
        prompts = [[t % vocab for t in tok.encode(
            tok.apply_chat_template(i.messages, add_generation_prompt=True),
            add_special_tokens=False)] for i in items]
        routers = _balance_routers(options, loaded, config, prompts)
        started = time.perf_counter()
        # On a GPU the engine's pool takes what the weights leave, as vLLM's does there.
        kv_bytes = options.kv_cache_gib << 30 if config.device == "cpu" else None
        llm = LLM(loaded, dtype=config.dtype, kernels=config.kernels, kv_dtype=config.kv_dtype,
                  prefault_kv=options.kv_prefault, lanes=config.lanes,
                  kv_cache_memory_bytes=kv_bytes)
        start_s = time.perf_counter() - started
    runner = llm.engine.runner
    params = [SamplingParams(max_tokens=i.max_tokens, temperature=i.temperature,
                             ignore_eos=True, seed=n) for n, i in enumerate(items)]
    llm.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    runs: list[_Round] = []
    for _ in range(max(1, options.rounds)):
        # Each round computes the same work: nothing cached from the one before.
        llm.reset_prefix_cache()
        runner.step_log = []
        with StealMeter() as steal:
            start = time.perf_counter()
            with request_progress(err, "generating", len(prompts),
                                  _output_tokens) as on_finished:
                outputs = llm.generate(prompts, params, on_finished=on_finished)
            seconds = time.perf_counter() - start
        runs.append(_Round(runner.step_log, seconds, steal.share,
                           sum(len(o.output_token_ids) for o in outputs)))
        runner.step_log = None
    # Where the time goes, from a second run of the same workload with every kernel call
    # timed. Not the run above: the timing wrappers' Python (a few microseconds a call, ~250
    # calls a step on each core) would be charged to the figure it explains. The prefix
    # cache is emptied first, so the second run computes what the first did.
    llm.reset_prefix_cache()
    with stage(err, "timing each kernel call (the workload again) ..."):
        timed = breakdown.instrument(runner)
        start = time.perf_counter()
        llm.generate(prompts, params)
        timed_seconds = time.perf_counter() - start
        breakdown.restore(runner, timed)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    with stage(err, "measuring the speed of light ..."):
        all_steps = [s for r in runs for s in r.steps]
        # Always the best of two: one measured while a neighbour held a core reads the rates
        # low (seen: the dense GEMMs at 92 GFLOP/s where the runs beside it read 188), and a
        # yardstick too slow flatters the fraction without tripping the check below.
        stick = measure(runner.model, all_steps)
        for _ in range(YARDSTICK_FIRST_MEASUREMENTS - 1):
            stick = best_of(stick, measure(runner.model, all_steps))
        for attempt in range(1 + YARDSTICK_RETRIES):
            if attempt:  # a fraction above 1: measured while something else ran; again
                stick = best_of(stick, measure(runner.model, all_steps))
            for r in runs:
                r.sol = speed_of_light(runner.model, r.steps, stick)
            if all(r.output_tok_s <= r.sol_tok_s for r in runs):
                break
        yardstick_measurements = attempt + YARDSTICK_FIRST_MEASUREMENTS
    # The median round by throughput is the headline, with its own yardstick and fraction.
    median = sorted(runs, key=lambda r: r.output_tok_s)[(len(runs) - 1) // 2]
    steps, seconds, output_tokens = median.steps, median.seconds, median.output_tokens
    sol = median.sol
    assert sol is not None
    output_tok_s, sol_tok_s = median.output_tok_s, median.sol_tok_s
    pool_blocks = llm.config.num_kv_blocks or 0  # derived by the config: set once it is made
    report: dict[str, Any] = {
        "model": measured, "random_weights": options.random_weights,
        "dtype": config.dtype, "dtype_reason": config.dtype_reason, "kv_dtype": config.kv_dtype,
        "kv_prefault": options.kv_prefault,
        "kv_cache_gib": options.kv_cache_gib if config.device == "cpu" else None,
        # The pool the engine made of it: what bounds how many requests run at once.
        "kv_pool_gib": round(pool_blocks * llm.config.kv_block_bytes(llm.model_config)
                             / (1 << 30), 4),
        "kv_pool_tokens": pool_blocks * llm.config.block_size,
        "routers": ("balanced" if routers else "as drawn")
        if loaded.config.num_experts and options.random_weights else None,
        "lanes": config.lanes, "split_steps": runner.split_steps,
        "lane_steps": runner.lane_steps,
        "kernels": runner.kernels.name, "device": config.device,
        "cpu": cpu_report(),
        "torch": torch.__version__, "engine_start_s": round(start_s, 2),
        "requests": len(items), "prompt_tokens": sum(len(p) for p in prompts),
        "computed_prompt_tokens": sum(s.num_tokens for s in steps) - output_tokens
        + len(items),
        "output_tokens": output_tokens, "seconds": round(seconds, 3), "steps": len(steps),
        "output_tok_s": round(output_tok_s, 2), "steal_share": median.steal_share,
        "sol_tok_s": round(sol_tok_s, 2),
        "sol_fraction": round(output_tok_s / sol_tok_s, 3),
        "sol_fraction_target": TARGET_SOL_FRACTION,
        "yardstick_measurements": yardstick_measurements,
        "rounds": [{"output_tok_s": round(r.output_tok_s, 2), "sol_tok_s": round(r.sol_tok_s, 2),
                    "sol_fraction": round(r.output_tok_s / r.sol_tok_s, 3),
                    "steal_share": r.steal_share} for r in runs],
        "sol_detail": {
            "gemm_gflop_s_by_rows": {str(k): round(v / 1e9, 1)
                                     for k, v in stick.layer_flop_s.items()},
            "memory_gb_s": round(stick.bandwidth_bytes_s / 1e9, 1),
            "compute_s": round(sol.compute_seconds, 3), "memory_s": round(sol.memory_seconds, 3),
            "memory_bound_steps": sol.memory_bound_steps, "note": TARGET_NOTE},
        "peak_rss_mb": round(peak_rss_mb, 1),
        "time_breakdown": breakdown.report(timed, timed_seconds),
        "time_breakdown_seconds": round(timed_seconds, 3),
    }
    if report["sol_fraction"] > 1.0:
        report["sol_fraction_bug"] = ("above 1: the yardstick did not measure what the engine "
                                      "ran; do not trust this figure")
    sample_text = outputs[0].text[:80]
    del llm, runner, outputs
    # The engine's weights go back to the OS before a baseline loads its own copy.
    gc.collect()
    release_freed_memory()
    if options.random_weights and (not options.skip_hf or options.peer):
        # The engine took the random weights over as it built: the same seed makes them
        # again for transformers and the peer.
        loaded = _load(options)[0]
        loaded.weights.update(routers)
    if not options.skip_hf:
        with StealMeter() as hf_steal:
            hf, hf_batch = _hf_baseline(loaded, config.torch_dtype, prompts, items, err)
        report.update({
            "hf_output_tok_s": round(hf, 2), "hf_batch_size": hf_batch,
            "hf_steal_share": hf_steal.share,
            "hf_speedup": round(output_tok_s / hf, 3) if hf > 0 else None,
            "hf_speedup_target": TARGET_HF_SPEEDUP,
        })
    if options.peer:
        try:
            report.update(_peer(options, loaded, config, prompts, items, output_tok_s, err))
        except PeerError as exc:
            # The rounds took minutes: their figures are kept, the peer's failure beside them.
            report["peer_error"] = str(exc)
    report["sample_text"] = sample_text
    report["meets_targets"] = (
        "peer_error" not in report
        and TARGET_SOL_FRACTION <= report["sol_fraction"] <= 1.0
        and ("hf_speedup" not in report or (report["hf_speedup"] or 0) >= TARGET_HF_SPEEDUP)
        and ("peer_speedup" not in report or report["peer_speedup"] >= TARGET_PEER_SPEEDUP))
    return report


def _peer(options: EngineBenchOptions, loaded: Any, config: Any, prompts: list[list[int]],
          items: list[WorkItem], output_tok_s: float, err: Any) -> dict[str, Any]:
    from minimill.bench.peer import run_peer

    # Checked before the rounds (_bench), and again by run_peer.
    assert options.peer is not None and options.peer_python is not None
    python = options.peer_python
    with stage(err, f"running {options.peer} ..."), \
            StealMeter() as steal:
        result = run_peer(options.peer, python, loaded, config.torch_dtype,
                          prompts, [i.max_tokens for i in items], config.max_num_seqs,
                          options.kv_cache_gib, drop_weights=True)
    return {"peer": result.get("peer"), "peer_version": result.get("version"),
            "peer_output_tok_s": result["output_tok_s"], "peer_steal_share": steal.share,
            "peer_speedup": round(output_tok_s / result["output_tok_s"], 3),
            "peer_speedup_target": TARGET_PEER_SPEEDUP,
            "peer_sample_text": (result.get("texts_sample") or [""])[0]}


def _hf_baseline(loaded: Any, dtype: torch.dtype, prompts: list[list[int]],
                 items: list[WorkItem], err: Any) -> tuple[float, int]:
    """HF generate's output tokens/s over the same prompts (grouped by max_tokens), at the
    batch width that was fastest on a sample of them; returns (tok/s, that width)."""
    from minimill.bench.hf_baseline import build_hf_model, hf_generate_throughput

    model = build_hf_model(loaded, dtype)
    tokenizer = loaded.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
        tokenizer.eos_token_id or 0)
    hf_generate_throughput(model, prompts[:1], 2, 1, pad)  # warm-up, as for the engine
    with stage(err, "HF transformers: finding its best batch size ..."):
        sample = prompts[:HF_SWEEP_PROMPTS]
        rates = {}
        for width in HF_BATCH_SIZES:
            width = min(width, len(prompts))
            batch = (sample * (-(-width // len(sample))))[:width]
            rates[width] = hf_generate_throughput(model, batch, HF_SWEEP_TOKENS, width,
                                                  pad)["output_tok_s"]
        best = max(rates, key=lambda w: rates[w])
    groups: dict[int, list[list[int]]] = {}
    for prompt, item in zip(prompts, items, strict=True):
        groups.setdefault(item.max_tokens, []).append(prompt)
    total_tokens, total_seconds = 0, 0.0
    with stage(err, f"HF transformers at batch {best} ..."):
        for max_tokens, group in groups.items():
            result = hf_generate_throughput(model, group, max_tokens, best, pad)
            total_tokens += int(result["output_tokens"])
            total_seconds += float(result["seconds"])
    return (total_tokens / total_seconds if total_seconds > 0 else 0.0), best
