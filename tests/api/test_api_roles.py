"""Who reaches what: every route of the app, walked with a tenant key, an operator key, a site
token, an unknown key and no key, over real HTTP (SQLite and PostgreSQL).

The routes come from `app.routes`, and the walk fails on any route missing from ROUTES: a new
route cannot ship without someone saying who it is for.
"""

from __future__ import annotations

import io
from typing import Any

import httpx
import openai
import pytest
from api_harness import MODEL, ApiEnv
from openai import OpenAI

# (method, path) -> who it is for.
ROUTES = {
    ("GET", "/v1/models"): "tenant",
    ("GET", "/v1/models/{model}"): "tenant",
    ("POST", "/v1/chat/completions"): "tenant",
    ("POST", "/v1/completions"): "tenant",
    ("POST", "/v1/embeddings"): "tenant",
    ("POST", "/v1/responses"): "tenant",
    ("GET", "/v1/responses/{response_id}"): "tenant",
    ("DELETE", "/v1/responses/{response_id}"): "tenant",
    ("POST", "/v1/responses/{response_id}/cancel"): "tenant",
    ("GET", "/v1/responses/{response_id}/input_items"): "tenant",
    ("POST", "/v1/webhook_endpoints"): "tenant",
    ("GET", "/v1/webhook_endpoints"): "tenant",
    ("GET", "/v1/webhook_endpoints/{webhook_endpoint_id}"): "tenant",
    ("DELETE", "/v1/webhook_endpoints/{webhook_endpoint_id}"): "tenant",
    ("POST", "/v1/files"): "tenant",
    ("GET", "/v1/files"): "tenant",
    ("GET", "/v1/files/{file_id}"): "tenant",
    ("GET", "/v1/files/{file_id}/content"): "tenant",
    ("DELETE", "/v1/files/{file_id}"): "tenant",
    ("POST", "/v1/batches"): "tenant",
    ("GET", "/v1/batches"): "tenant",
    ("GET", "/v1/batches/{batch_id}"): "tenant",
    ("POST", "/v1/batches/{batch_id}/cancel"): "tenant",
    ("POST", "/v1/boxes/images"): "tenant",
    ("POST", "/v1/boxes"): "tenant",
    ("GET", "/v1/boxes"): "tenant",
    ("GET", "/v1/boxes/{box_id}"): "tenant",
    ("DELETE", "/v1/boxes/{box_id}"): "tenant",
    ("POST", "/v1/boxes/{box_id}/exec"): "tenant",
    ("PUT", "/v1/boxes/{box_id}/files"): "tenant",
    ("GET", "/v1/boxes/{box_id}/files"): "tenant",
    ("GET", "/v1/boxes/{box_id}/files/content"): "tenant",
    ("POST", "/v1/boxes/{box_id}/snapshots"): "tenant",
    ("GET", "/v1/boxes/{box_id}/snapshots"): "tenant",
    ("POST", "/v1/boxes/{box_id}/pause"): "tenant",
    ("POST", "/v1/boxes/{box_id}/resume"): "tenant",
    ("POST", "/v1/agents"): "tenant",
    ("GET", "/v1/agents"): "tenant",
    ("GET", "/v1/agents/{agent_id}"): "tenant",
    ("GET", "/v1/agents/{agent_id}/logs"): "tenant",
    ("GET", "/v1/agents/{agent_id}/journal"): "tenant",
    ("POST", "/v1/agents/{agent_id}/cancel"): "tenant",
    ("POST", "/v1/fleet/agents/poll"): "site",
    ("POST", "/v1/fleet/agents/{agent_id}/journal"): "site",
    ("POST", "/v1/fleet/agents/{agent_id}/finish"): "site",
    ("POST", "/v1/fleet/agents/release"): "site",
    ("POST", "/v1/fleet/boxes/poll"): "site",
    ("POST", "/v1/fleet/boxes/results"): "site",
    ("POST", "/v1/fleet/boxes/output"): "site",
    ("POST", "/v1/fleet/boxes/release"): "site",
    ("POST", "/v1/fleet/boxes/{box_id}/snapshots"): "site",
    ("PUT", "/v1/fleet/boxes/{box_id}/snapshots/uploads/{upload_id}/parts/{seq}"): "site",
    ("GET", "/v1/fleet/boxes/{box_id}/snapshots/{snapshot_id}"): "site",
    ("POST", "/v1/fleet/lease"): "site",
    ("POST", "/v1/fleet/heartbeat"): "site",
    ("POST", "/v1/fleet/complete"): "site",
    ("POST", "/v1/fleet/outages"): "site",
    ("GET", "/v1/fleet/outages"): "site",
    ("DELETE", "/v1/fleet/outages/{outage_id}"): "site",
    ("POST", "/v1/fleet/release"): "site",
    ("GET", "/v1/sites"): "operator",
    ("POST", "/v1/sites/{site}/outages"): "operator",
    ("GET", "/v1/sites/{site}/outages"): "operator",
    ("DELETE", "/v1/sites/{site}/outages/{outage_id}"): "operator",
    ("PUT", "/v1/sites/{site}/price_schedule"): "operator",
    ("DELETE", "/v1/sites/{site}/price_schedule"): "operator",
    ("GET", "/v1/prices"): "operator",
    ("POST", "/v1/prices"): "operator",
    ("DELETE", "/v1/prices"): "operator",
    ("POST", "/v1/keys"): "operator",
    ("POST", "/v1/keys/revoke"): "operator",
    ("GET", "/v1/tenants"): "operator",
    ("GET", "/v1/tenants/{tenant}/limits"): "operator",
    ("POST", "/v1/tenants/{tenant}/limits"): "operator",
    ("GET", "/metrics"): "operator",
    ("GET", "/dashboard"): "operator",
    ("GET", "/dashboard/data"): "operator",
    ("GET", "/openapi.json"): "public",
    ("GET", "/docs"): "public",
    ("GET", "/docs/oauth2-redirect"): "public",
    ("GET", "/redoc"): "public",
}
CALLERS = ("tenant", "operator", "site", "unknown", "none")


