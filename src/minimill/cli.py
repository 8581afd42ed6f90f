"""The one entry point, `minimill`. Argument handling only: each command calls into a package.

Imports are inside the commands so that `minimill --help` stays fast (no torch import).
"""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(
    help="minimill: a token factory serving open-weight LLMs for background agents.",
    no_args_is_help=True,
    add_completion=False,
)
keys_app = typer.Typer(help="API keys and tenants.", no_args_is_help=True)
batch_app = typer.Typer(help="Submit and follow Batch API jobs.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks that print JSON figures.", no_args_is_help=True)
sites_app = typer.Typer(help="Sites of the fleet (mini mills).", no_args_is_help=True)
outage_app = typer.Typer(help="Planned or forecast outages of a site.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
app.add_typer(batch_app, name="batch")
app.add_typer(bench_app, name="bench")
app.add_typer(sites_app, name="sites")
sites_app.add_typer(outage_app, name="outage")

DEFAULT_MODEL = "smollm2-135m"
DbOption = typer.Option(None, "--db", help="Store URL (sqlite:///... or postgresql://...). "
                        "Default: SQLite under MINIMILL_HOME.")


@app.command()
def pull(name: str = typer.Argument(DEFAULT_MODEL, help="Model name, e.g. smollm2-135m.")) -> None:
    """Fetch a model into the model cache (MINIMILL_HOME)."""
    from minimill.models.registry import pull_model
    from minimill.models.types import ModelError

    try:
        path = pull_model(name, progress=True)
    except ModelError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(str(path))


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="User message (sent through the chat template)."),
    model: str = typer.Option(DEFAULT_MODEL, help="Model name or path."),
    max_tokens: int = typer.Option(64, help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    seed: int | None = typer.Option(None, help="Sampling seed."),
    dtype: str = typer.Option("bfloat16", help="bfloat16, float16 or float32."),
) -> None:
    """Generate one chat answer offline with the builtin engine and print it."""
    from minimill.engine.llm import generate_chat_cli

    generate_chat_cli(prompt, model=model, max_tokens=max_tokens, temperature=temperature,
                      seed=seed, dtype=dtype)


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
    db: str | None = DbOption,
    model: str = typer.Option(DEFAULT_MODEL, help="Model the local worker serves."),
    dtype: str = typer.Option("bfloat16", help="Engine dtype of the local worker."),
    local_worker: bool = typer.Option(True, help="Start one local worker process."),
    price_per_hour: float = typer.Option(0.10, help="The local site's price in $/hour."),
) -> None:
    """Serve the OpenAI-compatible API (control plane) plus one local worker process."""
    from minimill.api.serve import run_serve

    run_serve(host=host, port=port, db=db, model=model, dtype=dtype,
              local_worker=local_worker, price_per_hour=price_per_hour)


@keys_app.command("create")
def keys_create(
    tenant: str = typer.Option(..., "--tenant", help="Tenant name (created if new)."),
    db: str | None = DbOption,
) -> None:
    """Create an API key for a tenant and print it (works whether or not serve is running)."""
    from minimill.control.keys import create_key_cli

    typer.echo(create_key_cli(tenant=tenant, db=db))


BaseUrlOption = typer.Option("http://127.0.0.1:8000/v1", envvar="MINIMILL_BASE_URL",
                             help="API base URL.")
ApiKeyOption = typer.Option(..., envvar="MINIMILL_API_KEY", help="API key.")


@batch_app.command("submit")
def batch_submit(
    file: Path = typer.Argument(..., exists=True, dir_okay=False, help="Batch input JSONL."),
    base_url: str = BaseUrlOption,
    api_key: str = ApiKeyOption,
    output: Path | None = typer.Option(None, help="Where to write results (JSONL)."),
    wait: bool = typer.Option(True, help="Follow progress until the batch ends."),
) -> None:
    """Upload FILE, create a batch, show progress until done, download the results."""
    from minimill.batch_client import submit

    submit(file, base_url=base_url, api_key=api_key, output=output, wait=wait)


@batch_app.command("status")
def batch_status(batch_id: str, base_url: str = BaseUrlOption,
                 api_key: str = ApiKeyOption) -> None:
    """Show a batch's status and request counts."""
    from minimill.batch_client import status

    status(batch_id, base_url=base_url, api_key=api_key)


@batch_app.command("results")
def batch_results(batch_id: str, base_url: str = BaseUrlOption, api_key: str = ApiKeyOption,
                  output: Path | None = typer.Option(None, help="Write here, not stdout.")) -> None:
    """Download a batch's output and error files."""
    from minimill.batch_client import results

    results(batch_id, base_url=base_url, api_key=api_key, output=output)


