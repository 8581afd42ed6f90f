"""Attack: keep using a key after the operator revoked it (a leaked key, a departed tenant).

Two control-plane servers share one store; the key is revoked by `minimill keys revoke` (a
process of its own) and by the operator route on one server: both servers refuse it at once
(401), with no restart and no cache to wait out."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from api_harness import BACKENDS, ApiEnv, ServerThread, make_env, stop_env
from openai import OpenAI
from security_harness import minimill

from minimill.control.keys import list_keys


@pytest.fixture(scope="module", params=BACKENDS)
def env(request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiEnv]:
    the_env = make_env(request, tmp_path_factory, request.param)
    yield the_env
    stop_env(the_env)


def works(base_url: str, key: str) -> bool:
    with OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0) as client:
        try:
            client.models.list()
        except openai.AuthenticationError as exc:
            assert "revoked" in exc.message
            return False
    return True


def test_a_key_revoked_by_the_command_line_is_refused_by_every_server(
        env: ApiEnv, second: ServerThread) -> None:
    leaked, kept = env.new_key("leaky"), env.new_key("leaky")
    assert works(env.base_url, leaked) and works(second.base_url, leaked)
    # By its first characters, as the tenant can read them off the key.
    revoked = minimill("keys", "revoke", leaked[:12], "--db", env.db_url)
    assert revoked.returncode == 0, revoked.stderr
    assert not works(env.base_url, leaked) and not works(second.base_url, leaked)
    assert works(env.base_url, kept) and works(second.base_url, kept)  # only that one
    listed = {k.hint: k for k in list_keys(env.store, "leaky")}
    assert listed[leaked[:11]].revoked_at is not None
    assert listed[kept[:11]].revoked_at is None
    table = minimill("keys", "list", "--tenant", "leaky", "--db", env.db_url)
    assert table.returncode == 0 and leaked[:11] in table.stdout
    assert leaked not in table.stdout and kept not in table.stdout


def test_the_operator_route_revokes_by_key_or_id_and_refuses_vague_names(
        env: ApiEnv, second: ServerThread) -> None:
    key = env.new_key("leaky-2")
    as_operator = {"Authorization": f"Bearer {env.operator_key}"}
    too_short = httpx.post(env.v1 + "/keys/revoke", json={"key": key[:5]}, headers=as_operator)
    assert too_short.status_code == 400 and too_short.json()["error"]["param"] == "key"
    unknown = httpx.post(env.v1 + "/keys/revoke", json={"key": "mm-" + "Z" * 43},
                         headers=as_operator)
    assert unknown.status_code == 404
    # A tenant cannot revoke (the route is hidden from it as an unknown URL would be).
    as_tenant = httpx.post(env.v1 + "/keys/revoke", json={"key": key},
                           headers={"Authorization": f"Bearer {key}"})
    assert as_tenant.status_code == 404 and works(second.base_url, key)
    answer = httpx.post(env.v1 + "/keys/revoke", json={"key": key}, headers=as_operator)
    assert answer.status_code == 200, answer.text
    assert answer.json()["tenant"] == "leaky-2" and answer.json()["hint"] == key[:11]
    assert not works(second.base_url, key) and not works(env.base_url, key)
    # An operator key is revoked the same way, by its id; the one revoking keeps working.
    spare = minimill("keys", "create", "--operator", "--db", env.db_url).stdout.strip()
    spare_id = next(k.id for k in list_keys(env.store) if k.hint == spare[:12])
    assert httpx.post(env.v1 + "/keys/revoke", json={"key": spare_id},
                      headers=as_operator).status_code == 200
    assert httpx.get(env.v1 + "/sites", headers={"Authorization": f"Bearer {spare}"}
                     ).status_code == 404
    assert httpx.get(env.v1 + "/sites", headers=as_operator).status_code == 200
