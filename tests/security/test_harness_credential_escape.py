"""Attack: a site that runs agents uses the credential an agent's lease hands it for more than
that agent's harness: another agent's box, the tenant's files, batches, keys and agents, an
archive of the tenant's that is not the agent's image, another agent's results through an
Idempotency-Key, and after its lease ended, expired, or moved to a later epoch. It also polls
for every agent in the queue at once.

Before, a lease carried a full `mm-` key of the tenant, valid on every tenant route while the
lease lived, and a poll could take 4,096 agents: any site could collect tenants' keys."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from api_harness import MODEL, ApiEnv, EchoSite, make_env, stop_env, wait_for
from test_api_roles import ROUTES

from minimill.api.harness_auth import HARNESS_ROUTES
from minimill.control.agents import MAX_AGENTS_PER_POLL

LEASE_TTL_S = 3.0
HARNESS = "async def main(ctx, task):\n    return task\n"


@pytest.fixture(scope="module")
def env(request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiEnv]:
    the_env = make_env(request, tmp_path_factory, "sqlite", lease_ttl_s=LEASE_TTL_S)
    yield the_env
    stop_env(the_env)


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def create_agent(env: ApiEnv, key: str, task: Any = None) -> str:
    made = httpx.post(env.v1 + "/agents", headers=bearer(key),
                      json={"code": HARNESS, "filename": "h.py", "task": task})
    assert made.status_code == 200, made.text
    return str(made.json()["id"])


def poll(env: ApiEnv, capacity: int, held: list[dict[str, Any]] | None = None) -> Any:
    answer = httpx.post(env.v1 + "/fleet/agents/poll", headers=bearer(env.site_token),
                        json={"capacity": capacity, "held": held or []})
    assert answer.status_code == 200, answer.text
    return answer.json()


def leases_of(env: ApiEnv, *agent_ids: str) -> list[dict[str, Any]]:
    """Poll until the queue has handed out every one of `agent_ids`; their leases."""
    found: dict[str, dict[str, Any]] = {}

    def every() -> bool:
        found.update((lease["agent_id"], lease) for lease in poll(env, 8)["leases"])
        return all(a in found for a in agent_ids)

    wait_for(every)
    return [found[a] for a in agent_ids]


@contextlib.contextmanager
def kept_alive(env: ApiEnv, *leases: dict[str, Any]) -> Iterator[None]:
    """Heartbeat the leases (a poll that holds them) while the block runs, as a runner does."""
    stop = threading.Event()
    held = [{"agent_id": lease["agent_id"], "epoch": lease["epoch"]} for lease in leases]

    def beat() -> None:
        while not stop.wait(LEASE_TTL_S / 6):
            poll(env, 0, held)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=30)


def chat(env: ApiEnv, credential: str, **headers: str) -> httpx.Response:
    return httpx.post(env.v1 + "/chat/completions", headers={**bearer(credential), **headers},
                      json={"model": MODEL, "max_tokens": 4,
                            "messages": [{"role": "user", "content": "hello there"}]},
                      timeout=60)


def test_a_lease_credential_reaches_only_its_agents_calls(env: ApiEnv) -> None:
    tenant_key = env.new_key("agent-owner")
    mine, other = create_agent(env, tenant_key), create_agent(env, tenant_key)
    mine_lease, other_lease = leases_of(env, mine, other)
    credential, others = mine_lease["api_key"], other_lease["api_key"]
    assert credential.startswith("mmh-") and not credential.startswith("mm-")
    with kept_alive(env, mine_lease, other_lease):
        _walk(env, tenant_key, mine, other, credential, others)


def _walk(env: ApiEnv, tenant_key: str, mine: str, other: str, credential: str,
          others: str) -> None:
    with EchoSite(env.base_url, env.site_token):
        called = chat(env, credential, **{"Idempotency-Key": f"{mine}/chat-0"})
        assert called.status_code == 200, called.text
        # Another agent's effect key would hand this credential that agent's result.
        stolen = chat(env, credential, **{"Idempotency-Key": f"{other}/chat-0"})
        assert stolen.status_code == 403, stolen.text

    box = httpx.post(env.v1 + "/boxes", headers=bearer(credential), json={"image": None})
    assert box.status_code == 200, box.text
    box_id = box.json()["id"]
    assert httpx.get(env.v1 + f"/boxes/{box_id}", headers=bearer(credential)).status_code == 200
    # The other agent's credential, on this agent's box: every box route a harness uses.
    for method, path in (("GET", "/boxes/{id}"), ("POST", "/boxes/{id}/exec"),
                         ("PUT", "/boxes/{id}/files?path=x"),
                         ("GET", "/boxes/{id}/files/content?path=x")):
        answer = httpx.request(method, env.v1 + path.format(id=box_id), headers=bearer(others),
                               json={"command": ["true"]} if method == "POST" else None)
        assert answer.status_code == 403, (path, answer.text)
        assert answer.json()["error"]["code"] == "harness_scope"
    # A box from an archive the agent was not given (the tenant's other images, snapshots).
    image = httpx.post(env.v1 + "/boxes/images", headers=bearer(tenant_key),
                       content=_empty_tar())
    assert image.status_code == 200, image.text
    for body in ({"image": image.json()["id"]}, {"snapshot": image.json()["id"]}):
        answer = httpx.post(env.v1 + "/boxes", headers=bearer(credential), json=body)
        assert answer.status_code == 403, answer.text
    # Its own journal only.
    assert httpx.get(env.v1 + f"/agents/{mine}/journal",
                     headers=bearer(credential)).status_code == 200
    assert httpx.get(env.v1 + f"/agents/{other}/journal",
                     headers=bearer(credential)).status_code == 403

    # Every other route: tenant routes 403 (files, batches, responses, agents, webhooks, ...),
    # operator routes hidden (keys, sites, prices), fleet routes 401.
    wrong = []
    for (method, path), role in sorted(ROUTES.items()):
        if (method, path) in HARNESS_ROUTES or role == "public":
            continue
        url = env.base_url + path.replace("{", "").replace("}", "")
        answer = httpx.request(method, url, headers=bearer(credential),
                               json={} if method in ("POST", "PUT") else None, timeout=30)
        want = {"tenant": 403, "operator": 404, "site": 401}[role]
        if answer.status_code != want:
            wrong.append(f"{method} {path}: {answer.status_code} {answer.text[:120]}")
    assert not wrong, "\n".join(wrong)


def test_a_lease_credential_dies_with_its_lease(env: ApiEnv) -> None:
    tenant_key = env.new_key("agent-owner-2")
    released, lapsed = create_agent(env, tenant_key), create_agent(env, tenant_key)
    first, lapsing = leases_of(env, released, lapsed)
    with EchoSite(env.base_url, env.site_token):
        with kept_alive(env, first, lapsing):
            _release_and_lease_again(env, released, first)
            assert chat(env, lapsing["api_key"]).status_code == 200
        # No longer heartbeated: refused once its lease's time is up.
        wait_for(lambda: chat(env, lapsing["api_key"]).status_code == 401,
                 timeout_s=LEASE_TTL_S + 30)


def _release_and_lease_again(env: ApiEnv, released: str, first: dict[str, Any]) -> None:
    assert chat(env, first["api_key"]).status_code == 200
    # Handed back: refused at once.
    gone = httpx.post(env.v1 + "/fleet/agents/release", headers=bearer(env.site_token),
                      json={"agents": [{"agent_id": released, "epoch": first["epoch"]}]})
    assert gone.json()["released"] == [released]
    assert chat(env, first["api_key"]).status_code == 401
    # Leased again (a later epoch): the new credential works, the old one still not.
    (second,) = leases_of(env, released)
    assert second["epoch"] > first["epoch"]
    with kept_alive(env, second):
        assert chat(env, second["api_key"]).status_code == 200
        assert chat(env, first["api_key"]).status_code == 401


def test_one_poll_takes_a_bounded_number_of_agents(env: ApiEnv) -> None:
    tenant_key = env.new_key("agent-owner-3")
    for i in range(MAX_AGENTS_PER_POLL + 8):
        create_agent(env, tenant_key, task=i)
    answer = poll(env, 4096)
    assert len(answer["leases"]) == MAX_AGENTS_PER_POLL
    assert all(lease["api_key"].startswith("mmh-") for lease in answer["leases"])


def _empty_tar() -> bytes:
    import io
    import tarfile

    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as archive:
        info = tarfile.TarInfo("readme.txt")
        info.size = 2
        archive.addfile(info, io.BytesIO(b"hi"))
    return data.getvalue()
