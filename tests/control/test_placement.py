"""Placement is a pure function of (snapshot, clock): cost, reliability, speed, outages,
deadlines."""

from __future__ import annotations

from dataclasses import replace

import pytest

from minimill.control import ranking, site_health
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


# ---- cost, reliability, speed and deadlines: the asking site and its peers -----------------

def peer(site_id: str, price: float = 0.1, tps: float | None = 100.0, free: int = 10, *,
         seen: float = NOW, capacity_at: float | None = NOW, granted: int = 0,
         expired: int = 0, outages: tuple[Outage, ...] = (),
         models: frozenset[str] | None = frozenset({"m"})) -> SiteState:
    return SiteState(site_id=site_id, price_per_hour=price, tokens_per_s=tps, in_flight=0,
                     last_seen_at=seen, outages=outages, free_capacity=free,
                     capacity_at=capacity_at, models=models, first_seen_at=seen - 3600,
                     up_s=3600.0, leases_granted=granted, leases_expired=expired)


def ask_as(me: SiteState, *candidates: Candidate, others: tuple[SiteState, ...] = (),
           capacity: int = 10, backlog: tuple[Backlog, ...] = ()) -> list[str]:
    return place(Snapshot(site=me, capacity=capacity, models=frozenset({"m"}),
                          candidates=candidates, sites=(me, *others), backlog=backlog), NOW)


def work(n: int, tier: Tier = Tier.BACKGROUND, tokens: int | None = 16,
         deadline: float = NOW + 86400) -> list[Candidate]:
    return [cand(f"{tier.value[0]}{i}", tier, seq=i, tokens=tokens, deadline=deadline)
            for i in range(n)]


def test_background_goes_to_the_cheap_site_while_it_has_room() -> None:
    cheap, dear = peer("cheap", price=0.05, free=8), peer("dear", price=0.50)
    queue = work(12)
    assert ask_as(cheap, *queue, others=(dear,)) == [c.request_id for c in queue[:10]]
    # The dear site leaves the cheap site's 8 free slots their work and takes the rest.
    assert ask_as(dear, *queue, others=(cheap,)) == ["b8", "b9", "b10", "b11"]
    assert ask_as(dear, *queue[:8], others=(cheap,)) == []
    # A full cheap site: the dear one helps at once.
    assert ask_as(dear, *queue[:8], others=(replace(cheap, free_capacity=0),)) == \
        [c.request_id for c in queue[:8]]


def test_a_cheap_site_that_went_quiet_or_dark_reserves_nothing() -> None:
    cheap, dear = peer("cheap", price=0.05, free=8), peer("dear", price=0.50)
    queue = work(4)
    everything = [c.request_id for c in queue]
    stale_report = replace(cheap, capacity_at=NOW - 6)  # its worker stopped asking
    gone = replace(cheap, last_seen_at=NOW - 120, capacity_at=NOW - 120)
    dark = replace(cheap, outages=(Outage(NOW - 1, NOW + 600),))
    other_model = replace(cheap, models=frozenset({"x"}))
    for other in (stale_report, gone, dark, other_model):
        assert ask_as(dear, *queue, others=(other,)) == everything, other


def test_nearly_equal_sites_share_the_queue() -> None:
    a, b = peer("a", price=0.10), peer("b", price=0.104)  # 4% apart: within the tolerance
    # Equal room (10 free each): the first to ask takes half (rounded up), not all three.
    assert ask_as(b, *work(3), others=(a,)) == ["b0", "b1"]
    # A full peer leaves it everything; a peer gone quiet reserves nothing.
    assert ask_as(b, *work(3), others=(replace(a, free_capacity=0),)) == ["b0", "b1", "b2"]
    assert ask_as(b, *work(3), others=(replace(a, capacity_at=NOW - 60),)) == \
        ["b0", "b1", "b2"]


