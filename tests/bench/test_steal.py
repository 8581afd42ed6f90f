"""CPU steal over a region, read from this machine's /proc/stat."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from minimill.bench import steal
from minimill.bench.steal import StealMeter, cpu_times


def test_steal_share_is_a_share_of_the_cpu_time_that_passed() -> None:
    before = cpu_times()
    assert before is not None and 0 <= before[0] < before[1]
    with StealMeter() as meter:
        deadline = time.perf_counter() + 0.3
        while time.perf_counter() < deadline:  # CPU time must pass for the share to exist
            pass
    assert meter.share is not None and 0 <= meter.share < 1
    after = cpu_times()
    assert after is not None and after[1] > before[1] and after[0] >= before[0]


def test_steal_share_is_unknown_without_proc_stat(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    monkeypatch.setattr(steal, "PROC_STAT", tmp_path / "absent")
    with StealMeter() as meter:
        pass
    assert meter.share is None


def test_steal_is_the_eighth_field_and_guest_time_is_not_counted_twice(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    monkeypatch.setattr(steal, "PROC_STAT", stat)
    stat.write_text("cpu  100 0 50 800 10 0 0 40 30 0\ncpu0 1 2 3\n")
    assert cpu_times() == (40, 1000)
    with StealMeter() as meter:
        stat.write_text("cpu  200 0 100 1400 10 0 0 140 90 0\n")
    assert meter.share == pytest.approx(100 / 850, abs=1e-4)
