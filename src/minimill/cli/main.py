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
    JsonOption,
    KvDtypeOption,
    ModelOption,
    print_table,
)
from minimill.cli.processes import serve, stage, worker
from minimill.cli.sites import sites_app
from minimill.cli.tenants import tenants_app

if TYPE_CHECKING:
    pass

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
LOGGING_COMMANDS = ("serve", "worker", "stage")


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
# The two commands that run a factory's processes (cli/processes.py).
app.command()(serve)
app.command()(worker)
app.command()(stage)


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

    from minimill.engine.llm import LLM
    from minimill.engine.loading import load_with_config
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


if __name__ == "__main__":
    app()
