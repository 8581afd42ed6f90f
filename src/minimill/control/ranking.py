"""How two sites compare for placement: which is faster (realtime), which is cheaper
(background), and which are equal (and share background work). Pure functions of two
SiteStates, a clock and the policy.

A site's measured rate is its busy throughput, and while it has free room it is only a lower
bound: a site given 30 requests measures less than the same machine given 90, and one that
keeps restarting measures mostly its prefills. Sites that declare the same chip at the same
price are taken for the same hardware, so a difference in their measured rates is put down to
the load each was given, not to what they can do. Nor is either cheaper than the other for
expected losses estimated from a few kills: they are equal, and share background work in
proportion to what each is expected to keep (placement.fair_share). Otherwise the site that
got more work would measure faster, look cheaper, and get all of it, and a kill of that one
would lose all of it. (Different hardware should declare different chip names.) For realtime
work a reliable site still goes before an unreliable one of the same kind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minimill.control import site_health

if TYPE_CHECKING:
    from minimill.control.placement import PlacementPolicy, SiteState


def kind_matches(chip_a: str | None, price_a: float, chip_b: str | None, price_b: float,
                 policy: PlacementPolicy) -> bool:
    """`same_kind` on the numbers it compares: a chip named alike, declared prices within the
    tolerance (peer_ranks.py groups sites by them)."""
    if chip_a is None or chip_a != chip_b:
        return False
    low, high = sorted((price_a, price_b))
    return high <= low * (1 + policy.tolerance)


def same_kind(a: SiteState, b: SiteState, policy: PlacementPolicy) -> bool:
    """The same chip, at prices within the tolerance."""
    return kind_matches(a.chip, a.price_per_hour, b.chip, b.price_per_hour, policy)


def _reliable(site: SiteState, now: float, policy: PlacementPolicy) -> bool:
    return site_health.loss_fraction(site, now, policy) <= policy.reliable_max_loss


def faster_by(peer_reliable: bool, peer_tokens_per_s: float, me_reliable: bool,
              me_tokens_per_s: float, same: bool, policy: PlacementPolicy) -> bool:
    """`faster` on the numbers it compares (reliability, busy throughput, same kind)."""
    if peer_reliable != me_reliable:
        return peer_reliable
    if same:
        return False
    return peer_tokens_per_s > me_tokens_per_s * (1 + policy.tolerance)


def cheaper_by(peer_usd_per_mtok: float, me_usd_per_mtok: float, same: bool,
               policy: PlacementPolicy) -> bool:
    """`cheaper` on the numbers it compares (effective $/Mtok, same kind)."""
    return not same and peer_usd_per_mtok * (1 + policy.tolerance) < me_usd_per_mtok


def faster(peer: SiteState, me: SiteState, now: float, policy: PlacementPolicy) -> bool:
    """Does `peer` come before `me` for realtime work (reliable first, then faster)?"""
    return faster_by(_reliable(peer, now, policy), site_health.busy_tokens_per_s(peer),
                     _reliable(me, now, policy), site_health.busy_tokens_per_s(me),
                     same_kind(peer, me, policy), policy)


def cheaper(peer: SiteState, me: SiteState, now: float, policy: PlacementPolicy) -> bool:
    """Is `peer` cheaper per kept token than `me` by more than the tolerance?"""
    return cheaper_by(site_health.effective_usd_per_mtok(peer, now, policy),
                      site_health.effective_usd_per_mtok(me, now, policy),
                      same_kind(peer, me, policy), policy)


def equal(peer: SiteState, me: SiteState, now: float, policy: PlacementPolicy) -> bool:
    """Neither is cheaper than the other by more than the tolerance: they share background."""
    return not cheaper(peer, me, now, policy) and not cheaper(me, peer, now, policy)
