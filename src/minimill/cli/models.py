"""`minimill models ...`: what the model cache holds."""

from __future__ import annotations

import json

import typer

from minimill.cli.options import JsonOption, print_table

models_app = typer.Typer(help="Models in the model cache.", no_args_is_help=True)


def _billions(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.0f}M"


@models_app.command("list")
def list_models(json_out: bool = JsonOption) -> None:
    """Every cached model: architecture, parameters (total and active per token) and size."""
    from dataclasses import asdict

    from minimill.models.catalog import list_cached

    found, problems = list_cached()
    if json_out:
        print(json.dumps({"models": [asdict(m) | {"path": str(m.path)} for m in found],
                          "unreadable": problems}))
        return
    print_table("models", ("name", "format", "architecture", "params", "active", "size"),
                [(m.name, m.format, m.architecture, _billions(m.params_total),
                  _billions(m.params_active), f"{m.size_bytes / 2**30:.2f} GiB")
                 for m in found], left=("name", "format", "architecture"))
    for line in problems:
        typer.echo(f"unreadable: {line}", err=True)
