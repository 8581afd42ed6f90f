"""Options and helpers the `minimill` command groups share (cli.py, admin_cli.py,
bench_cli.py, sites_cli.py): --json, model and dtype options, the store a command opens, and
tables."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import typer

from minimill.client_env import API_KEY_VARS, BASE_URL_VARS, DEFAULT_BASE_URL

if TYPE_CHECKING:
    from minimill.control.store import Store

DEFAULT_MODEL = "smollm2-135m"
# What serve's local site costs by default: the machine one already has, drawing ~100 W at
# $0.10/kWh. At the default model's single-stream rate on a CPU (~20 output tokens/s) that is
# ~$0.14 per million output tokens, below the built-in background price (control/prices.py's
# DEFAULT_PRICE): the first dashboard shows no negative margin (tests/control/
# test_default_margin.py holds the two together).
LOCAL_SITE_USD_PER_HOUR = 0.01


DTYPE_HELP = ("auto (bfloat16 where the chip computes it natively: GPUs, CPUs with AVX-512 BF16 "
              "or AMX; else float32), bfloat16, float16 or float32.")


JsonOption = typer.Option(False, "--json", help="Print one JSON object.")
# Every client command finds the server one way (client_env.py).
BaseUrlOption = typer.Option(DEFAULT_BASE_URL, envvar=list(BASE_URL_VARS),
                             help="API base URL.", show_envvar=True)
ApiKeyOption = typer.Option(..., envvar=list(API_KEY_VARS), help="API key.", show_envvar=True)

ModelOption = typer.Option(DEFAULT_MODEL, help="Model name or path.")
EngineDtypeOption = typer.Option("auto", help="Engine dtype: " + DTYPE_HELP)

DbOption = typer.Option(None, "--db", help="Store URL (sqlite:///... or postgresql://...). "
                        "Default: SQLite under MINIMILL_HOME.")


KV_DTYPES = ("auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32", "int8",
             "int4")


def check_kv_dtype(value: str) -> str:
    """A KV dtype the engine knows, refused at once rather than by a worker that restarts."""
    if value not in KV_DTYPES:
        raise typer.BadParameter(f"must be one of {', '.join(KV_DTYPES)}")
    return value


KV_DTYPE_HELP = ("KV cache dtype: auto (the engine dtype), bf16, fp32, int8 (per-token "
                 "asymmetric scales: about half the bytes, twice the sequences), or int4 "
                 "(64-token groups, keys per channel, values per token, the open block in "
                 "int8: about 3.5x fewer bytes).")


@contextlib.contextmanager
def open_store_or_exit(db: str | None) -> Iterator[Store]:
    """The store at `db`; its errors and domain errors end the command with a message."""
    from minimill.control.errors import ControlError
    from minimill.control.store import StoreError, open_store

    try:
        store = open_store(db)
    except StoreError as exc:
        raise SystemExit(f"error: {exc}") from None
    try:
        yield store
    except ControlError as exc:
        raise SystemExit(f"error: {exc.message}") from None
    finally:
        store.close()


def error_line(message: str, status: int | None = None, code: str | None = None,
               request_id: str | None = None) -> str:
    """An API error in one line: the message, then what names it (HTTP status, code, the
    request id the server logged it under)."""
    named = [f"HTTP {status}" if status else "", code or "",
             f"request {request_id}" if request_id else ""]
    text = " ".join(message.split())  # one line, whatever the server put in it
    shown = ", ".join(n for n in named if n)
    return f"{text} ({shown})" if shown else text


def money(usd: float) -> str:
    """Dollars for people: cents where the sum is a dollar or more, else four significant
    digits (the API keeps exact values)."""
    from decimal import Decimal

    if abs(usd) >= 1:
        return f"{usd:,.2f}"
    return format(Decimal(f"{usd:.4g}"), "f")  # 6.650000000000001e-06 -> 0.00000665


def number_or_dash(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(title: str, columns: tuple[str, ...], rows: Sequence[Sequence[str]],
           left: tuple[str, ...]) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    table = Table(title=title or None)
    for column in columns:
        table.add_column(column, no_wrap=True, justify="left" if column in left else "right")
    for row in rows:
        table.add_row(*row)
    # Piped output is not cut to 80 columns: every row stays on one line.
    Console(width=None if sys.stdout.isatty() else 300).print(table)

KvDtypeOption = typer.Option("auto", help=KV_DTYPE_HELP, callback=check_kv_dtype)


def _cap_option(name: str, unit: str) -> Any:
    env = "MINIMILL_BOX_MAX_" + name.upper().replace("-", "_")
    return typer.Option(None, f"--box-max-{name}", envvar=env, min=1,
                        help=f"The most {unit} a tenant may ask for a box (a 400 past it); "
                        "default: minimill's own cap.")


BoxMaxMemoryOption = _cap_option("memory-mb", "memory (MiB per process)")
BoxMaxProcessesOption = _cap_option("processes", "processes at once")
BoxMaxCpuOption = _cap_option("cpu-s", "CPU seconds per exec")
BoxMaxExecOption = _cap_option("exec-s", "wall-clock seconds per exec")
BoxMaxDiskOption = _cap_option("disk-mb", "workspace disk (MiB)")


def box_caps(memory_mb: int | None, processes: int | None, cpu_s: int | None,
             exec_s: int | None, disk_mb: int | None) -> dict[str, str]:
    """The caps given, as the MINIMILL_BOX_MAX_* variables that the control plane's settings
    and a local worker both read."""
    given = {"MEMORY_MB": memory_mb, "PROCESSES": processes, "CPU_S": cpu_s,
             "EXEC_S": exec_s, "DISK_MB": disk_mb}
    return {f"MINIMILL_BOX_MAX_{k}": str(v) for k, v in given.items() if v is not None}
