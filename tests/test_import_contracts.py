"""The package layering (.importlinter) holds, and the check would catch a floor climbed.

`lint-imports` reads the contracts from the repository root and the package from the import
path (the tests' PYTHONPATH, else the installed package)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import minimill

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = str(Path(sys.executable).parent / "lint-imports")


def lint_imports(package_parent: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_import_contracts_are_kept() -> None:
    package = Path(minimill.__file__).resolve().parent
    done = lint_imports(package.parent, ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_an_engine_that_imports_the_fleet_breaks_the_contracts(tmp_path: Path) -> None:
    # A copy of the package in which the engine reaches up into the fleet: the layers contract
    # must refuse it, or the test above proves nothing.
    package = Path(minimill.__file__).resolve().parent
    copy = tmp_path / "src" / "minimill"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so", "csrc"))
    with (copy / "engine" / "scheduler.py").open("a") as f:
        f.write("\nfrom minimill.fleet import engines  # noqa: E402\n")
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    done = lint_imports(copy.parent, tmp_path)
    assert done.returncode != 0
    assert "minimill.engine.scheduler -> minimill.fleet.engines" in done.stdout
