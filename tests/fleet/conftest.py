"""Fixtures for fleet tests: real control-plane and worker processes (helpers in tests/e2e)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The process helpers live beside the end-to-end tests; both suites use them.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from serve_process import make_home


@pytest.fixture(scope="module")
def fleet_home(tmp_path_factory: pytest.TempPathFactory, model_file: Path) -> Path:
    """A fresh MINIMILL_HOME for the module, its model cache linked to the pulled model."""
    return make_home(tmp_path_factory.mktemp("fleet"), model_file.parent.parent)
