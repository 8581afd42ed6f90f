"""The one entry point, `minimill`. Argument handling only: each command calls into a package.

Imports are inside the commands so that `minimill --help` stays fast (no torch import).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from minimill.cli.admin import keys_app, prices_app, webhooks_app
from minimill.cli.agent import agent_app
from minimill.cli.batch import batch_app
from minimill.cli.bench import bench_app
from minimill.cli.box import box_app
from minimill.cli.models import models_app
from minimill.cli.options import (
    DEFAULT_MODEL,
    DTYPE_HELP,
    LOCAL_SITE_USD_PER_HOUR,
    BoxMaxCpuOption,
    BoxMaxDiskOption,
    BoxMaxExecOption,
    BoxMaxMemoryOption,
    BoxMaxProcessesOption,
    DbOption,
    JsonOption,
    KvDtypeOption,
    ModelOption,
    box_caps,
    print_table,
)
from minimill.cli.sites import sites_app
from minimill.cli.tenants import tenants_app

if TYPE_CHECKING:
    from minimill.fleet.kv_options import KvOptions

class MinimillApp(typer.Typer):
    """The `minimill` command: an error it did not expect ends it with one line, the
    traceback only with --verbose (or MINIMILL_VERBOSE=1)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except Exception as exc:
            if (_VERBOSE[0] or os.environ.get("MINIMILL_VERBOSE") == "1"
                    or _command_word() in LOGGING_COMMANDS):
                raise
            from minimill.control.errors import ControlError

            if isinstance(exc, ControlError):  # a refusal that explains itself
                print(f"error: {' '.join(exc.message.split())}", file=sys.stderr)
            else:
                message = " ".join(str(exc).split()) or type(exc).__name__
                print(f"error: {message} ({type(exc).__name__}; --verbose shows the "
                      "traceback)", file=sys.stderr)
            raise SystemExit(1) from None


_VERBOSE = [False]
# Long-running processes whose output is a log read after the fact: a crash keeps its
# traceback there.
LOGGING_COMMANDS = ("serve", "worker")


def _command_word() -> str | None:
    return next((word for word in sys.argv[1:] if not word.startswith("-")), None)
app = MinimillApp(
    help="minimill: a token factory serving open-weight LLMs for background agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain click help: it rewraps descriptions to the terminal and never cuts an option name
    # (rich panels cut names at 80 columns).
    rich_markup_mode=None,
    # Help reads at 80 columns: option names are never cut, descriptions wrap.
    context_settings={"max_content_width": 100},
)


@app.callback()
def root(verbose: bool = typer.Option(False, "--verbose", help="Print the traceback of an "
                                      "error minimill did not expect.")) -> None:
    """minimill: a token factory serving open-weight LLMs for background agents."""
    _VERBOSE[0] = verbose
app.add_typer(keys_app, name="keys")
app.add_typer(box_app, name="box")
app.add_typer(agent_app, name="agent")
app.add_typer(batch_app, name="batch")
app.add_typer(bench_app, name="bench")
app.add_typer(sites_app, name="sites")
app.add_typer(prices_app, name="prices")
app.add_typer(webhooks_app, name="webhooks")
app.add_typer(tenants_app, name="tenants")
app.add_typer(models_app, name="models")


KvCacheGbOption = typer.Option(None, "--kv-cache-gb", help="Builtin engine: the device KV pool "
                               "in GiB (default: a share of free memory).")
KvHostGbOption = typer.Option(0.0, "--kv-host-gb", help="Builtin engine: GiB of host RAM that "
                              "keep KV blocks evicted from the pool (0: none).")
KvFlashDirOption = typer.Option(None, "--kv-flash-dir", help="Builtin engine: a directory "
                                "that keeps evicted KV blocks on flash, across restarts.")
KvFlashGbOption = typer.Option(8.0, "--kv-flash-gb", help="Builtin engine: most GiB the "
                               "--kv-flash-dir tier holds (least recently used go first).")
