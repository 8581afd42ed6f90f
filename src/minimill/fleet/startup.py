"""Where a worker's start goes, from the process's birth to its first lease answer.

A restarted worker is a site that does no work, so its start is measured phase by phase and
logged as one line ("start: ... to first lease: interpreter and imports ..., model ..."),
which benchmarks and operators read to see what a restart costs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc; None elsewhere)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    # Field 22 of stat (the 20th after the command name) is the start time in clock ticks.
    return max(uptime_s - int(fields[19]) / ticks, 0.0)


class StartClock:
    """Phases of a start, each from the end of the previous one."""

    def __init__(self) -> None:
        age = process_age_s()
        self.started_at = time.monotonic() - (age or 0.0)
        self.phases: list[tuple[str, float]] = []
        self._last = self.started_at
        if age is not None:
            self.mark("interpreter and imports")

    def mark(self, phase: str) -> None:
        """The phase that just ended."""
        now = time.monotonic()
        self.phases.append((phase, now - self._last))
        self._last = now

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_at

    def summary(self, until: str) -> str:
        parts = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in self.phases)
        return f"start: {self.elapsed_s():.2f}s to {until} ({parts})"
