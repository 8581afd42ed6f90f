"""`minimill batch ...`: a tenant's Batch API jobs through the HTTP API (batch_client.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from minimill.cli_options import ApiKeyOption, BaseUrlOption

batch_app = typer.Typer(help="Submit and follow Batch API jobs.", no_args_is_help=True)




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