def test_equal_sites_with_room_split_background_work_in_turn() -> None:
    """Three equal sites, 256 free slots each, ask one after the other for a queue of 256:
    each ends with about a third, whoever asks first."""
    queue = work(256)
    held: dict[str, int] = {name: 0 for name in ("a", "b", "c")}
    left = list(queue)
    for name in ("a", "b", "c", "a", "b", "c"):
        me = replace(peer(name, free=256 - held[name]), in_flight=held[name])
        others = tuple(replace(peer(o, free=256 - held[o]), in_flight=held[o])
                       for o in held if o != name)
        picked = ask_as(me, *left, others=others, capacity=256 - held[name])
        held[name] += len(picked)
        left = [c for c in left if c.request_id not in picked]
    assert left == [] and sum(held.values()) == 256
    assert max(held.values()) - min(held.values()) <= 2, held


def test_fair_share_counts_what_each_already_holds_and_its_room() -> None:
    # b already holds 6 of its 10 slots; a holds none: of 6 new requests a takes enough to
    # even out the load (6 + 6 = 12 over 20 slots: 6 each), leaving b nothing.
    a = replace(peer("a", free=10), in_flight=0)
    b = replace(peer("b", free=4), in_flight=6)
    assert ask_as(a, *work(6), others=(b,)) == [f"b{i}" for i in range(6)]
    assert ask_as(replace(b, free_capacity=4), *work(6), others=(replace(a, free_capacity=10),),
                  capacity=4) == []
    # Twice the room, twice the share.
    big = peer("big", free=20)
    assert len(ask_as(big, *work(9), others=(peer("small", free=10),), capacity=20)) == 6


def test_work_no_equal_can_take_is_taken_anyway() -> None:
    # The equal peer serves another model, or drains for an outage the long requests would
    # not finish before: the asking site takes them all.
    queue = work(4, tokens=100)
    other_model = peer("other", models=frozenset({"x"}))
    draining = peer("draining", outages=(Outage(NOW + 20, NOW + 600),))
    for other in (other_model, draining):
        assert ask_as(peer("me"), *queue, others=(other,)) == [c.request_id for c in queue]


def test_realtime_is_not_split_among_equals() -> None:
    calls = work(4, Tier.REALTIME)
    assert ask_as(peer("a"), *calls, others=(peer("b"),)) == [c.request_id for c in calls]


def test_expected_loss_makes_a_nominally_cheap_site_dear() -> None:
    # Half its leases expired: each kept token costs it twice the sticker price.
    flaky = peer("flaky", price=0.08, granted=80, expired=50)
    solid = peer("solid", price=0.10)
    assert site_health.loss_fraction(flaky, NOW, DEFAULT_POLICY) == pytest.approx(0.5)
    assert site_health.effective_usd_per_mtok(flaky, NOW, DEFAULT_POLICY) == pytest.approx(
        0.08 / 3600 / 100 * 1e6 / 0.5)
    assert ask_as(solid, *work(3), others=(flaky,)) == ["b0", "b1", "b2"]
    assert ask_as(flaky, *work(3), others=(solid,)) == []
    # Without the losses the flaky site would be the cheap one.
    healthy = replace(flaky, leases_expired=0)
    assert ask_as(solid, *work(3), others=(healthy,)) == []


def test_observed_downtime_counts_as_expected_loss() -> None:
    # Seen for an hour, up for a quarter of it; an announced outage is not held against it.
    patchy = replace(peer("patchy", price=0.05), up_s=900.0)
    assert site_health.uptime(patchy, NOW, DEFAULT_POLICY) == pytest.approx(0.25)
    assert site_health.loss_fraction(patchy, NOW, DEFAULT_POLICY) == pytest.approx(0.75)
    announced = replace(patchy, outages=(Outage(NOW - 3600, NOW - 900),))
    assert site_health.uptime(announced, NOW, DEFAULT_POLICY) == pytest.approx(1.0)
    assert ask_as(peer("dear", price=0.15), *work(2), others=(patchy,)) == ["b0", "b1"]


