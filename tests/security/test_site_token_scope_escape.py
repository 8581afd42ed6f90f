"""Attack: a site registered for one part of the worker protocol uses its token on every other
route: tenants' routes, operators' routes, and the fleet routes of the parts it does not serve
(a site meant for tokens taking tenants' boxes, or polling for agents and their credentials).

Every route of the app is walked (the same route table as tests/api/test_api_roles.py, which
fails on any route nobody classified) with the token of a site serving tokens only, boxes only
and agents only: tenant routes answer 401, operator routes answer as an unknown URL (404), the
fleet routes of other parts answer 403 naming what the site serves, and its own part and its
own outages are served."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import uuid

import httpx
import pytest
from api_harness import ApiEnv
from test_api_roles import ROUTES, call

from minimill.control.records import SiteScope
from minimill.control.sites import authenticate_site, create_site, parse_scopes


def part_of(path: str) -> SiteScope | None:
    """The part of the worker protocol a fleet route belongs to (None: any site's own)."""
    if path.startswith("/v1/fleet/boxes"):
        return SiteScope.BOXES
    if path.startswith("/v1/fleet/agents"):
        return SiteScope.AGENTS
    if path.startswith("/v1/fleet/outages"):
        return None
    return SiteScope.TOKENS


@pytest.mark.parametrize("serves", ["tokens", "boxes", "agents"])
def test_a_site_token_reaches_only_its_own_part(env: ApiEnv, serves: str) -> None:
    scopes = parse_scopes(serves)
    token = create_site(env.store, f"{serves}-{uuid.uuid4().hex[:6]}", 0.1, serves=scopes)
    as_site = dataclasses.replace(env, site_token=token)
    unknown = httpx.get(env.base_url + "/v1/no-such-route").json()
    wrong: list[str] = []
    for (method, path), role in sorted(ROUTES.items()):
        answer = call(as_site, method, path, "site")
        if role == "public":
            continue
        error = answer.json().get("error", {}) if answer.status_code >= 400 else {}
        if role == "tenant":
            ok = answer.status_code == 401
        elif role == "operator":
            ok = (answer.status_code, answer.json()) == (404, unknown)
        elif (part := part_of(path)) is None or part in scopes:
            ok = answer.status_code not in (401, 403) and answer.status_code < 500
        else:
            ok = (answer.status_code == 403 and error.get("code") == "site_scope"
                  and f"serves {serves}" in error.get("message", ""))
        if not ok:
            wrong.append(f"{method} {path}: {answer.status_code} {answer.text[:160]}")
    assert not wrong, "\n".join(wrong)


def test_the_default_registration_serves_tokens_only(env: ApiEnv) -> None:
    made = subprocess.run([sys.executable, "-m", "minimill.cli", "sites", "create",
                           "plain-site", "--db", env.db_url], capture_output=True, text=True,
                          timeout=60)
    assert made.returncode == 0, made.stderr
    site = authenticate_site(env.store, made.stdout.strip())
    assert site is not None and site.serves == {SiteScope.TOKENS}
    bad = subprocess.run([sys.executable, "-m", "minimill.cli", "sites", "create",
                          "odd-site", "--serves", "tokens,root", "--db", env.db_url],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "unknown: root" in bad.stderr
    assert "Traceback" not in bad.stderr
