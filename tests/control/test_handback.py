"""Handback ahead of an announced outage is a pure function of (site, held leases, peers,
clock): what would not finish goes back early when a peer has room for it, everything goes
back at the handback time, nothing without an outage."""

from __future__ import annotations

from dataclasses import replace

from minimill.control.handback import handback_due, per_request_tokens_per_s
from minimill.control.placement import DEFAULT_POLICY, Candidate, Outage, SiteState, fits
from minimill.control.records import Tier

NOW = 1_000_000.0
LEAD = DEFAULT_POLICY.handback_lead_s


def site(site_id: str, *, tps: float = 100.0, in_flight: int = 0, free: int = 0,
         outages: tuple[Outage, ...] = (), models: frozenset[str] = frozenset({"m"})
         ) -> SiteState:
    return SiteState(site_id=site_id, price_per_hour=0.1, tokens_per_s=tps,
                     in_flight=in_flight, last_seen_at=NOW, outages=outages,
                     free_capacity=free, capacity_at=NOW, models=models,
                     first_seen_at=NOW - 3600, up_s=3600.0)


def held(n: int, tokens: int | None) -> list[Candidate]:
    return [Candidate(request_id=f"h{i}", tier=Tier.BACKGROUND, model="m", seq=i,
                      deadline=NOW + 86400, remaining_tokens=tokens) for i in range(n)]


def test_nothing_without_an_outage_or_far_from_one() -> None:
    busy = site("busy", in_flight=4)
    helper = site("helper", free=8)
    assert handback_due(busy, held(4, 500), [busy, helper], NOW) == []
    far = replace(busy, outages=(Outage(NOW + 2 * 3600, NOW + 3 * 3600),))
    assert handback_due(far, held(4, 10_000), [far, helper], NOW) == []
    over = replace(busy, outages=(Outage(NOW - 600, NOW - 60),))
    assert handback_due(over, held(4, 10_000), [over, helper], NOW) == []


def test_work_that_would_not_finish_goes_to_a_peer_with_room() -> None:
    # 4 leases share 100 tokens/s: 25 tokens/s each. The outage is 60 s away, handback at
    # 55 s: 1000 tokens (40 s) finish in time, 2000 (80 s) do not.
    busy = site("busy", in_flight=4, outages=(Outage(NOW + 60, NOW + 600),))
    assert per_request_tokens_per_s(busy, DEFAULT_POLICY) == 25.0
    long = [replace(held(1, t)[0], request_id=f"long{i}", seq=10 + i)
            for i, t in enumerate((2000, 3000))]
    mine = [*held(2, 1000), *long]
    helper = site("helper", free=8)
    # Most work left first.
    assert handback_due(busy, mine, [busy, helper], NOW) == ["long1", "long0"]
    # No peer has room (or can run them): they stay until the handback time...
    full = replace(helper, free_capacity=0)
    other_model = replace(helper, models=frozenset({"x"}))
    for peer in (full, other_model):
        assert handback_due(busy, mine, [busy, peer], NOW) == []
    # ...only as many as the peer has room for go early.
    one_slot = replace(helper, free_capacity=1)
    assert handback_due(busy, mine, [busy, one_slot], NOW) == ["long1"]


def test_everything_goes_back_at_the_handback_time_and_during_the_outage() -> None:
    outage = Outage(NOW + LEAD - 1, NOW + 600)
    busy = site("busy", in_flight=3, outages=(outage,))
    mine = held(3, 1)  # would finish at once; still handed back, room elsewhere or not
    assert handback_due(busy, mine, [busy], NOW) == ["h0", "h1", "h2"]
    during = replace(busy, outages=(Outage(NOW - 5, NOW + 600),))
    assert handback_due(during, mine, [during], NOW) == ["h0", "h1", "h2"]


def test_what_is_handed_back_is_not_given_back_to_the_site() -> None:
    # Placement's estimate (2 tokens/s per request) is never more hopeful than the handback's
    # (the site's measured rate per request, at least that), so whatever goes back early does
    # not fit the draining site again: no ping-pong.
    busy = site("busy", tps=1000.0, in_flight=2, outages=(Outage(NOW + 100, NOW + 600),))
    assert per_request_tokens_per_s(busy, DEFAULT_POLICY) == 500.0
    mine = [replace(c, request_id=f"t{tokens}", remaining_tokens=tokens)
            for tokens in (10, 100, 1000, 40_000, 50_000, 100_000) for c in held(1, tokens)]
    handed = handback_due(busy, mine, [busy, site("helper", free=8)], NOW)
    assert handed == ["t100000", "t50000"]
    assert not any(fits(busy, c, NOW, DEFAULT_POLICY) for c in mine
                   if c.request_id in handed)


def test_the_lead_comes_from_the_config_and_never_undercuts_a_heartbeat() -> None:
    from minimill.api.settings import Settings
    from minimill.control.config import ControlConfig
    from minimill.control.leases import policy_for

    assert policy_for(ControlConfig(lease_ttl_s=3.0)).handback_lead_s == LEAD
    assert policy_for(ControlConfig(lease_ttl_s=3.0, handback_lead_s=20.0)).handback_lead_s == 20
    # A site hears of a handback in a heartbeat answer, up to TTL/3 late.
    assert policy_for(ControlConfig(lease_ttl_s=30.0, handback_lead_s=2.0)).handback_lead_s == 11
    config = Settings(handback_lead_s=7.5).control_config()  # MINIMILL_HANDBACK_LEAD_S
    assert config.handback_lead_s == 7.5