PrefixCachingOption = typer.Option(True, "--prefix-caching/--no-prefix-caching",
                                   help="Builtin engine: reuse the KV of prompt prefixes "
                                   "computed before (the KV tiers need it).")


KvPrefaultOption = typer.Option(False, "--kv-prefault/--no-kv-prefault",
                                help="Builtin engine on CPU: back the whole KV pool with memory "
                                "at start, so the first requests run at steady-state speed "
                                "(a long-running factory wants this); costs start time and "
                                "the pool's size in resident memory from the start.")


def _kv_options(cache_gb: float | None, host_gb: float, flash_dir: str | None,
                flash_gb: float, prefix_caching: bool, kv_dtype: str,
                prefault: bool) -> KvOptions:
    from minimill.fleet.kv_options import KvOptions

    kv = KvOptions(cache_gb, host_gb, flash_dir, flash_gb, prefix_caching, kv_dtype, prefault)
    try:
        kv.check()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return kv


@app.command()
def pull(name: str = typer.Argument(DEFAULT_MODEL, help="Model name, e.g. smollm2-135m, or "
                                    "the path of an HF model directory."),
         as_name: str | None = typer.Option(None, "--name", help="The name an HF directory "
                                            "is cached under (default: the directory's).")
         ) -> None:
    """Fetch a model into the model cache (MINIMILL_HOME); an HF directory is checked and
    linked there, so that `--model NAME` serves it."""
    from minimill.cli.options import PullBar
    from minimill.models.catalog import pull_path
    from minimill.models.registry import KNOWN_MODELS, pull_model
    from minimill.models.types import ModelError

    try:
        if name in KNOWN_MODELS or not Path(name).expanduser().exists():
            if as_name is not None:
                raise typer.BadParameter("--name is for an HF directory given by path")
            with PullBar() as bar:
                typer.echo(str(pull_model(name, progress=bar)))
            return
        cached_name, link = pull_path(Path(name), as_name)
    except ModelError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"{cached_name}: {link} -> {link.resolve()}")


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="User message (sent through the chat template)."),
    model: str = ModelOption,
    max_tokens: int = typer.Option(64, help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    seed: int | None = typer.Option(None, help="Sampling seed."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    kv_dtype: str = KvDtypeOption,
) -> None:
    """Generate one chat answer offline with the builtin engine and print it."""
    from rich.console import Console

    from minimill.engine.config import load_with_config
    from minimill.engine.llm import LLM
    from minimill.engine.params import EngineError, InvalidRequestError, SamplingParams
    from minimill.models.types import ModelError

    err = Console(stderr=True)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        with err.status(f"loading {model} ..."):
            loaded, config = load_with_config(model, {"dtype": dtype, "kv_dtype": kv_dtype},
                                              auto_pull=True)
            llm = LLM(loaded, dtype=config.dtype, kv_dtype=config.kv_dtype)
        out = llm.chat([[{"role": "user", "content": prompt}]], params)[0]
    except (ModelError, EngineError, InvalidRequestError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise SystemExit(1) from exc
    print(out.text)


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
    db: str | None = DbOption,
    model: str = typer.Option(DEFAULT_MODEL, help="Model the local worker serves."),
    dtype: str = typer.Option("auto", help="Engine dtype of the local worker: " + DTYPE_HELP),
    kv_dtype: str = KvDtypeOption,
    local_worker: bool = typer.Option(True, help="Start one local worker process."),
    price_per_hour: float = typer.Option(
        LOCAL_SITE_USD_PER_HOUR, help="What the local site costs in $/hour (cost only; "
        "tenants are billed by `minimill prices`)."),
    boxes: int = typer.Option(4, min=0, help="Boxes (sandboxes) the local worker holds at "
                              "once; none where bubblewrap isolation is unavailable."),
    insecure_no_sandbox: bool = typer.Option(
        False, "--insecure-no-sandbox", help="Let the local worker run boxes and agents' "
        "harnesses without bubblewrap isolation where it is unavailable."),
    agents: int = typer.Option(8, min=0, envvar="MINIMILL_LOCAL_AGENTS",
                               help="Durable agents (harnesses) the local worker runs at "
                               "once; none where harnesses cannot be sandboxed."),
    box_max_memory_mb: int | None = BoxMaxMemoryOption,
    box_max_processes: int | None = BoxMaxProcessesOption,
    box_max_cpu_s: int | None = BoxMaxCpuOption,
    box_max_exec_s: int | None = BoxMaxExecOption,
    box_max_disk_mb: int | None = BoxMaxDiskOption,
    kv_cache_gb: float | None = KvCacheGbOption,
    kv_host_gb: float = KvHostGbOption,
    kv_flash_dir: str | None = KvFlashDirOption,
    kv_flash_gb: float = KvFlashGbOption,
    prefix_caching: bool = PrefixCachingOption,
    kv_prefault: bool = KvPrefaultOption,
    webhook_allow_private: bool = typer.Option(
        False, "--webhook-allow-private", help="Let webhooks reach loopback, link-local and "
        "private addresses (refused by default; also MINIMILL_WEBHOOK_ALLOW_PRIVATE=1)."),
    tenant_requests_per_minute: int | None = typer.Option(
        None, min=0, help="Every tenant's requests per minute, unless `minimill tenants set` "
        "gives it its own (default: unlimited; also MINIMILL_TENANT_REQUESTS_PER_MINUTE)."),
    tenant_tokens_per_minute: int | None = typer.Option(
        None, min=0, help="Every tenant's tokens per minute (prompt plus max_tokens; "
        "MINIMILL_TENANT_TOKENS_PER_MINUTE)."),
    tenant_max_concurrent_realtime: int | None = typer.Option(
        None, min=0, help="Realtime requests a tenant may have in progress at once "
        "(MINIMILL_TENANT_MAX_CONCURRENT_REALTIME)."),
    tenant_max_boxes: int | None = typer.Option(
        None, min=0, help="Boxes a tenant may keep (MINIMILL_TENANT_MAX_BOXES)."),
    tenant_max_agents: int | None = typer.Option(
        None, min=0, help="Unfinished agents a tenant may have (MINIMILL_TENANT_MAX_AGENTS)."),
    tenant_max_stored_bytes: int | None = typer.Option(
        None, min=0, help="Bytes of files a tenant may keep (MINIMILL_TENANT_MAX_STORED_BYTES)."),
    tenant_share_prefix_cache: bool = typer.Option(
        False, "--tenant-share-prefix-cache", help="Let every tenant's cached prompt prefixes "
        "serve other tenants (off: each tenant's are its own unless `minimill tenants set "
        "NAME --share-prefix-cache`)."),
) -> None:
    """Serve the OpenAI-compatible API (control plane) plus one local worker process."""
    from minimill.serve.run import run_serve

    kv = _kv_options(kv_cache_gb, kv_host_gb, kv_flash_dir, kv_flash_gb, prefix_caching,
                     kv_dtype, kv_prefault)
    # The control plane's settings and the local worker both read the caps from here.
    os.environ.update(box_caps(box_max_memory_mb, box_max_processes, box_max_cpu_s,
                               box_max_exec_s, box_max_disk_mb))
    tenant_defaults = {
        "REQUESTS_PER_MINUTE": tenant_requests_per_minute,
        "TOKENS_PER_MINUTE": tenant_tokens_per_minute,
        "MAX_CONCURRENT_REALTIME": tenant_max_concurrent_realtime,
        "MAX_BOXES": tenant_max_boxes, "MAX_AGENTS": tenant_max_agents,
        "MAX_STORED_BYTES": tenant_max_stored_bytes,
        "SHARE_PREFIX_CACHE": 1 if tenant_share_prefix_cache else None}
    os.environ.update({f"MINIMILL_TENANT_{k}": str(v) for k, v in tenant_defaults.items()
                       if v is not None})
    run_serve(host=host, port=port, db=db, model=model, dtype=dtype, local_worker=local_worker,
              price_per_hour=price_per_hour, kv=kv, boxes=boxes,
              insecure_no_sandbox=insecure_no_sandbox, agents=agents,
              webhook_allow_private=webhook_allow_private)


@app.command()
def sim(
    scenario: Path = typer.Argument(..., exists=True, dir_okay=False,
                                    help="Scenario file (YAML), e.g. examples/scenarios/*.yaml."),
    json_out: bool = JsonOption,
    plots: Path | None = typer.Option(None, "--plots", help="Write PNG plots to this folder."),
) -> None:
    """Simulate a fleet under a virtual clock with the control plane's own placement and lease
    rules, comparing policies (naive, cost, forecast): goodput, $/Mtok, waste, completion
    times, deadline misses."""
    from rich.console import Console

    from minimill.sim.run import run
    from minimill.sim.scenario import ScenarioError, load

    err = Console(stderr=True)
    try:
        parsed = load(scenario)
    except ScenarioError as e:
        err.print(f"[red]error:[/red] {e}")
        raise SystemExit(2) from e
    report = run(parsed, progress=lambda line: err.print(line), plots=plots)
    if json_out:
        typer.echo(json.dumps(report))
        return
    typer.echo(f"{report['scenario']}: {report['sites']} sites, {report['requests']} requests, "
               f"{report['wall_seconds']} s; lost {report['lost_requests']}, duplicate "
               f"completions {report['duplicate_completions']}")
    columns = ("policy", "goodput tok/s", "$/Mtok", "wasted tok", "p50 s", "p99 s",
               "deadline misses", "expiries", "handbacks")
    rows = [(name, str(p["goodput_tok_s"]), str(p["usd_per_mtok"]), str(p["wasted_tokens"]),
             str(p["p50_completion_s"]), str(p["p99_completion_s"]), str(p["deadline_misses"]),
             str(p["lease_expiries"]), str(p["handbacks"]))
            for name, p in report["policies"].items()]
    print_table("minimill sim", columns, rows, left=("policy",))


@app.command()
def cost(
    usd_per_hour: float = typer.Option(..., "--usd-per-hour", help="What the chip (or site) "
                                       "costs per hour, in US dollars."),
    tokens_per_s: float | None = typer.Option(None, "--tokens-per-s",
                                              help="Its measured output tokens/s."),
    bench: Path | None = typer.Option(None, "--bench", help="Read tokens/s from a "
                                      "`minimill bench engine --json` output file."),
    uptime: float = typer.Option(1.0, help="Fraction of paid hours it is up and busy."),
    reference: list[str] = typer.Option([], "--reference", help="A price to compare with, "
                                        "NAME=USD_PER_MTOK (repeatable)."),
    json_out: bool = JsonOption,
) -> None:
    """$ per million and per trillion output tokens from a chip's $/hour and measured
    tokens/s, beside reference prices."""
    from rich.console import Console

    from minimill.sim.cost import CostError, bench_tokens_per_s, parse_reference
    from minimill.sim.cost import cost as cost_model

    err = Console(stderr=True)
    try:
        if (tokens_per_s is None) == (bench is None):
            raise CostError("give --tokens-per-s or --bench (one of them)")
        rate, source = tokens_per_s or 0.0, "given"
        if bench is not None:
            rate, source = bench_tokens_per_s(bench), str(bench)
        report = cost_model(usd_per_hour, rate, source, uptime,
                            [parse_reference(r) for r in reference])
    except CostError as e:
        err.print(f"[red]error:[/red] {e}")
        raise SystemExit(2) from e
    if json_out:
        typer.echo(json.dumps(report.to_json()))
        return
    typer.echo(f"${report.usd_per_hour:g}/h at {report.tokens_per_s:,.1f} tok/s "
               f"({report.tokens_per_s_source}), {report.uptime:.1%} up:")
    typer.echo(f"  ${report.usd_per_mtok:.6f} per million tokens, "
               f"${report.usd_per_ttok:,.2f} per trillion")
    for ref in report.references:
        typer.echo(f"  {ref.name}: ${ref.usd_per_mtok:g}/Mtok, {ref.ratio:g}x ours")


@app.command()
def worker(
    server: str = typer.Option(..., help="Control plane URL, e.g. http://host:8000."),
    site: str = typer.Option(..., help="This site's name."),
    token: str = typer.Option(..., envvar="MINIMILL_SITE_TOKEN", help="Site token."),
    price_per_hour: float | None = typer.Option(
        None, help="What this site costs in $/hour (default: as the site was registered; "
        "cost only, never what tenants are billed)."),
    chip: str | None = typer.Option(
        None, help="Chip name, for the registry (default: as the site was registered)."),
    engine: str = typer.Option("builtin", help="'builtin', an OpenAI-compatible base URL, "
                               "'none' (a box host serving no tokens), or 'fake:TOKENS_PER_S' "
                               "(a test double for fleet tests: no model, made-up tokens at "
                               "that site rate)."),
    model: str = typer.Option(DEFAULT_MODEL, help="Model to serve."),
    dtype: str = typer.Option("auto", help="Builtin engine dtype: " + DTYPE_HELP),
    kv_dtype: str = KvDtypeOption,
    capacity: int = typer.Option(256, help="Most requests in flight."),
    boxes: int = typer.Option(0, min=0, help="Boxes (sandboxes) this site holds at once."),
    box_dir: Path | None = typer.Option(None, help="Where box workspaces live (default: "
                                        "under the system temp directory); emptied at start."),
    box_snapshot_interval_s: float = typer.Option(
        30.0, min=0.1, help="Snapshot a changed box at most this often (what losing this "
        "site may cost a box)."),
    insecure_no_sandbox: bool = typer.Option(
        False, "--insecure-no-sandbox", help="Run boxes and agents' harnesses without "
        "bubblewrap isolation where it is unavailable (they then see this host's files)."),
    agents: int = typer.Option(0, min=0, help="Durable agents (harnesses) this site runs at "
                               "once, each in a sandboxed process."),
    box_max_memory_mb: int | None = BoxMaxMemoryOption,
    box_max_processes: int | None = BoxMaxProcessesOption,
    box_max_cpu_s: int | None = BoxMaxCpuOption,
    box_max_exec_s: int | None = BoxMaxExecOption,
    box_max_disk_mb: int | None = BoxMaxDiskOption,
    kv_cache_gb: float | None = KvCacheGbOption,
    kv_host_gb: float = KvHostGbOption,
    kv_flash_dir: str | None = KvFlashDirOption,
    kv_flash_gb: float = KvFlashGbOption,
    prefix_caching: bool = PrefixCachingOption,
    kv_prefault: bool = KvPrefaultOption,
) -> None:
    """Join a fleet: pull work from the control plane under leases and run it."""
    from minimill.boxes.host_setup import BoxOptions
    from minimill.site.worker import run_worker
    from minimill.transport.box_protocol import DEFAULT_BOX_CAPS, BoxLimits

    kv = _kv_options(kv_cache_gb, kv_host_gb, kv_flash_dir, kv_flash_gb, prefix_caching,
                     kv_dtype, kv_prefault)
    run_worker(server=server, site=site, token=token, price_per_hour=price_per_hour, chip=chip,
               engine=engine, model=model, dtype=dtype, capacity=capacity, kv=kv,
               boxes=BoxOptions(slots=boxes, box_dir=box_dir,
                                insecure_no_sandbox=insecure_no_sandbox,
                                snapshot_interval_s=box_snapshot_interval_s,
                                caps=BoxLimits.model_construct(
                                    memory_mb=box_max_memory_mb or DEFAULT_BOX_CAPS.memory_mb,
                                    max_processes=(box_max_processes
                                                   or DEFAULT_BOX_CAPS.max_processes),
                                    cpu_s=box_max_cpu_s or DEFAULT_BOX_CAPS.cpu_s,
                                    timeout_s=float(box_max_exec_s or DEFAULT_BOX_CAPS.timeout_s),
                                    disk_mb=box_max_disk_mb or DEFAULT_BOX_CAPS.disk_mb)),
               agents=agents)


if __name__ == "__main__":
    app()
