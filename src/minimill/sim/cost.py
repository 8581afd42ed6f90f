"""The cost model: what a million (and a trillion) output tokens cost on a chip, from its
$/hour and a measured throughput (a number, or `minimill bench engine --json` output), beside
reference prices the user gives. The formula is metering's, the one the control plane costs
sites with."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from minimill.control import metering


class CostError(ValueError):
    """Bad input to the cost model; the message says which."""


@dataclass(frozen=True, slots=True)
class Reference:
    name: str
    usd_per_mtok: float
    ratio: float  # reference price over our cost: how many times cheaper we make tokens


@dataclass(frozen=True, slots=True)
class CostReport:
    usd_per_hour: float
    tokens_per_s: float
    tokens_per_s_source: str
    uptime: float
    usd_per_mtok: float
    usd_per_ttok: float
    references: list[Reference]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def bench_tokens_per_s(path: Path) -> float:
    """output_tok_s of a `bench engine --json` file (the mean, if it holds several runs)."""
    try:
        lines = [json.loads(line) for line in path.read_text().splitlines()
                 if line.strip().startswith("{")]
        rates = [float(row["output_tok_s"]) for row in lines]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CostError(f"{path}: not `minimill bench engine --json` output ({e})") from e
    if not rates:
        raise CostError(f"{path}: no `minimill bench engine --json` output in it")
    return sum(rates) / len(rates)


def parse_reference(text: str) -> tuple[str, float]:
    """NAME=USD_PER_MTOK."""
    name, sep, value = text.partition("=")
    try:
        price = float(value)
    except ValueError:
        price = -1.0
    if not sep or not name or not price > 0:
        raise CostError(f"reference {text!r}: expected NAME=USD_PER_MTOK, e.g. api=0.60")
    return name, price


def cost(usd_per_hour: float, tokens_per_s: float, source: str, uptime: float = 1.0,
         references: list[tuple[str, float]] | None = None) -> CostReport:
    """Cost per token when the chip's hours are paid for and it is busy `uptime` of them."""
    if not usd_per_hour >= 0:
        raise CostError("usd_per_hour must be >= 0")
    if not tokens_per_s > 0:
        raise CostError("tokens_per_s must be > 0")
    if not 0 < uptime <= 1:
        raise CostError("uptime must be in (0, 1]")
    per_mtok = metering.cost_usd_per_mtok(usd_per_hour, tokens_per_s)
    assert per_mtok is not None
    per_mtok /= uptime
    refs = [Reference(name, price, round(price / per_mtok, 3) if per_mtok > 0 else 0.0)
            for name, price in references or []]
    return CostReport(usd_per_hour, tokens_per_s, source, uptime, round(per_mtok, 6),
                      round(per_mtok * 1e6, 2), refs)