def app_routes(env: ApiEnv) -> set[tuple[str, str]]:
    routes: list[Any] = list(env.server.app.routes)
    try:  # a FastAPI that includes routers lazily lists them as one entry each
        from fastapi.routing import iter_route_contexts  # type: ignore[attr-defined]
    except ImportError:
        pass
    else:
        routes = list(iter_route_contexts(routes))
    found = set()
    for route in routes:
        assert route.path and route.methods, route
        found |= {(m, route.path) for m in route.methods if m != "HEAD"}
    return found


def credentials(env: ApiEnv, caller: str) -> dict[str, str]:
    secret = {"tenant": env.key, "operator": env.operator_key, "site": env.site_token,
              "unknown": "mmo-" + "x" * 43, "none": None}[caller]
    return {"Authorization": f"Bearer {secret}"} if secret else {}


def call(env: ApiEnv, method: str, path: str, caller: str) -> httpx.Response:
    # Path parameters name objects that do not exist; bodies are empty objects: a caller who
    # gets through is answered 200, or 400/404 about the request itself, never 500.
    url = env.base_url + path.replace("{", "").replace("}", "")
    body: dict[str, Any] = {"json": {}} if method in ("POST", "PUT", "PATCH") else {}
    return httpx.request(method, url, headers=credentials(env, caller), timeout=30, **body)


def expected(role: str, caller: str) -> str:
    """What a caller is answered: served, 401, 403, or hidden (as an unknown URL)."""
    if role == "public" or role == caller:
        return "served"
    if role == "operator":
        return "hidden"
    if role == "tenant" and caller == "operator":
        return "403"
    return "401"


def test_every_route_is_classified(env: ApiEnv) -> None:
    assert app_routes(env) == set(ROUTES)


