"""`python -m minimill.cli` and the process pools that run the main module again."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import minimill.cli


def test_a_process_pool_worker_reloading_the_main_module_starts_no_command() -> None:
    # anyio.to_process (serve's batch jobs) runs the parent's main module in each worker under
    # the name __mp_main__: the command must not run there (it would exit the worker).
    main = Path(minimill.cli.__file__).parent / "__main__.py"
    namespace = runpy.run_path(str(main), run_name="__mp_main__")
    assert callable(namespace["app"])


def test_python_dash_m_runs_the_command() -> None:
    done = subprocess.run([sys.executable, "-m", "minimill.cli", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "serve" in done.stdout and "worker" in done.stdout
