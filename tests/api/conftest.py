"""API fixtures: one control plane per test module and backend (SQLite, PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from api_harness import BACKENDS, ApiEnv, EchoSite, make_env, stop_env
from openai import OpenAI


@pytest.fixture(scope="module", params=BACKENDS)
def env(request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiEnv]:
    """A running control plane; a module may set SERVER_SETTINGS to tune it."""
    settings = getattr(request.module, "SERVER_SETTINGS", {})
    the_env = make_env(request, tmp_path_factory, request.param, **settings)
    yield the_env
    stop_env(the_env)


@pytest.fixture
def client(env: ApiEnv) -> Iterator[OpenAI]:
    with OpenAI(base_url=env.v1, api_key=env.key, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def site(env: ApiEnv) -> Iterator[EchoSite]:
    with EchoSite(env.base_url, env.site_token) as s:
        yield s
