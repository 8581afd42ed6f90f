"""Weighted fair share between tenants: the order in which placement offers queued work.

Within a tenant, work keeps its own order (realtime by arrival, background by deadline then
arrival). Between tenants, the next request offered is the head of the tenant with the least
service per unit of weight: its tokens already leased (held by some site now, as the store
says, so every control-plane process sees the same), plus the tokens of what this call has
offered it so far. A tenant that queues ten times the work of another does not get ten times
the slots while both wait: a light tenant's request goes before the heavy tenant's next one,
and the heavy tenant takes all the room the light one leaves. A tenant of weight 2 is
served as if it held half what it holds. This is virtual-time fair queuing (start-time fair
queuing), with leased tokens as the virtual time; a pure function, as placement is.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

C = TypeVar("C")


def fair_order(candidates: Iterable[C], tenant_of: Callable[[C], str | None],
               key: Callable[[C], Any], cost: Callable[[C], float],
               load: Mapping[str, float], weights: Mapping[str, float]) -> list[C]:
    """`candidates` interleaved between tenants by least weighted service (`load`: tokens
    each tenant holds leased now; `cost`: what one candidate adds), each tenant's own in `key`
    order. One tenant (or none named): just `key` order."""
    queues: dict[str | None, list[C]] = {}
    for candidate in candidates:
        queues.setdefault(tenant_of(candidate), []).append(candidate)
    if len(queues) <= 1:
        return sorted((c for q in queues.values() for c in q), key=key)
    for queue in queues.values():
        queue.sort(key=key, reverse=True)  # its head last: popped in O(1)

    def weight(tenant: str | None) -> float:
        found = weights.get(tenant, 1.0) if tenant is not None else 1.0
        return found if found > 0 else 1.0

    # (virtual time, the head's own order, tie-break, tenant): equal service goes in order.
    heap = [(load.get(t, 0.0) / weight(t) if t is not None else 0.0, key(q[-1]), i, t)
            for i, (t, q) in enumerate(queues.items())]
    heapq.heapify(heap)
    ordered: list[C] = []
    while heap:
        vtime, _, i, tenant = heapq.heappop(heap)
        queue = queues[tenant]
        head = queue.pop()
        ordered.append(head)
        if queue:
            heapq.heappush(heap, (vtime + cost(head) / weight(tenant), key(queue[-1]), i,
                                  tenant))
    return ordered

