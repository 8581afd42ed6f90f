"""The docs tests run the README against the session `serve` of tests/e2e (its conftest's own
fixture, loaded here, and its process helpers), and the page generators of scripts/."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

E2E = Path(__file__).resolve().parent.parent / "e2e"
sys.path.insert(0, str(E2E))
sys.path.insert(0, str(E2E.parent.parent / "scripts"))

_spec = importlib.util.spec_from_file_location("e2e_conftest", E2E / "conftest.py")
assert _spec is not None and _spec.loader is not None
_e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_e2e)

serve = _e2e.serve
