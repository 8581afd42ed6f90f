"""A Fenwick (binary indexed) tree: prefix sums under point updates in O(log n). The
simulator keeps the expected throughput of live sites in ranking order in one, to ask "how
fast are the live sites cheaper than this one" at every lease call of a 10,000-site fleet."""

from __future__ import annotations


class Fenwick:
    def __init__(self, size: int) -> None:
        self.tree = [0.0] * (size + 1)

    def add(self, index: int, delta: float) -> None:
        i = index + 1
        while i < len(self.tree):
            self.tree[i] += delta
            i += i & -i

    def prefix(self, count: int) -> float:
        """Sum of the first `count` entries."""
        total, i = 0.0, min(count, len(self.tree) - 1)
        while i > 0:
            total += self.tree[i]
            i -= i & -i
        return total
