"""The busy throughput a worker reports to placement: time the engine stood idle between
steps is not counted, overlapping lane steps are counted once, old steps leave the window."""

from __future__ import annotations

import time
import types

import pytest
from engine_helpers import PROMPTS

from minimill.engine import core
from minimill.engine.busy_rate import BusyRate
from minimill.engine.llm import LLM
from minimill.engine.params import SamplingParams


def test_an_idle_gap_between_bursts_is_not_busy_time() -> None:
    rate = BusyRate(window_s=300.0)
    rate.record(0.0, 1.0, 10)
    rate.record(100.0, 101.0, 10)  # a trickle: one step every 100 s
    assert rate.tokens_per_s() == pytest.approx(10.0)


def test_overlapping_steps_are_counted_once() -> None:
    rate = BusyRate()
    rate.record(0.0, 1.0, 10)
    rate.record(0.5, 1.5, 10)  # a second lane's step, started while the first ran
    rate.record(0.2, 1.2, 10)  # ended before the last one: no busy time of its own
    assert rate.tokens_per_s() == pytest.approx(30 / 1.5)


def test_steps_older_than_the_window_are_dropped() -> None:
    rate = BusyRate(window_s=30.0)
    assert rate.tokens_per_s() == 0.0
    rate.record(0.0, 1.0, 1000)
    rate.record(40.0, 42.0, 10)
    assert rate.tokens_per_s() == pytest.approx(5.0)


def test_the_engine_measures_the_same_rate_after_standing_idle(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real engine stands idle 20 s (its clock moved on) between two equal bursts: the rate
    it reports after the second is that of its stepping, not of 20 s mostly idle."""
    offset = 0.0
    clock = types.SimpleNamespace(monotonic=lambda: time.monotonic() + offset,
                                  perf_counter=time.perf_counter)
    monkeypatch.setattr(core, "time", clock)
    llm.engine._busy_rate = BusyRate()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPTS[:4], params)
    alone = llm.engine.recent_output_tok_s()
    offset = 20.0
    llm.generate(PROMPTS[:4], params)
    after_idle = llm.engine.recent_output_tok_s()
    assert alone > 0
    # Idle time counted would put it at (busy)/(20 s + busy) of the rate: under 0.05 of it
    # for bursts that take under a second, under 0.2 for bursts of 5 s.
    assert after_idle > 0.3 * alone, (alone, after_idle)
