"""`minimill tenants ...`: the operator's view of tenants' limits, and their overrides. The
commands open the store directly (--db), so they work whether or not `serve` is running; a
running control plane reads a change at the tenant's next request."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import typer

from minimill.cli_options import DbOption, JsonOption, open_store_or_exit, print_table

if TYPE_CHECKING:
    from minimill.control.tenant_limits import TenantLimits, TenantLimitsView

tenants_app = typer.Typer(help="Tenants' rate limits, quotas, fair-share weight and prefix "
                          "cache sharing.", no_args_is_help=True)

_LIMIT_HELP = "A whole number, 'unlimited', or 'default' (the operator's, from serve --tenant-*)."


def _defaults() -> TenantLimits:
    from minimill.api.settings import Settings

    return Settings().tenant_limits()


def _show(views: list[TenantLimitsView], json_out: bool) -> None:
    from minimill.control.tenant_limits import FIELD_NAMES, as_dict

    if json_out:
        typer.echo(json.dumps([{"tenant": v.tenant, **as_dict(v.limits),
                                "overrides": v.overrides} for v in views], indent=2))
        return

    def cell(view: TenantLimitsView, name: str) -> str:
        value = getattr(view.limits, name)
        text = "-" if value is None else (("yes" if value else "no") if isinstance(value, bool)
                                          else f"{value:g}")
        return text + ("*" if name in view.overrides else "")

    print_table("minimill tenants (- unlimited, * the tenant's own)",
                ("tenant", "rpm", "tpm", "realtime", "boxes", "agents", "stored bytes",
                 "weight", "share prefixes"),
                [(v.tenant, *(cell(v, n) for n in FIELD_NAMES)) for v in views],
                left=("tenant",))


@tenants_app.command("list")
def tenants_list(json_out: bool = JsonOption, db: str | None = DbOption) -> None:
    """Every tenant's limits in effect ('-': unlimited; '*': its own, not the default)."""
    from minimill.control.tenant_limits import list_views

    with open_store_or_exit(db) as store:
        views = list_views(store, _defaults())
    _show(views, json_out)


@tenants_app.command("show")
def tenants_show(name: str = typer.Argument(..., help="The tenant's name."),
                 json_out: bool = JsonOption, db: str | None = DbOption) -> None:
    """One tenant's limits in effect, and which are its own."""
    from minimill.control.errors import ControlError
    from minimill.control.tenant_limits import view

    with open_store_or_exit(db) as store:
        try:
            found = view(store, name, _defaults())
        except ControlError as exc:
            raise SystemExit(f"error: {exc.message}") from None
    _show([found], json_out)


def _limit_value(option: str, text: str) -> Any:
    """A limit option's value: an int, None (unlimited), or "default"."""
    if text == "default":
        return "default"
    if text == "unlimited":
        return None
    if not text.isdigit():
        raise typer.BadParameter(f"{text!r}: {_LIMIT_HELP}", param_hint=f"--{option}")
    return int(text)


@tenants_app.command("set")
def tenants_set(
    name: str = typer.Argument(..., help="The tenant's name."),
    requests_per_minute: str | None = typer.Option(None, "--requests-per-minute",
                                                   help="Requests per minute. " + _LIMIT_HELP),
    tokens_per_minute: str | None = typer.Option(
        None, "--tokens-per-minute", help="Tokens per minute (prompt plus max_tokens). "
        + _LIMIT_HELP),
    max_concurrent_realtime: str | None = typer.Option(
        None, "--max-concurrent-realtime", help="Realtime requests in progress at once. "
        + _LIMIT_HELP),
    max_boxes: str | None = typer.Option(None, "--max-boxes",
                                         help="Boxes not deleted. " + _LIMIT_HELP),
    max_agents: str | None = typer.Option(None, "--max-agents",
                                          help="Agents not finished. " + _LIMIT_HELP),
    max_stored_bytes: str | None = typer.Option(None, "--max-stored-bytes",
                                                help="Bytes of files kept. " + _LIMIT_HELP),
    weight: float | None = typer.Option(None, "--weight", min=0.001, max=1000,
                                        help="Share of service in placement while tenants "
                                        "compete (default 1; 2 gets twice the service)."),
    share_prefix_cache: bool | None = typer.Option(
        None, "--share-prefix-cache/--own-prefix-cache",
        help="Let its cached prompt prefixes serve other tenants (and theirs serve it), or "
        "keep them its own (the default)."),
    json_out: bool = JsonOption,
    db: str | None = DbOption,
) -> None:
    """Give a tenant its own limits; 'default' hands one back to the operator's default."""
    from minimill.control.errors import ControlError
    from minimill.control.tenant_limits import set_overrides

    given = {"requests_per_minute": requests_per_minute, "tokens_per_minute": tokens_per_minute,
             "max_concurrent_realtime": max_concurrent_realtime, "max_boxes": max_boxes,
             "max_agents": max_agents, "max_stored_bytes": max_stored_bytes}
    changes: dict[str, Any] = {}
    reset: list[str] = []
    for field, text in given.items():
        if text is None:
            continue
        value = _limit_value(field.replace("_", "-"), text)
        if value == "default":
            reset.append(field)
        else:
            changes[field] = value
    if weight is not None:
        changes["weight"] = weight
    if share_prefix_cache is not None:
        changes["share_prefix_cache"] = share_prefix_cache
    if not changes and not reset:
        raise SystemExit("error: give at least one limit to set (see --help)")
    with open_store_or_exit(db) as store:
        try:
            found = set_overrides(store, name, changes, reset, _defaults())
        except ControlError as exc:
            raise SystemExit(f"error: {exc.message}") from None
    _show([found], json_out)
