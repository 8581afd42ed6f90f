"""The operator's commands: `minimill keys ...`, `minimill prices ...` and
`minimill webhooks ...`. Keys and prices go to the running server with --operator-key, else
they open the store directly (--db), so they work whether or not `serve` is running; each says
which it used (operator_client.py)."""

from __future__ import annotations

import dataclasses
import json

import typer

from minimill.cli_options import DbOption, JsonOption, open_store_or_exit, print_table
from minimill.operator_client import OperatorKeyOption, ServerOption, call, fleet_store

keys_app = typer.Typer(help="API keys: tenants' and operators'.", no_args_is_help=True)
prices_app = typer.Typer(help="The price list: what tenants are billed per model and tier.",
                         no_args_is_help=True)
webhooks_app = typer.Typer(help="Webhook endpoints: where response and batch events go.",
                           no_args_is_help=True)


@keys_app.command("create")
def keys_create(
    tenant: str | None = typer.Option(None, "--tenant", help="Tenant name (created if new)."),
    operator: bool = typer.Option(False, "--operator",
                                  help="An operator key: sites, outages, prices, keys."),
    db: str | None = DbOption,
    operator_key: str | None = OperatorKeyOption,
    server: str = ServerOption,
) -> None:
    """Create an API key for a tenant, or an operator key, and print it (works whether or not
    serve is running)."""
    from minimill.control.keys import create_key, create_operator_key

    if operator == (tenant is not None):
        raise SystemExit("error: give --tenant NAME or --operator")
    if operator_key:
        typer.echo(call(server, operator_key, "POST", "/v1/keys",
                        json={"tenant": tenant, "operator": operator})["key"])
        return
    with fleet_store(db, reading=False) as store:
        typer.echo(create_operator_key(store) if tenant is None else create_key(store, tenant))


@keys_app.command("revoke")
def keys_revoke(
    key: str = typer.Argument(..., help="The key's id (key_..., opk_...), the key itself, or "
                              "its first characters (see `minimill keys list`)."),
    db: str | None = DbOption,
) -> None:
    """Revoke a tenant's or an operator's key: every process sharing the store refuses it from
    now on (401)."""
    import time

    from minimill.control.keys import revoke_key

    with open_store_or_exit(db) as store:
        record = revoke_key(store, key, time.time())
    owner = f"tenant {record.tenant}" if record.tenant is not None else "operator"
    typer.echo(f"revoked {record.id} ({owner}, {record.hint or 'no hint'}...)")


@keys_app.command("list")
def keys_list(
    tenant: str | None = typer.Option(None, "--tenant", help="Only this tenant's keys."),
    json_out: bool = JsonOption,
    db: str | None = DbOption,
) -> None:
    """Every key: its id, owner, first characters, and whether it was revoked (never the key)."""
    from dataclasses import asdict

    from minimill.control.keys import list_keys

    with fleet_store(db, reading=True) as store:
        records = list_keys(store, tenant)
    if json_out:
        typer.echo(json.dumps([asdict(r) for r in records], indent=2))
        return
    print_table("minimill keys", ("id", "owner", "starts with", "revoked"), [
        (r.id, f"tenant {r.tenant}" if r.tenant is not None else "operator",
         f"{r.hint}..." if r.hint else "-", "yes" if r.revoked_at is not None else "no")
        for r in records], left=("id", "owner", "starts with"))


TierOption = typer.Option("realtime", "--tier", help="realtime or background (default: "
                          "realtime; background is realtime times the discount unless set).")


@prices_app.command("set")
def prices_set(
    model: str = typer.Argument(..., help="Model name, or '*' for the default entry."),
    input_price: float = typer.Option(..., "--input", help="$ per million input tokens."),
    output_price: float = typer.Option(..., "--output", help="$ per million output tokens."),
    cached_input: float | None = typer.Option(
        None, "--cached-input", help="$ per million cached input tokens (default: --input)."),
    tier: str = TierOption,
    db: str | None = DbOption,
    operator_key: str | None = OperatorKeyOption,
    server: str = ServerOption,
) -> None:
    """Set what tenants are billed for a model and tier (create or replace the entry)."""
    from minimill.control.prices import set_price

    if operator_key:
        p = call(server, operator_key, "POST", "/v1/prices", json={
            "model": model, "tier": tier, "input_usd_per_mtok": input_price,
            "output_usd_per_mtok": output_price, "cached_input_usd_per_mtok": cached_input})
    else:
        with fleet_store(db, reading=False) as store:
            quoted = set_price(store, model, tier, input_price, output_price, cached_input)
        p = {"model": quoted.model, "tier": quoted.tier.value,
             **dataclasses.asdict(quoted.price)}
    typer.echo(f"{p['model']} {p['tier']}: input {p['input_usd_per_mtok']:g}, cached input "
               f"{p['cached_input_usd_per_mtok']:g}, output {p['output_usd_per_mtok']:g} $/Mtok")


@prices_app.command("delete")
def prices_delete(model: str = typer.Argument(..., help="Model name, or '*'."),
                  tier: str = TierOption, db: str | None = DbOption,
                  operator_key: str | None = OperatorKeyOption,
                  server: str = ServerOption) -> None:
    """Remove an entry: the model and tier fall back to the next rule (see prices list)."""
    from minimill.control.prices import delete_price

    if operator_key:
        call(server, operator_key, "DELETE", "/v1/prices", params={"model": model, "tier": tier})
    else:
        with fleet_store(db, reading=False) as store:
            delete_price(store, model, tier)
    typer.echo(f"{model} {tier}: entry removed")


