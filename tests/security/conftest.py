"""Attack tests: each module is one attack on the trust boundary (sites and tenants are
strangers), run against real parts: a real control plane (uvicorn in a thread, SQLite or
PostgreSQL), real box host processes (`minimill worker --engine none --boxes N`) running real
sandboxes, as in tests/boxes/, real processes. The API harness (tests/api) and the end-to-end
helpers (tests/e2e) serve here too."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "boxes"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from api_harness import ApiEnv, ServerThread, make_env, start_env, stop_env
from box_harness import BoxHostProc

from minimill.api.app import Settings
from minimill.client.boxes import Boxes

LEASE_TTL_S = 3.0


@pytest.fixture(scope="module")
def env(request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiEnv]:
    """A control plane on a fresh SQLite store for the module's attacks (a module that needs
    other settings, or both backends, defines its own)."""
    the_env = make_env(request, tmp_path_factory, "sqlite")
    yield the_env
    stop_env(the_env)


@pytest.fixture(scope="module")
def second(env: ApiEnv) -> Iterator[ServerThread]:
    """Another control-plane server on the same store."""
    server = ServerThread(Settings(db=env.db_url, run_janitor=False, run_webhooks=False))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def box_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiEnv]:
    url = f"sqlite:///{tmp_path_factory.mktemp('secdb') / 'minimill.db'}"
    env = start_env("sqlite", url, lease_ttl_s=LEASE_TTL_S)
    yield env
    stop_env(env)


@pytest.fixture(scope="module")
def host_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sechosts")
    # A root host's boxes run as unprivileged uids of their own, which must reach their
    # workspaces.
    for path in (root, *root.parents):
        path.chmod(path.stat().st_mode | 0o001)
    return root


@pytest.fixture(scope="module")
def box_host(box_env: ApiEnv, host_root: Path) -> Iterator[BoxHostProc]:
    host = BoxHostProc(box_env, host_root).start_and_wait()
    yield host
    host.stop()


@pytest.fixture
def boxes(box_env: ApiEnv) -> Iterator[Boxes]:
    with Boxes(box_env.v1, box_env.key, timeout_s=120) as client:
        yield client

