"""fair_share.fair_order: a pure function, checked on its own."""

from __future__ import annotations

from minimill.control.fair_share import fair_order


def order(items: list[tuple[str, int]], load: dict[str, float] | None = None,
          weights: dict[str, float] | None = None) -> list[str]:
    """items: (tenant, arrival); each costs 10 tokens."""
    picked = fair_order(items, lambda c: c[0], lambda c: c[1], lambda c: 10.0,
                        load or {}, weights or {})
    return [f"{t}{seq}" for t, seq in picked]


def test_one_tenant_keeps_its_own_order() -> None:
    assert order([("a", 3), ("a", 1), ("a", 2)]) == ["a1", "a2", "a3"]


def test_tenants_alternate_from_equal_service_in_arrival_order() -> None:
    items = [("h", i) for i in range(1, 6)] + [("l", i) for i in range(6, 8)]
    assert order(items) == ["h1", "l6", "h2", "l7", "h3", "h4", "h5"]


def test_a_tenant_holding_leases_waits_until_the_other_caught_up() -> None:
    items = [("h", 1), ("h", 2), ("l", 3), ("l", 4), ("l", 5)]
    assert order(items, load={"h": 25.0}) == ["l3", "l4", "l5", "h1", "h2"]


def test_weights_divide_service() -> None:
    items = [("a", i) for i in range(1, 9)] + [("b", i) for i in range(9, 17)]
    first_eight = order(items, weights={"a": 3.0})[:8]
    assert sum(x.startswith("a") for x in first_eight) == 6
