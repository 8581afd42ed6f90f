"""CPU steal over a timed region: the share of the VM's CPU time the hypervisor gave elsewhere.

On shared cloud VMs steal moves from one minute to the next (1-50% has been seen on the 2-core
machines this project runs on), and it lands on whichever side of a comparison happens to run
then. Every bench prints it beside its figures so a reader can tell the machine from the code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

PROC_STAT = Path("/proc/stat")


def cpu_times() -> tuple[int, int] | None:
    """(steal, total) jiffies summed over all CPUs since boot; None where /proc/stat is absent."""
    try:
        first = PROC_STAT.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if first[0] != "cpu" or len(first) < 9:
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is already
    # counted in user, so the total stops at steal.
    values = [int(v) for v in first[1:9]]
    return values[7], sum(values)


@dataclass
class StealMeter:
    """`with StealMeter() as steal: ...` then `steal.share` (0-1, None where unknown)."""

    share: float | None = None
    _start: tuple[int, int] | None = field(default=None, repr=False)

    def __enter__(self) -> StealMeter:
        self._start = cpu_times()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        end = cpu_times()
        if self._start is None or end is None:
            return
        steal, total = end[0] - self._start[0], end[1] - self._start[1]
        self.share = round(steal / total, 4) if total > 0 else None