@prices_app.command("list")
def prices_list(db: str | None = DbOption, operator_key: str | None = OperatorKeyOption,
                server: str = ServerOption, json_out: bool = JsonOption) -> None:
    """Show what tenants are billed: the default entry and each listed model, both tiers."""
    from minimill.api.settings import Settings
    from minimill.control.prices import read_price_list

    if operator_key:
        answer = call(server, operator_key, "GET", "/v1/prices")
        factor, table = answer["background_price_factor"], answer["data"]
    else:
        factor = Settings().background_price_factor
        with fleet_store(db, reading=True) as store:
            quoted = read_price_list(store).table(factor)
        table = [{"model": q.model, "tier": q.tier.value, "entry": q.entry,
                  "discounted": q.discounted, **dataclasses.asdict(q.price)} for q in quoted]
    if json_out:
        typer.echo(json.dumps([{k: q[k] for k in PRICE_FIELDS} for q in table], indent=2))
        return
    rows = [(q["model"], q["tier"], f"{q['input_usd_per_mtok']:g}",
             f"{q['cached_input_usd_per_mtok']:g}", f"{q['output_usd_per_mtok']:g}",
             (q["entry"] or "built-in") + (f" x {factor:g}" if q["discounted"] else ""))
            for q in table]
    print_table("minimill prices ($ per million tokens)",
           ("model", "tier", "input", "cached input", "output", "from entry"), rows,
           left=("model", "tier", "from entry"))


PRICE_FIELDS = ("model", "tier", "entry", "discounted", "input_usd_per_mtok",
                "cached_input_usd_per_mtok", "output_usd_per_mtok")


@webhooks_app.command("create")
def webhooks_create(
    url: str = typer.Argument(..., help="Where events are posted (http:// or https://)."),
    tenant: str | None = typer.Option(None, "--tenant", help="The tenant whose events it gets."),
    fleet: bool = typer.Option(False, "--fleet", help="Every tenant's events (the operator's)."),
    event: list[str] = typer.Option(
        [], "--event", help="An event type, repeatable (default: all): response.completed, "
        "response.failed, response.cancelled, response.incomplete, batch.completed, "
        "batch.failed, batch.expired, batch.cancelled."),
    name: str | None = typer.Option(None, help="A name for it (default: the URL)."),
    allow_private: bool = typer.Option(
        False, "--allow-private", envvar="MINIMILL_WEBHOOK_ALLOW_PRIVATE",
        help="Allow a URL to a loopback, link-local or private address (the control plane "
        "delivers there only if it allows them too)."),
    db: str | None = DbOption,
) -> None:
    """Register a webhook endpoint and print its signing secret (shown once)."""
    from minimill.control.keys import ensure_tenant
    from minimill.control.webhooks import EVENT_TYPES, create_endpoint

    if fleet == (tenant is not None):
        raise SystemExit("error: give --tenant NAME or --fleet")
    with open_store_or_exit(db) as store:
        owner = ensure_tenant(store, tenant).id if tenant is not None else None
        endpoint, secret = create_endpoint(store, owner, name or url, url,
                                           list(event) or list(EVENT_TYPES),
                                           allow_private=allow_private)
    typer.echo(f"{endpoint.id} {endpoint.url} ({', '.join(endpoint.event_types)})")
    typer.echo(f"signing secret (shown once): {secret}")


@webhooks_app.command("list")
def webhooks_list(db: str | None = DbOption,
                  json_out: bool = JsonOption) -> None:
    """Show every endpoint: whose events it gets, and its deliveries so far."""
    from minimill.control.webhook_events import delivery_counts
    from minimill.control.webhooks import EVENT_TYPES, all_endpoints

    with fleet_store(db, reading=True) as store:
        endpoints, counts = all_endpoints(store), delivery_counts(store)
    if json_out:
        typer.echo(json.dumps([
            {"id": e.id, "tenant": tenant_name, "name": e.name, "url": e.url,
             "event_types": list(e.event_types), "secret": e.secret_hint,
             "deliveries": counts.get(e.id, {})} for e, tenant_name in endpoints], indent=2))
        return
    rows = [(e.id, tenant_name or "(fleet)", e.url,
             "all" if set(e.event_types) == set(EVENT_TYPES) else ",".join(e.event_types),
             *(str(counts.get(e.id, {}).get(s, 0)) for s in ("pending", "delivered", "failed")))
            for e, tenant_name in endpoints]
    print_table("minimill webhooks", ("id", "tenant", "url", "events", "pending", "delivered",
                                 "failed"), rows, left=("id", "tenant", "url", "events"))


@webhooks_app.command("delete")
def webhooks_delete(endpoint_id: str = typer.Argument(..., help="The endpoint's id (we_...)."),
                    db: str | None = DbOption) -> None:
    """Delete an endpoint; its undelivered events are dropped."""
    from minimill.control.webhooks import delete_any_endpoint

    with open_store_or_exit(db) as store:
        delete_any_endpoint(store, endpoint_id)
    typer.echo(f"{endpoint_id} deleted")
