"""Output tokens/s over a sliding window, for engines that do not measure it themselves."""

from __future__ import annotations

import time
from collections import deque


class TokenRate:
    """Counts tokens in time buckets of one second and reports the recent rate."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._buckets: deque[tuple[int, int]] = deque()  # (second, tokens in that second)
        self._started = time.monotonic()

    def add(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        second = int(time.monotonic())
        if self._buckets and self._buckets[-1][0] == second:
            last = self._buckets.pop()
            self._buckets.append((second, last[1] + num_tokens))
        else:
            self._buckets.append((second, num_tokens))
        self._trim()

    def _trim(self) -> None:
        horizon = time.monotonic() - self.window_s
        while self._buckets and self._buckets[0][0] < horizon:
            self._buckets.popleft()

    def per_s(self) -> float | None:
        """Tokens/s over the window (or since the first token, if that is shorter)."""
        self._trim()
        if not self._buckets:
            return None
        span = min(self.window_s, time.monotonic() - max(self._started, self._buckets[0][0]))
        return sum(n for _, n in self._buckets) / max(span, 1.0)
