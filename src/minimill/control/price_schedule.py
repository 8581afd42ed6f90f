"""A site's price that follows a schedule: hourly $/h from a start time (e.g. a power price or a
solar forecast), repeating. Pure data and arithmetic: placement reads it under any clock.

Outside a non-repeating schedule, the site's declared price_per_hour applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

HOUR_S = 3600.0
# Most hourly entries one schedule may hold (a year).
MAX_HOURS = 24 * 366


@dataclass(frozen=True, slots=True)
class PriceSchedule:
    start_at: float  # Unix seconds of the first hour's start
    hourly_usd: tuple[float, ...]  # $/h of each hour from start_at
    repeat: bool = True  # after the last hour, start over (a daily profile: 24 entries)

    def price_at(self, t: float) -> float | None:
        """$/h at time `t` (None: outside a non-repeating schedule)."""
        if not self.hourly_usd:
            return None
        hour = math.floor((t - self.start_at) / HOUR_S)
        if self.repeat:
            return self.hourly_usd[hour % len(self.hourly_usd)]
        if 0 <= hour < len(self.hourly_usd):
            return self.hourly_usd[hour]
        return None

    def hour_starts(self, start: float, end: float) -> list[float]:
        """The hour boundaries of the schedule in (start, end]."""
        first = self.start_at + math.floor((start - self.start_at) / HOUR_S + 1) * HOUR_S
        count = max(0, math.floor((end - first) / HOUR_S) + 1)
        return [first + i * HOUR_S for i in range(min(count, MAX_HOURS))]

    def to_json(self) -> dict[str, Any]:
        return {"start_at": self.start_at, "hourly_usd": list(self.hourly_usd),
                "repeat": self.repeat}


def utc_day_start(t: float) -> float:
    """The start of the UTC day holding `t`: where a bare list of hourly prices begins."""
    return math.floor(t / 86400.0) * 86400.0


def parse(data: Any, default_start: float) -> PriceSchedule:
    """A schedule from JSON/YAML data: a list of hourly $/h (from `default_start`, repeating),
    or {"start_at": unix seconds, "hourly_usd": [...], "repeat": bool}. ValueError if bad."""
    if isinstance(data, list):
        data = {"hourly_usd": data}
    if not isinstance(data, dict):
        raise ValueError("a price schedule is a list of hourly $/h or an object with hourly_usd")
    hourly = data.get("hourly_usd")
    if not isinstance(hourly, list) or not 1 <= len(hourly) <= MAX_HOURS:
        raise ValueError(f"hourly_usd must be a list of 1 to {MAX_HOURS} prices")
    prices: list[float] = []
    for value in hourly:
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                math.isfinite(value) and 0 <= value <= 1e6):
            raise ValueError("each hourly price must be a number in [0, 1e6]")
        prices.append(float(value))
    start = data.get("start_at", default_start)
    if isinstance(start, bool) or not isinstance(start, int | float) or not math.isfinite(start):
        raise ValueError("start_at must be Unix seconds")
    return PriceSchedule(float(start), tuple(prices), bool(data.get("repeat", True)))