def test_no_work_that_would_not_finish_before_an_outage_nor_during_it() -> None:
    soon = (Outage(NOW + 20, NOW + 600),)
    queue = (cand("short", tokens=16), cand("long", seq=1, tokens=100))
    draining = peer("cheap", price=0.05, outages=soon)
    # The draining cheap site takes the short request only; the dear site gets the long one.
    assert ask_as(draining, *queue, others=(peer("dear", price=0.5),)) == ["short"]
    assert ask_as(peer("dear", price=0.5), *queue, others=(draining,)) == ["long"]
    assert site_health.draining(draining, NOW, DEFAULT_POLICY)
    during = replace(draining, outages=(Outage(NOW - 1, NOW + 600),))
    assert ask_as(during, *queue) == []
    assert not site_health.draining(during, NOW, DEFAULT_POLICY)
    # 16 tokens at the assumed 2 tokens/s take 8 s: from 12 s before the outage, nothing fits.
    assert ask_as(replace(draining, outages=(Outage(NOW + 7, NOW + 600),)), *queue) == []


def test_realtime_goes_to_the_fastest_reliable_site_first() -> None:
    fast, slow = peer("fast", tps=400.0, free=2), peer("slow", tps=100.0)
    calls = work(3, Tier.REALTIME)
    assert ask_as(fast, *calls, others=(slow,)) == ["r0", "r1", "r2"]
    assert ask_as(slow, *calls, others=(fast,)) == ["r2"]  # only what the fast one has no room for
    assert ask_as(slow, *calls, others=(replace(fast, free_capacity=0),)) == ["r0", "r1", "r2"]
    # A fast site that loses work is not "reliable": the reliable slow one goes first.
    unreliable = replace(fast, leases_granted=80, leases_expired=30)
    assert ask_as(slow, *calls, others=(unreliable,)) == ["r0", "r1", "r2"]
    assert ask_as(unreliable, *calls, others=(replace(slow, free_capacity=1),)) == ["r1", "r2"]


def test_peers_run_realtime_before_their_background() -> None:
    # The cheap, fast peer's two free slots go to the two realtime calls: background is left
    # for the dear, slow asking site.
    cheap_fast = peer("cheap", price=0.05, tps=400.0, free=2)
    dear_slow = peer("dear", price=0.5, tps=100.0)
    queue = (*work(2, Tier.REALTIME), *work(2))
    assert ask_as(dear_slow, *queue, others=(cheap_fast,)) == ["b0", "b1"]


def test_a_deadline_at_risk_lets_a_dear_site_help() -> None:
    # The cheap site has slots for everything but makes 10 tokens/s: 50 requests of 100
    # tokens take it 500 s. Per token it costs a fifth of the dear one.
    cheap = peer("cheap", price=0.01, tps=10.0, free=100)
    dear = peer("dear", price=0.5, tps=100.0)
    soon, later = NOW + 60, NOW + 86400
    queue = work(50, tokens=100, deadline=soon)

    def backlog(deadline: float, leased_by_dear: int = 0) -> tuple[Backlog, ...]:
        queued = Backlog(deadline, None, 50 - leased_by_dear, (50 - leased_by_dear) * 100, 0)
        held = Backlog(deadline, "dear", leased_by_dear, leased_by_dear * 100, 0)
        return (queued, held) if leased_by_dear else (queued,)

    snapshot = Snapshot(site=dear, capacity=10, models=frozenset({"m"}),
                        candidates=tuple(queue), sites=(dear, cheap), backlog=backlog(soon))
    assert needs_backlog(snapshot, NOW)
    assert deadline_at_risk(snapshot, NOW) == soon
    assert ask_as(dear, *queue, others=(cheap,), backlog=backlog(soon)) == \
        [f"b{i}" for i in range(10)]
    # A day to go: no risk, the cheap site takes it all.
    relaxed = [replace(c, deadline=later) for c in queue]
    assert ask_as(dear, *relaxed, others=(cheap,), backlog=backlog(later)) == []
    # Once the dear site holds enough of it, what is left fits the cheap site's time.
    assert ask_as(dear, *queue[46:], others=(cheap,), backlog=backlog(soon, 46)) == []


