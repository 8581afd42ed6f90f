"""Box fixtures: a real control plane (uvicorn in a thread, SQLite) and real box host
processes (`minimill worker --engine none --boxes N`) running real bubblewrap sandboxes."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from api_harness import ApiEnv, fresh_pg_database, start_env, stop_env
from box_harness import BoxHostProc

from minimill.client.boxes import Boxes

LEASE_TTL_S = 3.0


@pytest.fixture(scope="module")
def box_env(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiEnv]:
    """A control plane on SQLite, or on the backend a module parametrizes it with."""
    backend = getattr(request, "param", "sqlite")
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('boxdb') / 'minimill.db'}"
    else:
        url = fresh_pg_database(request.getfixturevalue("pg_server"))
    env = start_env(backend, url, lease_ttl_s=LEASE_TTL_S)
    yield env
    stop_env(env)


@pytest.fixture(scope="module")
def host_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("boxhosts")
    # Boxes of a root host run as an unprivileged uid, which must reach its workspaces.
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
