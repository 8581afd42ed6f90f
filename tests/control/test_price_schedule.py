"""Prices that move: a site's hourly price schedule, and background work placed into the
cheapest hours that still meet its deadline (realtime never deferred)."""

from __future__ import annotations

import pytest

from minimill.control import price_schedule
from minimill.control.placement import (
    Backlog,
    Candidate,
    SiteState,
    Snapshot,
    background_key,
    defer_background,
    needs_backlog,
    place,
)
from minimill.control.price_schedule import PriceSchedule
from minimill.control.records import Tier

DAY = 86400.0
NOW = 100 * DAY  # midnight UTC
# Dear at night, cheap from 10:00 to 16:00 (solar).
SOLAR = PriceSchedule(start_at=0.0, hourly_usd=tuple(0.2 if 10 <= h < 16 else 1.0
                                                     for h in range(24)))


def site(schedule: PriceSchedule | None = SOLAR) -> SiteState:
    return SiteState(site_id="s", price_per_hour=1.0, tokens_per_s=100.0, in_flight=0,
                     last_seen_at=NOW, price_schedule=schedule)


def cand(rid: str, tier: Tier, deadline: float, tokens: int = 16) -> Candidate:
    return Candidate(request_id=rid, tier=tier, model="m", seq=0, deadline=deadline,
                     remaining_tokens=tokens)


def test_price_at_follows_the_hour_and_repeats() -> None:
    assert SOLAR.price_at(NOW + 11 * 3600) == 0.2
    assert SOLAR.price_at(NOW + 3 * 3600) == 1.0
    assert SOLAR.price_at(NOW + DAY + 12 * 3600) == 0.2
    once = PriceSchedule(NOW, (0.5,), repeat=False)
    assert once.price_at(NOW + 10) == 0.5 and once.price_at(NOW + 3601) is None
    assert site(once).price_at(NOW + 3601) == 1.0  # outside it: the flat price


def test_parse_accepts_a_list_or_an_object_and_rejects_junk() -> None:
    assert price_schedule.parse([1, 2], 7.0) == PriceSchedule(7.0, (1.0, 2.0))
    parsed = price_schedule.parse({"start_at": 5, "hourly_usd": [3], "repeat": False}, 0.0)
    assert parsed == PriceSchedule(5.0, (3.0,), repeat=False)
    for bad in ({"hourly_usd": []}, {"hourly_usd": ["x"]}, [-1], "1,2", [float("nan")]):
        with pytest.raises(ValueError):
            price_schedule.parse(bad, 0.0)


def test_background_waits_for_the_cheap_hours_that_still_meet_the_deadline() -> None:
    me = site()
    # Due tomorrow: the 10:00 window is 5x cheaper and early enough.
    assert defer_background(me, NOW + DAY, 600.0, NOW, )
    # Due at 09:00: no cheaper hour starts early enough.
    assert not defer_background(me, NOW + 9 * 3600, 600.0, NOW)
    # Inside the cheap window already: run now.
    assert not defer_background(me, NOW + DAY, 600.0, NOW + 11 * 3600)
    # No schedule: never deferred.
    assert not defer_background(site(None), NOW + DAY, 600.0, NOW)


def test_the_last_leases_span_counts_toward_the_time_the_work_needs() -> None:
    me = site()
    # Due at 10:08: 240 s of the fleet's time, with the safety factor, fit before it from
    # 10:00, so the cheap hour is worth waiting for...
    deadline = NOW + 10 * 3600 + 480
    assert defer_background(me, deadline, 240.0, NOW)
    # ...but not when the work goes out in leases of 300 s: the last one, run by one site
    # alone, ends past the deadline if the work starts at 10:00.
    assert not defer_background(me, deadline, 240.0, NOW, tail_s=300.0)


def test_place_defers_background_but_never_realtime() -> None:
    me = site()
    snapshot = Snapshot(site=me, capacity=10, models=frozenset({"m"}), sites=(me,),
                        candidates=(cand("rt", Tier.REALTIME, NOW + 60),
                                    cand("bg-tomorrow", Tier.BACKGROUND, NOW + DAY),
                                    cand("bg-soon", Tier.BACKGROUND, NOW + 3600)))
    assert place(snapshot, NOW) == ["rt", "bg-soon"]
    assert place(snapshot, NOW + 11 * 3600) == ["rt", "bg-soon", "bg-tomorrow"]


def test_place_waits_for_the_cheap_hour_only_when_the_whole_backlog_still_fits() -> None:
    """A request's own time (16 tokens: 8 s) fits between 10:00 and a 10:30 deadline; the
    work due by it may not, at the rate of the live fleet (here the site alone, 100 tok/s)."""
    me = site()
    deadline = NOW + 10 * 3600 + 1800
    queue = tuple(cand(f"r{i}", Tier.BACKGROUND, deadline) for i in range(10))

    def placed(queued_tokens: int) -> list[str]:
        backlog = (Backlog(deadline=deadline, site_id=None, num_requests=queued_tokens // 16,
                           max_tokens=queued_tokens, num_unbounded=0),)
        snapshot = Snapshot(site=me, capacity=10, models=frozenset({"m"}), sites=(me,),
                            candidates=queue, backlog=backlog)
        assert needs_backlog(snapshot, NOW)  # a cheaper hour ahead: it reads the backlog
        return place(snapshot, NOW)

    assert placed(160) == []  # 2 s of work: it waits for 10:00
    # 2000 s of work at 100 tok/s from 10:00 would end past 10:30: it starts now.
    assert placed(200_000) == [f"r{i}" for i in range(10)]
    # Inside the cheap hours no cheaper one lies ahead: the backlog is not worth its query.
    inside = Snapshot(site=me, capacity=10, models=frozenset({"m"}), sites=(me,),
                      candidates=queue)
    assert not needs_backlog(inside, NOW + 10 * 3600 + 60)


def test_sites_rank_at_their_price_now() -> None:
    flat = SiteState(site_id="flat", price_per_hour=0.5, tokens_per_s=100.0, in_flight=0,
                     last_seen_at=NOW)
    me = site()
    assert background_key(flat, NOW) < background_key(me, NOW)  # night: solar site dearer
    assert background_key(me, NOW + 12 * 3600) < background_key(flat, NOW + 12 * 3600)