def test_peer_room_counts_only_peers_that_go_first_and_equals_apart() -> None:
    me = peer("me", price=0.1, tps=100.0)
    others = (peer("cheaper", price=0.01, free=5), peer("faster", tps=1000.0, free=7),
              peer("dearer", price=1.0, free=100), peer("cheap-but-stale", price=0.01,
                                                        capacity_at=NOW - 60))
    snapshot = Snapshot(site=me, capacity=4, models=frozenset({"m"}), candidates=(),
                        sites=(me, *others))
    assert peer_room(snapshot, NOW) == (12, 0)
    # An equal peer's free slots are counted apart: the asking site must know how much work
    # it shares, not read it.
    equal = peer("equal", free=9)
    with_equal = replace(snapshot, sites=(me, *others, equal))
    assert peer_room(with_equal, NOW) == (12, 9)
    assert not needs_backlog(replace(snapshot, sites=(me, others[2])), NOW)


def test_same_chip_sites_are_not_told_apart_by_the_load_they_were_given() -> None:
    # Two machines alike: the one that got more work measured 2.6x the other's rate. Taken
    # at face value it would look cheaper and take the whole queue next time; as the same
    # hardware they share it. A site that loses work gets less of it (in proportion to what
    # it keeps), not none; another chip name (or price) is still told apart by its rate.
    busy = replace(peer("busy", tps=442.0, free=200), chip="cpu")
    light = replace(peer("light", tps=167.0, free=200), chip="cpu")
    queue = work(96)
    assert len(ask_as(busy, *queue, others=(light,), capacity=200)) == 48
    assert len(ask_as(light, *queue, others=(busy,), capacity=200)) == 48
    assert not ranking.faster(busy, light, NOW, DEFAULT_POLICY)
    flaky = replace(light, leases_granted=80, leases_expired=50)  # keeps half its work
    assert len(ask_as(flaky, *queue, others=(busy,), capacity=200)) == 32
    assert len(ask_as(busy, *queue, others=(flaky,), capacity=200)) == 64
    assert ranking.faster(busy, flaky, NOW, DEFAULT_POLICY)  # realtime: reliable first
    restarting = replace(busy, tokens_per_s=6.8)  # measured mostly prefills
    assert len(ask_as(light, *queue, others=(restarting,), capacity=200)) == 48
    other_chip = replace(busy, chip="mi300")
    assert ask_as(light, *queue, others=(other_chip,), capacity=200) == []
    assert ranking.faster(other_chip, light, NOW, DEFAULT_POLICY)
    dearer = replace(busy, price_per_hour=0.2)
    assert not ranking.same_kind(dearer, light, DEFAULT_POLICY)
    assert not ranking.same_kind(replace(busy, chip=None), replace(light, chip=None),
                                 DEFAULT_POLICY)


def test_a_sessions_next_turn_goes_where_its_kv_is() -> None:
    turn = replace(cand("turn", Tier.REALTIME), session="tag-a")
    other = cand("other", seq=1)
    a, b = peer("a"), peer("b")
    holder = replace(b, sessions=frozenset({"tag-a"}))
    # b holds the session's KV and has room: a leaves the turn to it, but takes other work.
    assert ask_as(a, turn, other, others=(holder,)) == ["other"]
    assert ask_as(holder, turn, others=(a,)) == ["turn"]
    # Only a preference: a holder without room, or a much dearer one, does not keep it.
    assert "turn" in ask_as(a, turn, others=(replace(holder, free_capacity=0),))
    dear = replace(holder, price_per_hour=a.price_per_hour * 3)
    assert "turn" in ask_as(a, turn, others=(dear,))
    # A request of no session, or of a session nobody holds, is placed as before.
    assert ask_as(a, replace(turn, session="tag-z"), others=(holder,)) == ["turn"]
