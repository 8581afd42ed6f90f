"""The engine's busy throughput: output tokens per second of stepping, over a recent window.

A site's workers report this rate and placement ranks sites by it (price over busy rate), so it
must say what the machine does while it works, not how much work it was given: the time
between steps when the engine had nothing to run is left out. A site fed a trickle (a request
every ten seconds) would otherwise measure a tenth of a token per second, look dearer than an
unmeasured peer ten times its price, and lose its work to it.

Steps of lanes overlap (core_split.py): each step counts only the time since the last step
ended (or since it started, if later), so overlapping steps are not counted twice.
"""

from __future__ import annotations

from collections import deque

WINDOW_S = 30.0


class BusyRate:
    """Output tokens over busy seconds, for steps that ended in the last `window_s`."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._steps: deque[tuple[float, float, int]] = deque()  # (ended, busy s, tokens)
        self._last_end: float | None = None

    def record(self, started: float, ended: float, tokens: int) -> None:
        """A step that ran from `started` to `ended` (monotonic seconds) and made `tokens`."""
        since = started if self._last_end is None else max(started, self._last_end)
        self._steps.append((ended, max(0.0, ended - since), tokens))
        self._last_end = ended if self._last_end is None else max(self._last_end, ended)
        while self._steps and ended - self._steps[0][0] > self.window_s:
            self._steps.popleft()

    def tokens_per_s(self) -> float:
        """0.0 until a step that made tokens took measurable time."""
        busy = sum(s for _, s, _ in self._steps)
        tokens = sum(n for _, _, n in self._steps)
        return tokens / busy if busy > 0 and tokens > 0 else 0.0