@batch_app.command("cancel")
def batch_cancel(batch_id: str, base_url: str = BaseUrlOption,
                 api_key: str = ApiKeyOption) -> None:
    """Cancel a batch; finished results are kept."""
    from minimill.batch_client import cancel

    cancel(batch_id, base_url=base_url, api_key=api_key)


WorkloadOption = typer.Option(Path("../shared/workloads/throughput-256.jsonl"),
                              help="Batch-format JSONL workload.")


@bench_app.command("engine")
def bench_engine(
    workload: Path = WorkloadOption,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    model: str = typer.Option(DEFAULT_MODEL, help="Model name or path."),
    dtype: str = typer.Option("bfloat16", help="Engine dtype."),
    limit: int | None = typer.Option(None, help="Use only the first N requests."),
    skip_hf: bool = typer.Option(False, help="Skip the HF transformers baseline."),
) -> None:
    """Offline engine throughput vs the speed of light and vs HF transformers."""
    from minimill.bench.engine_bench import run_engine_bench

    run_engine_bench(workload, json_out=json_out, model=model, dtype=dtype, limit=limit,
                     skip_hf=skip_hf)


@bench_app.command("batch")
def bench_batch(
    workload: Path = WorkloadOption,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    model: str = typer.Option(DEFAULT_MODEL, help="Model name or path."),
    limit: int | None = typer.Option(None, help="Use only the first N requests."),
) -> None:
    """Batch API throughput of a fresh serve vs the offline engine, plus ingest speed."""
    from minimill.bench.batch_bench import run_batch_bench

    run_batch_bench(workload, json_out=json_out, model=model, limit=limit)


@bench_app.command("fleet")
def bench_fleet(
    workload: Path = WorkloadOption,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    kill_every_s: float = typer.Option(10.0, help="Kill a random worker this often."),
    limit: int | None = typer.Option(None, help="Use only the first N requests."),
) -> None:
    """Goodput of 3 local workers with one killed every few seconds vs no kills."""
    from minimill.bench.fleet_bench import run_fleet_bench

    run_fleet_bench(workload, json_out=json_out, kill_every_s=kill_every_s, limit=limit)


@bench_app.command("ingest")
def bench_ingest(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
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


@app.command()
def worker(
    server: str = typer.Option(..., help="Control plane URL, e.g. http://host:8000."),
    site: str = typer.Option(..., help="This site's name."),
    token: str = typer.Option(..., envvar="MINIMILL_SITE_TOKEN", help="Site token."),
    price_per_hour: float | None = typer.Option(
        None, help="This site's price in $/hour (default: as the site was registered)."),
    chip: str | None = typer.Option(
        None, help="Chip name, for the registry (default: as the site was registered)."),
    engine: str = typer.Option("builtin", help="'builtin' or an OpenAI-compatible base URL."),
    model: str = typer.Option(DEFAULT_MODEL, help="Model to serve."),
    dtype: str = typer.Option("bfloat16", help="Builtin engine dtype."),
    capacity: int = typer.Option(256, help="Most requests in flight."),
) -> None:
    """Join a fleet: pull work from the control plane under leases and run it."""
    from minimill.fleet.worker import run_worker

    run_worker(server=server, site=site, token=token, price_per_hour=price_per_hour, chip=chip,
               engine=engine, model=model, dtype=dtype, capacity=capacity)


@sites_app.command("create")
def sites_create(
    name: str = typer.Argument(..., help="Site name."),
    price_per_hour: float = typer.Option(0.10, help="Price in $/hour."),
    chip: str = typer.Option("cpu", help="Chip name."),
    db: str | None = DbOption,
) -> None:
    """Register a site and print its token."""
    from minimill.control.sites import create_site_cli

    typer.echo(create_site_cli(name=name, price_per_hour=price_per_hour, chip=chip, db=db))


@sites_app.command("list")
def sites_list(db: str | None = DbOption,
               json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Show every site: status, chip, price, tokens/s, uptime, $/Mtok."""
    from minimill.control.sites import list_sites_cli

    list_sites_cli(db=db, json_out=json_out)


@outage_app.command("add")
def outage_add(
    site: str = typer.Argument(..., help="Site name."),
    start: str = typer.Option(..., "--from", help="Start, ISO 8601."),
    end: str = typer.Option(..., "--to", help="End, ISO 8601."),
    db: str | None = DbOption,
) -> None:
    """Announce a planned or forecast outage of a site."""
    from minimill.control.sites import add_outage_cli

    add_outage_cli(site=site, start=start, end=end, db=db)


if __name__ == "__main__":
    app()
