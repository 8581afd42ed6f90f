"""Placement is a pure function of (snapshot, clock)."""

from __future__ import annotations

from minimill.control.placement import Candidate, Outage, SiteState, Snapshot, place
from minimill.control.records import Tier

NOW = 1_000_000.0


def cand(rid: str, tier: Tier = Tier.BACKGROUND, seq: int = 0, deadline: float = NOW + 86400,
         tokens: int | None = 16, model: str = "m") -> Candidate:
    return Candidate(request_id=rid, tier=tier, model=model, seq=seq, deadline=deadline,
                     remaining_tokens=tokens)


def snap(*candidates: Candidate, capacity: int = 10,
         outages: tuple[Outage, ...] = ()) -> Snapshot:
    site = SiteState(site_id="s", price_per_hour=0.1, tokens_per_s=50.0, in_flight=0,
                     last_seen_at=NOW, outages=outages)
    return Snapshot(site=site, capacity=capacity, models=frozenset({"m"}),
                    candidates=candidates, sites=(site,))


def test_realtime_first_fifo_then_background_by_deadline() -> None:
    picked = place(snap(cand("b-late", seq=1, deadline=NOW + 9000),
                        cand("r2", Tier.REALTIME, seq=5), cand("r1", Tier.REALTIME, seq=3),
                        cand("b-early", seq=9, deadline=NOW + 100),
                        cand("b-early-first", seq=8, deadline=NOW + 100)), NOW)
    assert picked == ["r1", "r2", "b-early-first", "b-early", "b-late"]


def test_capacity_and_models() -> None:
    candidates = [cand(f"c{i}", seq=i) for i in range(5)] + [cand("other", model="x")]
    assert place(snap(*candidates, capacity=3), NOW) == ["c0", "c1", "c2"]
    assert place(snap(*candidates, capacity=0), NOW) == []
    assert "other" not in place(snap(*candidates), NOW)


def test_outages_drain_the_site_ahead_of_time() -> None:
    soon = (Outage(NOW + 20, NOW + 600),)
    # 16 tokens at the assumed 2 tokens/s take 8 s: fits before the outage; 100 tokens do not.
    picked = place(snap(cand("short", tokens=16), cand("long", seq=1, tokens=100),
                        cand("unknown", seq=2, tokens=None), outages=soon), NOW)
    assert picked == ["short"]
    assert place(snap(cand("any"), outages=(Outage(NOW - 5, NOW + 5),)), NOW) == []
    assert place(snap(cand("any"), outages=(Outage(NOW - 50, NOW - 5),)), NOW) == ["any"]


def test_same_inputs_same_answer() -> None:
    s = snap(*[cand(f"c{i}", seq=i % 3, deadline=NOW + i) for i in range(20)], capacity=7)
    assert place(s, NOW) == place(s, NOW)
