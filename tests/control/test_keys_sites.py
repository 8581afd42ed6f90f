"""Tenants, API keys, sites and outages; and the `keys`/`sites` commands as real processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from minimill.control.errors import ConflictError, InvalidRequestError, NotFoundError
from minimill.control.keys import authenticate, create_key, ensure_tenant
from minimill.control.leases import lease
from minimill.control.site_view import list_sites
from minimill.control.sites import (
    add_outage,
    authenticate_site,
    create_site,
    parse_time,
    touch_site,
)
from minimill.control.store import Store
from minimill.control.tables import api_keys, sites
from minimill.transport.protocol import LeaseRequest


def test_keys_authenticate_their_tenant_and_are_stored_hashed(store: Store) -> None:
    a1, a2, b = create_key(store, "acme"), create_key(store, "acme"), create_key(store, "beta")
    assert len({a1, a2, b}) == 3
    ta1, ta2, tb = authenticate(store, a1), authenticate(store, a2), authenticate(store, b)
    assert ta1 is not None and ta1 == ta2 and ta1.name == "acme"
    assert tb is not None and tb.name == "beta"
    assert authenticate(store, a1 + "x") is None and authenticate(store, "") is None
    with store.read() as conn:
        stored = [str(v) for row in conn.execute(select(api_keys)) for v in row]
    assert not any(a1 in v or a1[3:] in v for v in stored)
    assert ensure_tenant(store, "acme") == ta1
    with pytest.raises(InvalidRequestError):
        ensure_tenant(store, "  ")


def test_sites_tokens_and_replacement(store: Store) -> None:
    token = create_site(store, "edge-1", 0.2, "rx7900")
    found = authenticate_site(store, token)
    assert found is not None and (found.name, found.chip, found.price_per_hour) == (
        "edge-1", "rx7900", 0.2)
    with pytest.raises(ConflictError):
        create_site(store, "edge-1", 0.2)
    with pytest.raises(InvalidRequestError):
        create_site(store, "edge-2", -1.0)
    fresh = create_site(store, "edge-1", 0.3, "h100", replace=True)
    assert authenticate_site(store, token) is None
    replaced = authenticate_site(store, fresh)
    assert replaced is not None and replaced.id == found.id and replaced.price_per_hour == 0.3
    with store.read() as conn:
        assert fresh not in str(conn.execute(select(sites)).all())


def test_uptime_status_and_outages(store: Store) -> None:
    token = create_site(store, "solar", 0.05)
    site = authenticate_site(store, token)
    assert site is not None
    t0 = 1_000_000.0
    assert list_sites(store, t0)[0].status == "new"
    with store.write() as conn:
        for t in (t0, t0 + 10, t0 + 20, t0 + 200, t0 + 210):  # a 180 s gap is down time
            touch_site(conn, site.id, t, up_grace_s=30, tokens_per_s=80.0)
    (status,) = list_sites(store, t0 + 210)
    assert status.uptime == pytest.approx(30 / 210) and status.tokens_per_s == 80.0
    assert status.status == "online" and status.usd_per_mtok == pytest.approx(
        0.05 / 3600 / 80 * 1e6)
    assert list_sites(store, t0 + 1000)[0].status == "offline"
    add_outage(store, "solar", t0 + 300, t0 + 400)
    (planned,) = list_sites(store, t0 + 350)
    assert planned.status == "outage" and planned.outages == [
        {"start_at": t0 + 300, "end_at": t0 + 400}]
    with pytest.raises(NotFoundError):
        add_outage(store, "nowhere", t0, t0 + 1)
    with pytest.raises(InvalidRequestError):
        add_outage(store, "solar", t0 + 5, t0)


def test_site_in_outage_gets_no_work(store: Store) -> None:
    from control_factory import CONFIG, MODEL, batch, chat_line, tenant

    site = authenticate_site(store, create_site(store, "dark", 0.1))
    assert site is not None
    batch(store, tenant(store), [chat_line("a")])
    now = time.time()
    add_outage(store, "dark", now - 10, now + 100)
    ask = LeaseRequest(capacity=4, models=[MODEL])
    assert lease(store, site, ask, now, CONFIG).leases == []
    assert len(lease(store, site, ask, now + 101, CONFIG).leases) == 1


def test_parse_time() -> None:
    assert parse_time("1970-01-01T00:01:00Z", "from") == 60.0
    assert parse_time("1970-01-01T00:01:00", "from") == 60.0  # no zone: UTC
    assert parse_time("1970-01-01T01:01:00+01:00", "from") == 60.0
    with pytest.raises(InvalidRequestError):
        parse_time("tomorrow", "from")


def minimill(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "minimill.cli", *args], capture_output=True,
                          text=True, timeout=60)


def test_cli_keys_and_sites_commands(store_url: str, store: Store, tmp_path: Path) -> None:
    key = minimill("keys", "create", "--tenant", "cli-team", "--db", store_url)
    assert key.returncode == 0, key.stderr
    owner = authenticate(store, key.stdout.strip())
    assert owner is not None and owner.name == "cli-team"
    token = minimill("sites", "create", "mill-a", "--price-per-hour", "0.25", "--chip", "mi300",
                     "--db", store_url)
    assert token.returncode == 0 and authenticate_site(store, token.stdout.strip())
    again = minimill("sites", "create", "mill-a", "--db", store_url)
    assert again.returncode != 0 and "already exists" in again.stderr
    assert "Traceback" not in again.stderr
    outage = minimill("sites", "outage", "add", "mill-a", "--from", "2030-01-01T00:00:00Z",
                      "--to", "2030-01-01T06:00:00Z", "--db", store_url)
    assert outage.returncode == 0, outage.stderr
    bad = minimill("sites", "outage", "add", "mill-a", "--from", "soon", "--to", "later",
                   "--db", store_url)
    assert bad.returncode != 0 and "ISO 8601" in bad.stderr and "Traceback" not in bad.stderr
    listed = minimill("sites", "list", "--json", "--db", store_url)
    (row,) = json.loads(listed.stdout)
    assert (row["name"], row["chip"], row["price_per_hour"]) == ("mill-a", "mi300", 0.25)
    assert row["outages"][0]["end_at"] - row["outages"][0]["start_at"] == 6 * 3600
    table = minimill("sites", "list", "--db", store_url)
    assert table.returncode == 0 and "mill-a" in table.stdout and "mi300" in table.stdout


def test_cli_outage_list_and_remove(store_url: str, store: Store) -> None:
    for name in ("mill-a", "mill-b"):
        assert minimill("sites", "create", name, "--db", store_url).returncode == 0
    added = [minimill("sites", "outage", "add", site, "--from", start, "--to", end,
                      "--db", store_url)
             for site, start, end in (("mill-a", "2030-01-01T00:00:00Z", "2030-01-01T06:00Z"),
                                      ("mill-b", "2030-02-01T00:00:00Z", "2030-02-02T00:00Z"),
                                      ("mill-a", "2001-01-01T00:00:00Z", "2001-01-02T00:00Z"))]
    assert all(a.returncode == 0 for a in added), [a.stderr for a in added]
    ids = [int(a.stdout.split()[1]) for a in added]  # "outage ID of SITE ..."
    listed = json.loads(minimill("sites", "outage", "list", "--json", "--db", store_url).stdout)
    assert [(o["id"], o["site"]) for o in listed] == [(ids[0], "mill-a"), (ids[1], "mill-b")]
    only_a = json.loads(minimill("sites", "outage", "list", "mill-a", "--all", "--json",
                                 "--db", store_url).stdout)
    assert [o["id"] for o in only_a] == [ids[2], ids[0]]  # past ones too, by start
    table = minimill("sites", "outage", "list", "--db", store_url)
    assert table.returncode == 0 and "2030-01-01 00:00:00 to 2030-01-01 06:00:00" in table.stdout
    removed = minimill("sites", "outage", "remove", str(ids[0]), "--db", store_url)
    assert removed.returncode == 0 and "removed" in removed.stdout
    left = json.loads(minimill("sites", "outage", "list", "--json", "--db", store_url).stdout)
    assert [o["id"] for o in left] == [ids[1]]
    for bad in (minimill("sites", "outage", "remove", str(ids[0]), "--db", store_url),
                minimill("sites", "outage", "list", "nowhere", "--db", store_url)):
        assert bad.returncode != 0 and "error:" in bad.stderr
        assert "Traceback" not in bad.stderr


def test_cli_site_price_schedule(store_url: str, store: Store, tmp_path: Path) -> None:
    assert minimill("sites", "create", "mill-p", "--price-per-hour", "0.25",
                    "--db", store_url).returncode == 0
    schedule = tmp_path / "solar.yaml"
    schedule.write_text("start_at: 0\nhourly_usd: [0.5, 0.125]\n")
    done = minimill("sites", "price", "set", "mill-p", "--schedule", str(schedule),
                    "--db", store_url)
    assert done.returncode == 0, done.stderr
    assert "2 hourly prices" in done.stdout and "repeating" in done.stdout
    before = int(time.time() // 3600)
    (row,) = json.loads(minimill("sites", "list", "--json", "--db", store_url).stdout)
    hours = {before, int(time.time() // 3600)}  # an hour may turn meanwhile
    assert row["price_now"] in {0.5 if h % 2 == 0 else 0.125 for h in hours}
    assert row["price_per_hour"] == 0.25
    schedule.write_text("[1, -2]\n")
    bad = minimill("sites", "price", "set", "mill-p", "--schedule", str(schedule),
                   "--db", store_url)
    assert bad.returncode != 0 and "hourly price" in bad.stderr and "Traceback" not in bad.stderr
    assert minimill("sites", "price", "set", "mill-p", "--clear",
                    "--db", store_url).returncode == 0
    (row,) = json.loads(minimill("sites", "list", "--json", "--db", store_url).stdout)
    assert row["price_now"] == 0.25
    missing = minimill("sites", "price", "set", "no-such", "--clear", "--db", store_url)
    assert missing.returncode != 0 and "no site named" in missing.stderr
