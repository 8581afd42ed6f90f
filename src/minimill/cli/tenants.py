"""`minimill tenants ...`: the operator's view of tenants' limits, and their overrides. With
--operator-key the commands ask the running server (its /v1/tenants routes); otherwise they
open the store (--db), which works whether or not `serve` is running: a running control plane
reads a change at the tenant's next request. Each says which server or store it used."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import typer

from minimill.cli.operator import OperatorKeyOption, ServerOption, call, fleet_store
from minimill.cli.options import DbOption, JsonOption, print_table

if TYPE_CHECKING:
    from minimill.control.tenant_limits import TenantLimits, TenantLimitsView

tenants_app = typer.Typer(help="Tenants' rate limits, quotas, fair-share weight and prefix "
                          "cache sharing.", no_args_is_help=True)

_LIMIT_HELP = "A whole number, 'unlimited', or 'default' (the operator's, from serve --tenant-*)."


def _defaults() -> TenantLimits:
    from minimill.api.settings import Settings

    return Settings().tenant_limits()


def _as_dict(view: TenantLimitsView) -> dict[str, Any]:
    """A view as the /v1/tenants routes answer it."""
    from minimill.control.tenant_limits import as_dict

    return {"tenant": view.tenant, **as_dict(view.limits), "overrides": view.overrides}


def _show(found: list[dict[str, Any]], json_out: bool) -> None:
    from minimill.control.tenant_limits import FIELD_NAMES

    if json_out:
        typer.echo(json.dumps([{k: v for k, v in t.items() if k != "object"} for t in found],
                              indent=2))
        return
    if not found:
        typer.echo("no tenants (minimill keys create NAME)")
        return

    def cell(tenant: dict[str, Any], name: str) -> str:
        value = tenant[name]
        text = "-" if value is None else (("yes" if value else "no") if isinstance(value, bool)
                                          else f"{value:g}")
        return text + ("*" if name in tenant["overrides"] else "")

    print_table("minimill tenants (- unlimited, * the tenant's own)",
                ("tenant", "rpm", "tpm", "realtime", "boxes", "agents", "stored bytes",
                 "weight", "share prefixes"),
                [(t["tenant"], *(cell(t, n) for n in FIELD_NAMES)) for t in found],
                left=("tenant",))


@tenants_app.command("list")
def tenants_list(json_out: bool = JsonOption, db: str | None = DbOption,
                 operator_key: str | None = OperatorKeyOption,
                 server: str = ServerOption) -> None:
    """Every tenant's limits in effect ('-': unlimited; '*': its own, not the default)."""
    from minimill.control.tenant_limits import list_views

    if operator_key:
        found = call(server, operator_key, "GET", "/v1/tenants")["data"]
    else:
        with fleet_store(db, reading=True) as store:
            found = [_as_dict(v) for v in list_views(store, _defaults())]
    _show(found, json_out)


@tenants_app.command("show")
def tenants_show(name: str = typer.Argument(..., help="The tenant's name."),
                 json_out: bool = JsonOption, db: str | None = DbOption,
                 operator_key: str | None = OperatorKeyOption,
                 server: str = ServerOption) -> None:
    """One tenant's limits in effect, and which are its own."""
    from urllib.parse import quote

    from minimill.control.errors import ControlError
    from minimill.control.tenant_limits import view

    if operator_key:
        _show([call(server, operator_key, "GET", f"/v1/tenants/{quote(name, safe='')}/limits")],
              json_out)
        return
    with fleet_store(db, reading=True) as store:
        try:
            found = view(store, name, _defaults())
        except ControlError as exc:
            raise SystemExit(f"error: {exc.message}") from None
    _show([_as_dict(found)], json_out)


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
    operator_key: str | None = OperatorKeyOption,
    server: str = ServerOption,
) -> None:
    """Give a tenant its own limits; 'default' hands one back to the operator's default."""
    from urllib.parse import quote

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
    if operator_key:
        _show([call(server, operator_key, "POST", f"/v1/tenants/{quote(name, safe='')}/limits",
                    json={**changes, "reset": reset})], json_out)
        return
    with fleet_store(db, reading=False) as store:
        try:
            found = set_overrides(store, name, changes, reset, _defaults())
        except ControlError as exc:
            raise SystemExit(f"error: {exc.message}") from None
    _show([_as_dict(found)], json_out)
