"""What one policy's run produced: the counters and series the report is made of."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Tally:
    """What one policy's run produced."""

    completed: int = 0
    goodput_tokens: float = 0.0
    wasted_tokens: float = 0.0
    cost_usd: float = 0.0
    duplicate_completions: int = 0
    stale_completions: int = 0
    deadline_misses: int = 0
    leases: int = 0
    lease_expiries: int = 0
    handbacks: int = 0
    placed_in_announced_outage: int = 0
    last_completion: float = 0.0
    latency: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    weight: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    tokens_by_hour: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    cost_by_hour: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    site_tokens: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    # Requests leased, by (site id, tier): where the work went.
    placed: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
