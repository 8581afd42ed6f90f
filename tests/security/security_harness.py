"""What attack tests share: the boxes around an attack still answer; the CLI as an operator
runs it."""

from __future__ import annotations

import subprocess
import sys

from minimill.client.boxes import Box


def minimill(*args: str) -> subprocess.CompletedProcess[str]:
    """`minimill ARGS` as a process of its own."""
    return subprocess.run([sys.executable, "-m", "minimill.cli", *args], capture_output=True,
                          text=True, timeout=60)


def assert_healthy(*boxes: Box) -> None:
    for box in boxes:
        result = box.exec("echo alive")
        assert (result.exit_code, result.stdout) == (0, "alive\n"), result