@pytest.mark.parametrize("caller", CALLERS)
def test_every_route_answers_each_caller_as_its_role_says(env: ApiEnv, caller: str) -> None:
    unknown = httpx.get(env.base_url + "/v1/no-such-route", headers=credentials(env, caller))
    assert unknown.status_code == 404
    wrong: list[str] = []
    for (method, path), role in sorted(ROUTES.items()):
        answer = call(env, method, path, caller)
        want = expected(role, caller)
        error = answer.json().get("error") if "json" in answer.headers.get(
            "content-type", "") and answer.status_code >= 400 else None
        if answer.status_code >= 400:
            assert error is not None and error["message"] and error["type"], (path, answer.text)
        if want == "served":
            ok = (answer.status_code < 500 and answer.status_code not in (401, 403)
                  and (error is None or error.get("code") != "unknown_url"))
        elif want == "hidden":
            ok = (answer.status_code, answer.json()) == (404, unknown.json())
        else:
            ok = str(answer.status_code) == want
        if not ok:
            wrong.append(f"{method} {path} as {caller}: want {want}, got "
                         f"{answer.status_code} {answer.text[:200]}")
    assert not wrong, "\n".join(wrong)


def test_operator_routes_hide_their_methods_and_stay_out_of_the_schema(env: ApiEnv) -> None:
    unknown = httpx.get(env.base_url + "/v1/no-such-route").json()
    for caller in CALLERS:
        for method, path in (("PUT", "/v1/sites"), ("PATCH", "/v1/prices"),
                             ("GET", "/v1/keys")):
            answer = httpx.request(method, env.base_url + path,
                                   headers=credentials(env, caller))
            assert (answer.status_code, answer.json()) == (404, unknown), (caller, path)
    # A wrong method elsewhere is still a 405.
    assert httpx.put(env.v1 + "/models", headers=credentials(env, "tenant")).status_code == 405
    paths = httpx.get(env.base_url + "/openapi.json", timeout=120).json()["paths"]
    assert "/v1/chat/completions" in paths and "/v1/fleet/lease" in paths
    assert not [p for p in paths if p.startswith(("/v1/sites", "/v1/prices", "/v1/keys"))]


def test_an_operator_key_is_refused_as_a_tenant_key(env: ApiEnv) -> None:
    with OpenAI(base_url=env.v1, api_key=env.operator_key, max_retries=0) as as_operator, \
            pytest.raises(openai.PermissionDeniedError) as refused:
        as_operator.models.list()
    assert refused.value.status_code == 403 and "operator key" in refused.value.message


def test_tenants_reach_only_their_own_objects(env: ApiEnv) -> None:
    line = ('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": '
            f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}]}}}}')
    with OpenAI(base_url=env.v1, api_key=env.key, max_retries=0) as owner:
        file_id = owner.files.create(file=("in.jsonl", io.BytesIO(line.encode())),
                                     purpose="batch").id
        batch_id = owner.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                        completion_window="24h").id
    other = {"Authorization": f"Bearer {env.new_key('tenant-other')}"}
    for method, path in (("GET", f"/v1/files/{file_id}"), ("GET", f"/v1/files/{file_id}/content"),
                         ("DELETE", f"/v1/files/{file_id}"), ("GET", f"/v1/batches/{batch_id}"),
                         ("POST", f"/v1/batches/{batch_id}/cancel")):
        answer = httpx.request(method, env.base_url + path, headers=other)
        assert answer.status_code == 404, (path, answer.text)
    listed = httpx.get(env.v1 + "/files", headers=other).json()["data"]
    assert file_id not in {f["id"] for f in listed}
    assert batch_id not in {b["id"] for b in httpx.get(env.v1 + "/batches",
                                                       headers=other).json()["data"]}
    mine = httpx.get(env.v1 + f"/files/{file_id}", headers=credentials(env, "tenant"))
    assert mine.status_code == 200
