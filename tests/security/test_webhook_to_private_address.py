"""Attack: make the control plane post to addresses inside the operator's network.

A webhook is a request the control plane sends on a tenant's behalf. Pointed at loopback (the
control plane itself, the database), link-local (169.254.169.254, a cloud's metadata service)
or private ranges, it would reach what no tenant may. Each is refused at creation (400, param
url); a name that resolved to a public address at creation and to loopback at delivery (DNS
rebinding) is refused at delivery, and nothing reaches the receiver. An operator who allows
private addresses gets deliveries to them, made to the address that was checked.

The rebinding name needs a resolver that answers differently over time: `FakeResolver` (a
fake, named as such: no test may run a DNS server the machine's resolver would ask) answers
for the test's own names and hands every other name to the real resolver."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
from api_harness import MODEL, ApiEnv, EchoSite, make_env, stop_env, wait_for
from openai import BadRequestError, OpenAI
from sqlalchemy import select

from minimill.control.tables import webhook_deliveries
from webhook_receiver import WebhookReceiver

PRIVATE_URLS = [
    "http://127.0.0.1/hook", "http://127.7.7.7:8000/hook", "http://[::1]/hook",
    "http://10.1.2.3/hook", "http://172.16.0.1/hook", "http://172.31.255.254/hook",
    "http://192.168.1.1/hook", "http://169.254.169.254/latest/meta-data/",
    "http://[fc00::1]/hook", "http://[fd12:3456::1]/hook", "http://[fe80::1]/hook",
    "http://0.0.0.0:8000/hook", "http://[::]/hook", "http://[::ffff:127.0.0.1]/hook",
    "http://localhost:8000/hook", "http://api.localhost/hook",
    # Names the resolver turns into loopback (inet_aton's shorthand and decimal forms).
    "http://127.1/hook", "http://2130706433/hook",
]


class FakeResolver:
    """getaddrinfo for the test's names: each answers its list of addresses in turn (the last
    one for good); other names go to the real resolver."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.answers: dict[str, list[str]] = {}

    def __call__(self, host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        answers = self.answers.get(str(host))
        if not answers:
            return self.real(host, port, *args, **kwargs)
        address = answers.pop(0) if len(answers) > 1 else answers[0]
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 6, "", (address, int(port or 80)))]


@pytest.fixture(scope="module")
def resolver() -> Iterator[FakeResolver]:
    fake = FakeResolver(socket.getaddrinfo)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket, "getaddrinfo", fake)
        yield fake


@pytest.fixture(scope="module")
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
        resolver: FakeResolver) -> Iterator[ApiEnv]:
    the_env = make_env(request, tmp_path_factory, "sqlite", webhook_interval_s=0.1,
                       webhook_retry_base_s=0.2, webhook_retry_cap_s=0.5)
    yield the_env
    stop_env(the_env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def deliveries(env: ApiEnv, endpoint_id: str) -> list[Any]:
    with env.store.read() as conn:
        return list(conn.execute(select(webhook_deliveries).where(
            webhook_deliveries.c.endpoint_id == endpoint_id)))


def respond(env: ApiEnv, client: OpenAI) -> None:
    """A background response that completes: its end is a webhook event."""
    with EchoSite(env.base_url, env.site_token):
        created = client.responses.create(model=MODEL, input="ping", background=True)
        wait_for(lambda: client.responses.retrieve(created.id).status == "completed")


def test_private_addresses_are_refused_at_creation(env: ApiEnv) -> None:
    with OpenAI(base_url=env.v1, api_key=env.key, max_retries=0) as client:
        for url in PRIVATE_URLS:
            with pytest.raises(BadRequestError) as refused:
                client.webhooks.create(name="probe", url=url,
                                       event_types=["response.completed"])
            assert refused.value.param == "url" and refused.value.code == "url_not_allowed", url
        assert client.webhooks.list().data == []
        public = client.webhooks.create(name="public", url="https://8.8.8.8/hook",
                                        event_types=["response.completed"])
        client.webhooks.delete(public.id)


def test_a_name_rebound_to_loopback_after_creation_gets_nothing(
        env: ApiEnv, resolver: FakeResolver) -> None:
    port = free_port()
    resolver.answers["rebind.test"] = ["8.8.8.8", "127.0.0.1"]  # public, then loopback
    receiver = WebhookReceiver(port, {"/hook": "unused"}).start()
    with OpenAI(base_url=env.v1, api_key=env.new_key("rebinder"), max_retries=0) as client:
        endpoint = client.webhooks.create(name="rebind", url=f"http://rebind.test:{port}/hook",
                                          event_types=["response.completed"])
        respond(env, client)
        refused = wait_for(lambda: [d for d in deliveries(env, endpoint.id)
                                    if d.attempts >= 2 and d.last_error])
    receiver.stop()
    assert "loopback" in refused[0].last_error
    assert receiver.deliveries == [] and receiver.bad_signatures == []


def test_an_operator_may_allow_private_addresses(
        request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
        resolver: FakeResolver) -> None:
    port = free_port()
    resolver.answers["hooks.internal.test"] = ["127.0.0.1"]
    allowed = make_env(request, tmp_path_factory, "sqlite", webhook_interval_s=0.1,
                       webhook_allow_private=True)
    try:
        with OpenAI(base_url=allowed.v1, api_key=allowed.key, max_retries=0) as client:
            endpoint = client.webhooks.create(
                name="internal", url=f"http://hooks.internal.test:{port}/hook",
                event_types=["response.completed"])
            receiver = WebhookReceiver(port, {"/hook": endpoint.signing_secret or ""}).start()
            respond(allowed, client)
            (delivered,) = wait_for(lambda: receiver.deliveries)
            receiver.stop()
        # Posted to the address checked, under the endpoint's name.
        assert delivered.headers["host"] == f"hooks.internal.test:{port}"
    finally:
        stop_env(allowed)
