"""Fixtures: real `minimill serve` processes (control plane + local worker)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The process helpers beside this file are shared with tests/fleet.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_process import Serve, make_home


@pytest.fixture(scope="module")
def e2e_home(tmp_path_factory: pytest.TempPathFactory, model_file: Path) -> Path:
    """A fresh MINIMILL_HOME for the module, its model cache linked to the pulled model."""
    return make_home(tmp_path_factory.mktemp("e2e"), model_file.parent.parent)


@pytest.fixture(scope="session")
def serve(tmp_path_factory: pytest.TempPathFactory, model_file: Path) -> Iterator[Serve]:
    """One serve shared by the e2e modules that need no serve of their own."""
    # Its tests' webhook receivers listen on loopback, which webhooks reach only when the
    # operator allows private addresses.
    proc = Serve(make_home(tmp_path_factory.mktemp("e2e-shared"), model_file.parent.parent),
                 extra_env={"MINIMILL_WEBHOOK_ALLOW_PRIVATE": "1"})
    try:
        yield proc.start_and_wait()
    finally:
        proc.stop()
