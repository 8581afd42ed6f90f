"""`minimill sites ...`: the fleet's sites, their outages and their price schedules."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from minimill.cli_options import (
    DbOption,
    JsonOption,
    money,
    number_or_dash,
    open_store_or_exit,
    print_table,
)
from minimill.operator_client import OperatorKeyOption, ServerOption, call, fleet_store

sites_app = typer.Typer(help="Sites of the fleet (mini mills).", no_args_is_help=True)
outage_app = typer.Typer(help="Planned or forecast outages of a site.", no_args_is_help=True)
site_price_app = typer.Typer(help="A site's price schedule (hourly $/h).", no_args_is_help=True)
sites_app.add_typer(outage_app, name="outage")
sites_app.add_typer(site_price_app, name="price")


@sites_app.command("create")
def sites_create(
    name: str = typer.Argument(..., help="Site name."),
    price_per_hour: float = typer.Option(0.10, help="What the site costs in $/hour."),
    chip: str = typer.Option("cpu", help="Chip name."),
    serves: str = typer.Option(
        "tokens", "--serves", help="What its token may do, comma-separated: tokens (lease "
        "requests), boxes (hold tenants' boxes), agents (run tenants' harnesses). Default: "
        "tokens only."),
    replace: bool = typer.Option(False, "--replace", help="The site exists: give it a new "
                                 "token (the old one stops working), price, chip and scopes."),
    db: str | None = DbOption,
) -> None:
    """Register a site and print its token."""
    from minimill.control.sites import create_site, parse_scopes

    with open_store_or_exit(db) as store:
        typer.echo(create_site(store, name, price_per_hour, chip, replace=replace,
                               serves=parse_scopes(serves)))


@sites_app.command("list")
def sites_list(db: str | None = DbOption, operator_key: str | None = OperatorKeyOption,
               server: str = ServerOption, json_out: bool = JsonOption) -> None:
    """Show every site: health, throughput (reported and measured), cost, billed, margin;
    from the running server with --operator-key, else from the store."""
    import time
    from dataclasses import asdict

    from minimill.control.site_view import list_sites

    if operator_key:
        statuses = call(server, operator_key, "GET", "/v1/sites")["data"]
    else:
        with fleet_store(db, reading=True) as store:
            statuses = [asdict(s) for s in list_sites(store, time.time())]
    if json_out:
        typer.echo(json.dumps(statuses, indent=2))
        return
    if not statuses:
        typer.echo("no sites registered (minimill sites create NAME)")
        return
    columns = ("site", "status", "chip", "serves", "$/h now", "tok/s said", "tok/s measured",
               "uptime", "cost $/Mtok", "eff $/Mtok", "in flight", "free", "leases", "expired",
               "stale", "usage refused", "wasted tok", "billed $", "cost $", "margin $",
               "next outage (UTC)")
    rows = [(s["name"], s["status"], s["chip"], s["serves"], f"{s['price_now']:.4f}",
             number_or_dash(s["tokens_per_s"], ".1f"),
             number_or_dash(s["measured_tokens_per_s"], ".1f"),
             number_or_dash(s["uptime"], ".1%"), number_or_dash(s["cost_usd_per_mtok"], ".4f"),
             f"{s['effective_usd_per_mtok']:.4f}", str(s["in_flight"]),
             str(s["free_capacity"]), str(s["leases_granted"]), str(s["leases_expired"]),
             str(s["stale_completions"]), str(s["usage_rejections"]), str(s["wasted_tokens"]),
             money(s["billed_usd"]), money(s["cost_usd"]), money(s["margin_usd"]),
             _next_outage(s["outages"]))
            for s in statuses]
    print_table("minimill sites", columns, rows, left=("site", "status", "chip", "serves",
                                                   "next outage (UTC)"))
    billed = sum(s["billed_usd"] for s in statuses)
    cost = sum(s["cost_usd"] for s in statuses)
    typer.echo(f"billed ${money(billed)}, cost ${money(cost)}, margin ${money(billed - cost)}")


@outage_app.command("add")
def outage_add(
    site: str = typer.Argument(..., help="Site name."),
    start: str = typer.Option(..., "--from", help="Start, ISO 8601."),
    end: str = typer.Option(..., "--to", help="End, ISO 8601."),
    db: str | None = DbOption,
    operator_key: str | None = OperatorKeyOption,
    server: str = ServerOption,
) -> None:
    """Announce a planned or forecast outage of a site."""
    from minimill.control.sites import add_outage, parse_time

    start_at, end_at = parse_time(start, "from"), parse_time(end, "to")
    if operator_key:
        outage_id = call(server, operator_key, "POST", f"/v1/sites/{site}/outages",
                         json={"start_at": start_at, "end_at": end_at})["id"]
    else:
        with fleet_store(db, reading=False) as store:
            outage_id = add_outage(store, site, start_at, end_at)
    typer.echo(f"outage {outage_id} of {site} from {start} to {end} recorded")


@site_price_app.command("set")
def site_price_set(
    site: str = typer.Argument(..., help="Site name."),
    schedule: Path | None = typer.Option(
        None, "--schedule", help="JSON or YAML file: a list of hourly $/h from the start of "
        "today (UTC), repeating, or {start_at, hourly_usd, repeat}."),
    clear: bool = typer.Option(False, "--clear", help="Back to the flat price_per_hour."),
    db: str | None = DbOption,
) -> None:
    """Make a site's price follow an hourly schedule; background work with a deadline is
    placed into its cheapest hours that still meet it (realtime is never deferred)."""
    import time

    import yaml

    from minimill.control.price_schedule import parse, utc_day_start
    from minimill.control.sites import set_price_schedule

    if clear == (schedule is not None):
        raise typer.BadParameter("give --schedule FILE or --clear")
    parsed = None
    if schedule is not None:
        try:
            parsed = parse(yaml.safe_load(schedule.read_text()), utc_day_start(time.time()))
        except (OSError, ValueError, yaml.YAMLError) as e:
            raise typer.BadParameter(f"{schedule}: {e}") from e
    with open_store_or_exit(db) as store:
        set_price_schedule(store, site, parsed)
    typer.echo(f"{site}: flat price" if parsed is None else
               f"{site}: {len(parsed.hourly_usd)} hourly prices from {_moment(parsed.start_at)}"
               f"{', repeating' if parsed.repeat else ''}")


@outage_app.command("list")
def outage_list(
    site: str | None = typer.Argument(None, help="Only this site's outages."),
    include_past: bool = typer.Option(False, "--all", help="Past outages too."),
    json_out: bool = JsonOption,
    db: str | None = DbOption,
    operator_key: str | None = OperatorKeyOption,
    server: str = ServerOption,
) -> None:
    """List announced outages (those not over yet) with their ids."""
    import time
    from dataclasses import asdict

    from minimill.control.sites import list_outages

    if operator_key:
        if site is None:
            raise typer.BadParameter("with --operator-key, name the SITE", param_hint="SITE")
        records = call(server, operator_key, "GET", f"/v1/sites/{site}/outages",
                       params={"include_past": include_past})["data"]
    else:
        with fleet_store(db, reading=True) as store:
            records = [asdict(r) for r in list_outages(store, time.time(), site,
                                                       include_past=include_past)]
    if json_out:
        typer.echo(json.dumps(records, indent=2))
        return
    if not records:
        typer.echo("no outages announced" + (f" for {site}" if site else ""))
        return
    typer.echo(f"{'id':>6}  site  from to (UTC)")
    for r in records:
        typer.echo(f"{r['id']:>6}  {r['site']}  {_moment(r['start_at'])} to "
                   f"{_moment(r['end_at'])} UTC")


@outage_app.command("remove")
def outage_remove(
    outage_id: int = typer.Argument(..., help="The outage's id (see `sites outage list`)."),
    db: str | None = DbOption,
) -> None:
    """Withdraw an announced outage: the site gets work for that time again."""
    from minimill.control.sites import remove_outage

    with open_store_or_exit(db) as store:
        record = remove_outage(store, outage_id)
    typer.echo(f"outage {record.id} of {record.site} ({_moment(record.start_at)} to "
               f"{_moment(record.end_at)} UTC) removed")


def _next_outage(outages: list[dict[str, float]]) -> str:
    from datetime import UTC, datetime

    if not outages:
        return "-"
    first = min(outages, key=lambda o: o["start_at"])

    def moment(t: float) -> str:
        return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M")

    return f"{moment(first['start_at'])} to {moment(first['end_at'])}"


def _moment(t: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S")
