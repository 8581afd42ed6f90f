"""`bench batch` rounds: each served run is held to the offline runs just before and after it."""

from __future__ import annotations

import pytest

from minimill.bench.batch_bench import _round_report


def test_a_round_is_held_to_both_neighbours_by_their_tokens_over_their_time() -> None:
    served = {"output_tok_s": 900.0, "seconds": 35.0, "steal_share": 0.01}
    before = {"output_tokens": 30_000, "seconds": 30.0}  # 1,000 tok/s
    after = {"output_tokens": 30_000, "seconds": 20.0}   # 1,500 tok/s
    report = _round_report(served, before, after)
    # 60,000 tokens in 50 s: 1,200 tok/s, not the mean of the two rates (1,250).
    assert report["engine_output_tok_s"] == pytest.approx(1_200.0)
    assert report["ratio"] == pytest.approx(0.75)
    assert report["output_tok_s"] == 900.0 and report["steal_share"] == 0.01


def test_a_slower_machine_after_the_served_run_lowers_the_yardstick_not_the_served_figure(
        ) -> None:
    served = {"output_tok_s": 900.0, "seconds": 35.0, "steal_share": None}
    fast = {"output_tokens": 30_000, "seconds": 30.0}
    slow = {"output_tokens": 30_000, "seconds": 60.0}
    assert _round_report(served, fast, slow)["ratio"] > _round_report(served, fast, fast)["ratio"]
