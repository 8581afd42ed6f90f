"""Shared fixtures: a real PostgreSQL server for the store tests, and the default model file."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# Several processes (tests, serve, workers) share two cores: OpenMP threads that spin while
# waiting for work starve the other processes, so they sleep instead.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

DEFAULT_MODEL = "smollm2-135m"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with slow tests run first (a stable sort: each module's tests stay together and
    in order). Under `pytest -n N --dist loadfile --no-loadscope-reorder` (make test) the
    processes start on the long end-to-end files and end on short unit tests, instead of one
    process running a long file alone at the end while the others have nothing left."""
    slow_modules = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_modules)


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _postgres_bin_dir() -> Path:
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if not candidates:
        pytest.fail("PostgreSQL server binaries not found: install Debian's postgresql "
                    "(`make test` does) or set MINIMILL_TEST_PG_URL to a server URL.")
    return candidates[-1].parent


def _as_postgres_user(cmd: list[str]) -> list[str]:
    # The PostgreSQL server refuses to run as root; CI runs as root.
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """A private PostgreSQL server for the whole session; yields its base URL (no database)."""
    external = os.environ.get("MINIMILL_TEST_PG_URL")
    if external:
        yield external.rstrip("/")
        return
    bin_dir = _postgres_bin_dir()
    root = Path(tempfile.mkdtemp(prefix="minimill-pg-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
        shutil.chown(sock, "postgres", "postgres")
    port = free_port()
    subprocess.run(_as_postgres_user([str(bin_dir / "initdb"), "-D", str(data), "-A", "trust",
                                      "-U", "postgres", "--no-sync"]),
                   check=True, capture_output=True)
    opts = f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
    subprocess.run(_as_postgres_user([str(bin_dir / "pg_ctl"), "-D", str(data), "-o", opts,
                                      "-l", str(root / "log"), "-w", "start"]),
                   check=True, capture_output=True)
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}"
    finally:
        subprocess.run(_as_postgres_user([str(bin_dir / "pg_ctl"), "-D", str(data), "-m",
                                          "immediate", "-w", "stop"]), capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def pg_url(pg_server: str) -> str:
    """A fresh, empty database on the session's PostgreSQL server."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(f"{pg_server}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{pg_server}/{name}"


@pytest.fixture(scope="session")
def model_file() -> Path:
    """The default model's GGUF file, pulled through the real registry path (cached), with
    the CPU kernels built for this checkout (cached on disk too). A test that starts workers
    times their start: the kernels' first build, minutes on a busy 2-core machine, is not
    theirs to wait for (three workers of `bench fleet` waited out a test's 300 s on it)."""
    from minimill.engine.native import load_cpu_kernels
    from minimill.models.registry import pull_model

    load_cpu_kernels()
    return pull_model(DEFAULT_MODEL)


@pytest.fixture
def minimill_home(tmp_path: Path, model_file: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh MINIMILL_HOME whose model cache already holds the default model (linked)."""
    from minimill.models.registry import minimill_home as current_home

    home = tmp_path / "home"
    models = home / "models"
    models.mkdir(parents=True)
    src_models = current_home() / "models"
    for entry in src_models.iterdir():
        (models / entry.name).symlink_to(entry)
    monkeypatch.setenv("MINIMILL_HOME", str(home))
    return home
