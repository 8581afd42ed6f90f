"""What every attack test checks last: the boxes around it still answer."""

from __future__ import annotations

from minimill.client.boxes import Box


def assert_healthy(*boxes: Box) -> None:
    for box in boxes:
        result = box.exec("echo alive")
        assert (result.exit_code, result.stdout) == (0, "alive\n"), result
