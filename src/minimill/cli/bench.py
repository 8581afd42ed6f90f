"""`minimill bench ...`: the benchmarks, each printing its figures beside their targets."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from minimill.cli.options import (
    DEFAULT_MODEL,
    EngineDtypeOption,
    JsonOption,
    KvDtypeOption,
    ModelOption,
)

bench_app = typer.Typer(help="Benchmarks that print JSON figures.", no_args_is_help=True)


@bench_app.callback()
def bench_callback() -> None:
    """Benchmarks that print JSON figures."""
    from minimill.lifetime import exit_on_sigterm

    # A benchmark stopped by a timeout (SIGTERM) stops the processes it started on its way out.
    exit_on_sigterm()


WorkloadOption = typer.Option(Path("../shared/workloads/throughput-256.jsonl"),
                              help="Batch-format JSONL workload.")
LimitOption = typer.Option(None, help="Use only the first N requests.")


@bench_app.command("engine")
def bench_engine(
    workload: Path = WorkloadOption,
    json_out: bool = JsonOption,
    model: str = ModelOption,
    dtype: str = EngineDtypeOption,
    limit: int | None = LimitOption,
    skip_hf: bool = typer.Option(False, help="Skip the HF transformers baseline."),
    shape: str | None = typer.Option(
        None, help="Measure a named model shape instead of --model (e.g. llama3-8b, "
        "qwen3-0.6b, qwen3-moe-2.9b-a0.7b, gemma3-1b, gpt-oss-20b, deepseek-v3-mla-4l); "
        "needs --random-weights."),
    config: Path | None = typer.Option(
        None, exists=True, dir_okay=False,
        help="An HF config.json whose shape to measure; needs --random-weights."),
    random_weights: bool = typer.Option(
        False, help="Random weights of the shape: measures the chip without downloading."),
    kernels: str = typer.Option("auto", help="auto, native or torch (the portable path)."),
    kv_dtype: str = KvDtypeOption,
    kv_prefault: bool = typer.Option(
        True, "--kv-prefault/--no-kv-prefault",
        help="Back the KV pool with memory before the run (as `serve --kv-prefault`, and as "
        "an engine that allocates its cache up front): steady-state speed, not the OS "
        "zeroing pages during the first pass."),
    kv_cache_gib: int = typer.Option(
        4, min=1,
        help="CPU: the KV pool of minimill and of the peer (vLLM's VLLM_CPU_KVCACHE_SPACE, "
        "whose default this is), GiB: both engines get the same room for requests at once."),
    lanes: bool = typer.Option(
        True, "--lanes/--no-lanes",
        help="CPU: let each core step its own share of the requests on its own clock "
        "(--no-lanes: every step split across the cores, which wait for each other)."),
    balanced_routers: bool = typer.Option(
        True, "--balanced-routers/--drawn-routers",
        help="Random-weights mixtures of experts: redraw each router blind to the directions "
        "its inputs share, so tokens spread over the experts as a trained router spreads "
        "them (--drawn-routers: as drawn, most tokens on a few experts)."),
    peer: str | None = typer.Option(None, help="Also measure this engine: vllm."),
    peer_python: str | None = typer.Option(
        None, help="Python of the environment where the peer is installed."),
    rounds: int = typer.Option(
        3, min=1, help="Timed runs of the workload; the median one is the headline (every "
        "round's figures are in the report)."),
) -> None:
    """Offline engine throughput vs the speed of light, HF transformers and (optionally) vLLM."""
    from minimill.bench.engine_bench import EngineBenchOptions, run_engine_bench

    run_engine_bench(EngineBenchOptions(
        workload=workload, json_out=json_out, model=model, dtype=dtype, limit=limit,
        skip_hf=skip_hf, shape=shape, config=config, random_weights=random_weights,
        kernels=kernels, kv_dtype=kv_dtype, kv_prefault=kv_prefault,
        kv_cache_gib=kv_cache_gib, lanes=lanes, balanced_routers=balanced_routers, peer=peer,
        peer_python=peer_python, rounds=rounds))


@bench_app.command("sessions")
def bench_sessions(
    json_out: bool = JsonOption,
    model: str = ModelOption,
    dtype: str = EngineDtypeOption,
    sessions: int = typer.Option(64, help="Agent sessions running at once."),
    turns: int = typer.Option(8, help="Turns per session."),
    tool_tokens: int = typer.Option(300, help="About this many tokens of tool output a turn."),
    max_tokens: int = typer.Option(16, help="Answer tokens a turn."),
    kv_cache_gb: float | None = typer.Option(
        None, help="Device KV pool, GiB (default: a quarter of what the sessions hold)."),
    kv_host_gb: float = typer.Option(0.5, help="Host RAM KV tier, GiB."),
    kv_flash_gb: float = typer.Option(8.0, help="Flash KV tier bound, GiB (a temp dir)."),
    restart_after: int = typer.Option(
        4, help="Restart serve after this turn in the restart run (0: no restart run)."),
    probe_tokens: int = typer.Option(1024, help="Prompt tokens of the restore vs recompute "
                                     "probe."),
) -> None:
    """Agent sessions through serve: prefix reuse + KV tiers on vs off, and across a restart."""
    from minimill.bench.sessions_bench import SessionsBenchOptions, run_sessions_bench

    run_sessions_bench(SessionsBenchOptions(
        json_out=json_out, model=model, dtype=dtype, sessions=sessions, turns=turns,
        tool_tokens=tool_tokens, max_tokens=max_tokens, kv_cache_gb=kv_cache_gb,
        kv_host_gb=kv_host_gb, kv_flash_gb=kv_flash_gb, restart_after=restart_after,
        probe_tokens=probe_tokens))


@bench_app.command("structured")
def bench_structured(
    workload: Path = WorkloadOption,
    json_out: bool = JsonOption,
    model: str = ModelOption,
    dtype: str = EngineDtypeOption,
    limit: int | None = LimitOption,
    rounds: int = typer.Option(3, min=1, help="Constrained/unconstrained pairs; the median "
                               "ratio is the headline."),
) -> None:
    """Grammar-constrained decoding against the same work unconstrained: throughput ratio,
    schema validity of every answer, grammar compile times."""
    from minimill.bench.structured_bench import StructuredBenchOptions, run_structured_bench

    _print_report(lambda: run_structured_bench(StructuredBenchOptions(
        workload=workload, json_out=json_out, model=model, dtype=dtype, limit=limit,
        rounds=rounds)), json_out, 28)


@bench_app.command("pipeline")
def bench_pipeline(
    workload: Path = WorkloadOption,
    json_out: bool = JsonOption,
    model: str = ModelOption,
    dtype: str = EngineDtypeOption,
    stages: int = typer.Option(2, min=2, help="Pipeline stages, one core each; the single "
                               "engine gets as many cores."),
    limit: int | None = typer.Option(128, help="Use only the first N requests."),
    rounds: int = typer.Option(2, min=1, help="Pipeline/single pairs; the median ratio is "
                               "the headline."),
    expert_parallel: int | None = typer.Option(
        None, "--expert-parallel", min=2, help="Measure expert parallelism instead: this "
        "many ranks of one core each against one engine of as many cores, on --shape with "
        "random weights (--model and --stages do not apply)."),
    shape: str = typer.Option("qwen3-moe-2.9b-a0.7b", help="With --expert-parallel: the "
                              "mixture of experts' shape (bench engine --shape's names)."),
    layers: int | None = typer.Option(8, min=1, help="With --expert-parallel: the shape's "
                                      "first layers only (memory and time)."),
) -> None:
    """Pipeline stages of one core each against one engine of as many cores, the same
    workload in the same run: output tok/s of each, their ratio, and per stage the time
    computing, waiting (bubble) and communicating per step. With --expert-parallel N:
    N expert-parallel ranks against one engine of N cores."""
    if expert_parallel is not None:
        from minimill.bench.expert_bench import ExpertBenchOptions, run_expert_bench

        if stages != 2 or model != ModelOption.default:
            raise typer.BadParameter("--expert-parallel measures --shape with random "
                                     "weights over its ranks: --model and --stages do not "
                                     "apply")
        _print_report(lambda: run_expert_bench(ExpertBenchOptions(
            workload=workload, shape=shape, layers=layers, dtype=dtype,
            ranks=expert_parallel, limit=limit, rounds=rounds)), json_out, 32)
        return
    from minimill.bench.pipeline_bench import PipelineBenchOptions, run_pipeline_bench

    _print_report(lambda: run_pipeline_bench(PipelineBenchOptions(
        workload=workload, model=model, dtype=dtype, stages=stages, limit=limit,
        rounds=rounds)), json_out, 32)


@bench_app.command("kv")
def bench_kv(
    json_out: bool = JsonOption,
    model: str = ModelOption,
    dtype: str = EngineDtypeOption,
    kv_dtypes: str = typer.Option("int8,int4", help="Compressed KV dtypes to measure, "
                                  "comma-separated (the model dtype is always measured as the "
                                  "reference)."),
    perplexity_tokens: int = typer.Option(16384, help="Tokens of the text for perplexity."),
    prompts: int = typer.Option(64, help="Prompts for the greedy agreement."),
    new_tokens: int = typer.Option(128, help="Tokens generated per prompt."),
    budget_mb: float = typer.Option(48.0, help="The fixed KV memory budget, MB."),
    workload_requests: int = typer.Option(
        128, min=1, help="Requests of the throughput-at-budget workload."),
    shape: str | None = typer.Option(
        None, help="A named model shape (e.g. deepseek-v3): only what the budget holds per KV "
        "dtype, by the engine's arithmetic; no weights are loaded."),
    context_tokens: int = typer.Option(
        4096, min=1, help="Tokens per sequence for what the budget holds."),
) -> None:
    """KV cache dtypes: bytes/token, perplexity, greedy agreement, throughput at one budget."""
    from minimill.bench.kv_bench import KvBenchOptions, run_kv_bench

    run_kv_bench(KvBenchOptions(
        json_out=json_out, model=model, dtype=dtype,
        kv_dtypes=tuple(k.strip() for k in kv_dtypes.split(",") if k.strip()),
        perplexity_tokens=perplexity_tokens, prompts=prompts, new_tokens=new_tokens,
        budget_mb=budget_mb, workload_requests=workload_requests, shape=shape,
        context_tokens=context_tokens))


@bench_app.command("batch")
def bench_batch(
    workload: Path = WorkloadOption,
    json_out: bool = JsonOption,
    model: str = ModelOption,
    limit: int | None = LimitOption,
    rounds: int = typer.Option(3, min=1, help="Served runs, each between two offline runs; "
                               "the ratio printed is the median of the rounds'."),
) -> None:
    """Batch API throughput of a fresh serve vs the offline engine, plus ingest speed."""
    from minimill.bench.batch_bench import run_batch_bench

    run_batch_bench(workload, json_out=json_out, model=model, limit=limit, rounds=rounds)


@bench_app.command("fleet")
def bench_fleet(
    workload: Path = WorkloadOption,
    json_out: bool = JsonOption,
    kill_every_s: float = typer.Option(10.0, help="Kill a random worker this often."),
    limit: int | None = LimitOption,
    kv_flash: bool = typer.Option(
        True, help="Give each worker a KV flash tier: a killed worker's restart resumes its "
        "requests from the KV it wrote through to flash instead of recomputing them."),
) -> None:
    """Goodput of 3 local workers with one killed every few seconds vs no kills."""
    from minimill.bench.fleet_bench import run_fleet_bench

    run_fleet_bench(workload, json_out=json_out, kill_every_s=kill_every_s, limit=limit,
                    kv_flash=kv_flash)


@bench_app.command("ingest")
def bench_ingest(
    json_out: bool = JsonOption,
    heartbeat_interval_s: float = typer.Option(0.5, help="The heartbeating client's interval."),
    lines: int = typer.Option(50_000, help="Lines of ~4 KB in the batch (a quick check: fewer)."),
) -> None:
    """Control-plane peak RSS while a 50,000-line ~200 MB batch is ingested and finalized,
    and the longest gap of a worker's heartbeats meanwhile."""
    import json

    from minimill.bench.ingest_bench import run_ingest_bench
    from minimill.bench.local_fleet import BenchError

    try:
        report = run_ingest_bench(heartbeat_interval_s, lines)
    except (BenchError, RuntimeError, TimeoutError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    if json_out:
        typer.echo(json.dumps(report))
        return
    for key, value in report.items():
        typer.echo(f"{key:>32}: {value}")


@bench_app.command("agents")
def bench_agents(
    json_out: bool = JsonOption,
    model: str = typer.Option(DEFAULT_MODEL, help="Model to serve."),
    dtype: str = EngineDtypeOption,
    docs: int = typer.Option(1000, min=100, help="Documents in the generated corpus."),
    docs_per_subagent: int = typer.Option(10, min=1, help="Documents each subagent reads."),
) -> None:
    """The deep-research example: subagents, tokens, batching, tok/s vs the engine alone,
    and the same with the runner killed twice."""
    from minimill.bench.agents_bench import run_agents_bench

    run_agents_bench(model=model, dtype=dtype, json_out=json_out, docs=docs,
                     docs_per_subagent=docs_per_subagent)


@bench_app.command("fairness")
def bench_fairness(
    json_out: bool = JsonOption,
    model: str = typer.Option(DEFAULT_MODEL, help="Model to serve."),
    dtype: str = EngineDtypeOption,
    engine: str = typer.Option("fake", help="The worker's engine: 'fake' (at --rate; measures "
                               "placement in seconds) or 'builtin' (the real model)."),
    light_requests: int = typer.Option(8, min=1, help="Requests in the light tenant's batch."),
    heavy_factor: int = typer.Option(10, min=1, help="The heavy tenant's batch is this many "
                                     "times the light one's."),
    capacity: int = typer.Option(16, min=2, help="Requests the worker runs at once."),
    rate: float = typer.Option(320.0, min=1.0, help="Fake engine: output tokens/s of a full "
                               "batch (a request takes max_tokens x capacity / rate s)."),
    max_tokens: int = typer.Option(32, min=1, help="max_tokens of the light tenant's "
                                   "requests (the heavy tenant's vary around it)."),
) -> None:
    """A light tenant's batch p50 finish time alone and beside a tenant submitting 10x its
    load, their ratio beside the target 1.5, and how busy the site stays."""
    import json

    from minimill.bench.fairness_bench import FairnessBenchOptions, run_fairness_bench
    from minimill.bench.local_fleet import BenchError

    try:
        report = run_fairness_bench(FairnessBenchOptions(
            model=model, dtype=dtype, engine=engine, light_requests=light_requests,
            heavy_factor=heavy_factor, capacity=capacity, rate=rate, max_tokens=max_tokens))
    except (BenchError, RuntimeError, TimeoutError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    if json_out:
        typer.echo(json.dumps(report))
        return
    for key, value in report.items():
        typer.echo(f"{key:>36}: {value}")


def _print_report(run: Callable[[], dict[str, Any]], json_out: bool, width: int) -> None:
    """Run a bench and print its report (one JSON object, or a key per line); an engine,
    request, model or file error is one red line and exit status 1."""
    import json

    from rich.console import Console

    from minimill.engine.params import EngineError, InvalidRequestError
    from minimill.models.types import ModelError

    try:
        report = run()
    except (EngineError, InvalidRequestError, ModelError, OSError) as exc:
        Console(stderr=True).print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    if json_out:
        print(json.dumps(report))
        return
    for key, value in report.items():
        print(f"{key:>{width}}: {value}")


def _counts(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise typer.BadParameter(f"{what}: comma-separated whole numbers, e.g. 10,100") from None
    if not values or min(values) < 1:
        raise typer.BadParameter(f"{what}: at least one number, each 1 or more")
    return values


@bench_app.command("control-plane")
def bench_control_plane(
    json_out: bool = JsonOption,
    sites: str = typer.Option("10,100,1000", help="Site counts to run, comma-separated: a "
                              "run of each."),
    db: str | None = typer.Option(
        None, "--db", help="A PostgreSQL URL (postgresql://...): also run the control plane "
        "on it, with each of --processes processes (its tables are dropped first)."),
    processes: str = typer.Option(
        "1,2,4", help="With --db: control-plane processes sharing the PostgreSQL store, "
        "comma-separated (a run of each); the sites spread over them as behind a load "
        "balancer."),
    compare: bool = typer.Option(
        True, "--compare/--no-compare", help="With --db: run SQLite with one process too, "
        "side by side (--no-compare: PostgreSQL only)."),
    requests: int | None = typer.Option(
        None, min=1, help="Requests per run (default: 10 per site, at least 200)."),
    realtime_share: float = typer.Option(
        0.1, min=0.0, max=1.0, help="Share of the requests made as streaming realtime calls; "
        "the rest are one batch."),
    capacity: int = typer.Option(16, min=1, help="Requests each site runs at once."),
    request_s: float = typer.Option(
        4.0, min=0.01, help="Seconds a site takes over a request (its declared rate)."),
    max_tokens: int = typer.Option(8, min=1, help="Tokens each request generates."),
    drivers: int = typer.Option(2, min=1, help="Processes that run the simulated sites."),
    lease_ttl_s: float = typer.Option(30.0, min=1.0, help="The control plane's lease TTL."),
    checkpoint_interval_s: float = typer.Option(
        1.0, min=0.05, help="How often sites checkpoint batch requests (streams: as often as "
        "the control plane asks)."),
    kill_one: bool = typer.Option(
        False, "--kill-one", help="SIGKILL the last control-plane process once half the batch "
        "is done (needs 2 or more processes); its sites move to the others."),
) -> None:
    """Control-plane CPU per request, calls' latency and exactly-once completion with 10 to
    1,000 simulated sites speaking the fleet protocol; SQLite beside PostgreSQL."""
    import json

    from minimill.bench.control_plane_bench import (
        ControlPlaneBenchOptions,
        run_control_plane_bench,
    )
    from minimill.bench.local_fleet import BenchError

    try:
        report = run_control_plane_bench(ControlPlaneBenchOptions(
            sites=_counts(sites, "--sites"), db=db,
            processes=_counts(processes, "--processes"), compare=compare, requests=requests,
            realtime_share=realtime_share, capacity=capacity, request_s=request_s,
            max_tokens=max_tokens, drivers=drivers, lease_ttl_s=lease_ttl_s,
            checkpoint_interval_s=checkpoint_interval_s, kill_one=kill_one))
    except (BenchError, RuntimeError, TimeoutError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    if json_out:
        typer.echo(json.dumps(report))
        return
    typer.echo(f"cpu: {report['cpu_model']} ({report['cores']} cores)")
    for run in report["runs"]:
        lat = run["latency"]
        typer.echo(
            f"{run['store']:>10} x{run['processes']} {run['sites']:>5} sites: "
            f"{run['completed_per_s']:>8} req/s  {run['control_plane_cpu_ms_per_request']:>7} "
            f"ms CPU/req  lease p50/p99 {lat['lease']['p50_ms']}/{lat['lease']['p99_ms']} ms  "
            f"heartbeat {lat['heartbeat']['p50_ms']}/{lat['heartbeat']['p99_ms']} ms  "
            f"complete {lat['complete']['p50_ms']}/{lat['complete']['p99_ms']} ms  "
            f"expired {run['leases_expired']}  rows/req {run['rows_written_per_request']}  "
            f"exactly once: {run['exactly_once']}")
