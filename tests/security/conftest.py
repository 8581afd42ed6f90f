"""Attack tests: each module is one attack on the trust boundary (sites and tenants are
strangers), run against real parts: a control plane over real HTTP, real stores, real
processes. The API harness (tests/api) and the end-to-end helpers (tests/e2e) serve here too."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
