"""Placement over the ranked index (peer_ranks.py) decides as ranking every peer did
(placement_reference.py), on generated fleets of mixed kinds; and the index a view keeps
current (RankIndex: puts and a moving clock) ranks as one built afresh."""

from __future__ import annotations

import random
from dataclasses import replace

import placement_reference as reference
import pytest

from minimill.control.peer_ranks import FleetRanks, RankIndex
from minimill.control.placement import (
    DEFAULT_POLICY,
    Backlog,
    Candidate,
    Outage,
    SiteState,
    Snapshot,
    deadline_at_risk,
    needs_backlog,
    peer_room,
    place,
)
from minimill.control.price_schedule import PriceSchedule
from minimill.control.records import Tier

NOW = 1_000_000.0
CHIPS = ("cpu", "h100", "mi300", None)
# Prices within and beyond the tolerance of each other (0.15).
PRICES = (0.1, 0.11, 0.2, 0.5, 1.0, 1.05)
RATES = (None, 20.0, 22.0, 50.0, 100.0, 400.0)


def site(rng: random.Random, i: int, now: float = NOW) -> SiteState:
    seen = now - rng.choice((0.0, 1.0, 3.0, 20.0, 40.0))  # some silent past alive_within_s
    outages: tuple[Outage, ...] = ()
    if rng.random() < 0.15:
        start = now + rng.choice((-30.0, 10.0, 100.0, 5000.0))
        outages = (Outage(start, start + 600.0),)
    schedule = None
    if rng.random() < 0.1:
        schedule = PriceSchedule(start_at=now - 1800.0,
                                 hourly_usd=(rng.choice(PRICES), rng.choice(PRICES)))
    granted = rng.choice((0, 10, 100))
    return SiteState(
        site_id=f"s{i:03d}", price_per_hour=rng.choice(PRICES),
        tokens_per_s=rng.choice(RATES), in_flight=rng.randint(0, 8), last_seen_at=seen,
        outages=outages, free_capacity=rng.choice((0, 0, 1, 3, 16)),
        capacity_at=seen - rng.choice((0.0, 0.0, 2.0, 6.0)),
        models=rng.choice((frozenset({"m"}), frozenset({"m", "x"}), frozenset({"x"}), None)),
        first_seen_at=seen - 3600.0, up_s=3600.0 * rng.choice((1.0, 1.0, 0.95, 0.7)),
        leases_granted=granted, leases_expired=rng.choice((0, 0, 1, granted // 3)),
        chip=rng.choice(CHIPS), price_schedule=schedule,
        sessions=frozenset(rng.sample(("a", "b", "c"), rng.randint(0, 2))))


def candidates(rng: random.Random, n: int) -> tuple[Candidate, ...]:
    return tuple(Candidate(
        request_id=f"r{i}", tier=Tier.REALTIME if rng.random() < 0.3 else Tier.BACKGROUND,
        model=rng.choice(("m", "m", "m", "x")), seq=i,
        deadline=NOW + rng.choice((60.0, 600.0, 3600.0, 86400.0)),
        remaining_tokens=rng.choice((8, 64, 512, None)),
        session=rng.choice((None, None, "a", "b", "c")),
        tenant=rng.choice(("t1", "t2"))) for i in range(n))


def fleet(seed: int, num_sites: int) -> Snapshot:
    rng = random.Random(seed)
    sites = [site(rng, i) for i in range(num_sites)]
    me = sites[rng.randrange(num_sites)]
    backlog = tuple(Backlog(deadline=NOW + rng.choice((60.0, 600.0, 3600.0)),
                            site_id=rng.choice((None, *(s.site_id for s in sites[:5]))),
                            num_requests=3, max_tokens=rng.choice((100, 5_000, 200_000)),
                            num_unbounded=rng.randint(0, 2)) for _ in range(rng.randint(0, 4)))
    return Snapshot(site=me, capacity=rng.choice((1, 4, 16)), models=frozenset({"m"}),
                    candidates=candidates(rng, rng.randint(0, 60)), sites=tuple(sites),
                    backlog=backlog, tenant_load={"t1": 100.0, "t2": 0.0},
                    background_beyond=rng.choice((0, 0, 40)))


@pytest.mark.parametrize("seed", range(300))
def test_ranked_placement_decides_as_ranking_every_peer(seed: int) -> None:
    snapshot = fleet(seed, num_sites=random.Random(seed).choice((2, 5, 20, 60)))
    assert peer_room(snapshot, NOW) == reference.peer_room(snapshot, NOW)
    assert needs_backlog(snapshot, NOW) == reference.needs_backlog(snapshot, NOW)
    assert deadline_at_risk(snapshot, NOW) == reference.deadline_at_risk(snapshot, NOW)
    assert place(snapshot, NOW) == reference.place(snapshot, NOW)
    # ...and through an index the snapshot carries, as lease calls pass it.
    carried = replace(snapshot, ranks=FleetRanks.of(snapshot.sites, NOW, DEFAULT_POLICY))
    assert place(carried, NOW) == reference.place(snapshot, NOW)


def test_the_generated_fleets_exercise_every_rank() -> None:
    """The comparison above means something only if its fleets have peers that go first,
    equals that share, work held elsewhere and deadlines at risk."""
    seen = {"ahead": 0, "shared": 0, "backlog": 0, "risk": 0, "placed": 0}
    for seed in range(300):
        snapshot = fleet(seed, num_sites=20)
        ahead, shared = reference.peer_room(snapshot, NOW)
        seen["ahead"] += ahead > 0
        seen["shared"] += shared > 0
        seen["backlog"] += reference.needs_backlog(snapshot, NOW)
        seen["risk"] += reference.deadline_at_risk(snapshot, NOW) is not None
        seen["placed"] += bool(reference.place(snapshot, NOW))
    assert all(count >= 10 for count in seen.values()), seen


def test_a_fleet_of_one_kind_is_one_group_whatever_its_size() -> None:
    """Same chip, same price: a lease call compares the asking site with one class, however
    many sites it has and whatever each measured."""
    sites = [SiteState(site_id=f"s{i:04d}", price_per_hour=1.0, tokens_per_s=30.0 + i % 7,
                       in_flight=i % 16, last_seen_at=NOW, free_capacity=16 - i % 16,
                       capacity_at=NOW, first_seen_at=NOW - 60, up_s=60.0, chip="cpu")
             for i in range(1000)]
    ranks = FleetRanks.of(sites, NOW, DEFAULT_POLICY)
    rated = ranks.standing(sites[0], NOW)
    assert len(rated.groups) == 1
    assert rated.room_shared() == sum(16 - i % 16 for i in range(1, 1000))
    snapshot = Snapshot(site=sites[0], capacity=16, models=frozenset({"m"}),
                        candidates=candidates(random.Random(1), 40), sites=tuple(sites),
                        ranks=ranks)
    assert place(snapshot, NOW) == reference.place(snapshot, NOW)


@pytest.mark.parametrize("seed", range(40))
def test_an_index_kept_current_ranks_as_one_built_afresh(seed: int) -> None:
    """Puts (what lease calls write) and a clock that moves past capacity reports, silences,
    outages and a price's hour: the ranks the index hands out place work as fresh ranks of the
    same sites at the same time."""
    rng = random.Random(seed)
    sites = {s.site_id: s for s in (site(rng, i) for i in range(30))}
    index = RankIndex(sites.values(), NOW, DEFAULT_POLICY)
    now = NOW
    for _ in range(25):
        now += rng.choice((0.0, 0.3, 1.0, 4.0, 9.0, 31.0))
        for _ in range(rng.randint(0, 3)):
            fresh = replace(site(rng, rng.randrange(30), now), outages=())
            old = sites[fresh.site_id]
            fresh = replace(fresh, outages=old.outages, price_schedule=old.price_schedule)
            sites[fresh.site_id] = fresh
            index.put(fresh, now)
        held = index.at(now)
        afresh = FleetRanks.of(sites.values(), now, DEFAULT_POLICY)
        me = sites[f"s{rng.randrange(30):03d}"]
        snapshot = Snapshot(site=me, capacity=8, models=frozenset({"m"}),
                            candidates=candidates(rng, 30), sites=tuple(sites.values()))
        assert place(replace(snapshot, ranks=held), now) == place(
            replace(snapshot, ranks=afresh), now) == reference.place(snapshot, now)
        kept, built = held.standing(me, now), afresh.standing(me, now)
        assert (kept.room_ahead(), kept.room_shared()) == (built.room_ahead(),
                                                           built.room_shared())
        assert kept.equals()[:2] == built.equals()[:2]
        assert kept.equals()[2] == pytest.approx(built.equals()[2])
