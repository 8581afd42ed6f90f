"""`minimill serve` on a machine without bubblewrap: tokens are served, and the first lines it
prints say plainly that boxes and agents are off, and why."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from serve_process import free_port, make_home

from minimill.lifetime import owned_env


@pytest.mark.timeout(180)
def test_the_first_lines_say_boxes_and_agents_are_off_without_bubblewrap(
        tmp_path: Path, model_file: Path) -> None:
    home = make_home(tmp_path, model_file.parent.parent)
    no_tools = tmp_path / "bin"  # a PATH with no bwrap on it (python is named in full)
    no_tools.mkdir()
    env = {**os.environ, "MINIMILL_HOME": str(home), "PATH": str(no_tools)}
    proc = subprocess.Popen([sys.executable, "-m", "minimill.cli", "serve", "--port",
                             str(free_port())], env=owned_env(env), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stderr is not None
        first, second = proc.stderr.readline(), proc.stderr.readline()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert first.startswith("minimill serve: boxes are off: bubblewrap (bwrap) is not "
                            "installed"), first
    assert second.startswith("minimill serve: agents are off: "), second
    assert "bubblewrap" in second
