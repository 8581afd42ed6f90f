"""Box fixtures: a real control plane (uvicorn in a thread, SQLite) and real box host
processes (`minimill worker --engine none --boxes N`) running real bubblewrap sandboxes."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from api_harness import ApiEnv, fresh_pg_database, start_env, stop_env
from serve_process import Proc, minimill_cmd

from minimill.boxes.client import Boxes
from minimill.control.sites import create_site

LEASE_TTL_S = 3.0


class BoxHostProc(Proc):
    """A box host site: its own token and its own workspace directory."""

    def __init__(self, env: ApiEnv, root: Path, slots: int = 4,
                 snapshot_interval_s: float = 30.0) -> None:
        self.site = f"boxhost-{uuid.uuid4().hex[:6]}"
        self.token = create_site(env.store, self.site, 0.1, "cpu")
        self.box_dir = root / self.site
        args = minimill_cmd("worker", "--server", env.base_url, "--site", self.site,
                            "--engine", "none", "--boxes", str(slots),
                            "--box-dir", str(self.box_dir),
                            "--box-snapshot-interval-s", str(snapshot_interval_s))
        super().__init__(args, {**os.environ, "MINIMILL_SITE_TOKEN": self.token,
                                "MINIMILL_LOG_LEVEL": "INFO"},
                         root / f"{self.site}.log")

    def start_and_wait(self) -> BoxHostProc:
        self.start()
        self.wait_for_log("worker for site .* ready: no engine", timeout=60)
        return self


@pytest.fixture(scope="module")
def box_env(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiEnv]:
    """A control plane on SQLite; a module may set BACKENDS to run on PostgreSQL too."""
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
