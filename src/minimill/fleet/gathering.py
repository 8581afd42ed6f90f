"""When a busy worker makes its calls: several requests to one call rather than one each.

On a site running many requests, slots free up and results finish one at a time. Asked for at
once, each would be a lease call and a completion call of its own, and the control plane's
cost per request would be that of two calls. So a worker with most of its slots busy waits a
moment for a few slots to free before it asks for work (`LEASE_GATHER_S`, never with a slot
idle longer than that), and background results wait a moment for company before they are
delivered (`COMPLETE_GATHER_S`; a realtime result, which a client waits on, goes at once and
takes them along). Background work is the work nobody waits on token by token.
"""

from __future__ import annotations

# A free slot waits at most this long for others before the worker asks for work.
LEASE_GATHER_S = 0.25
# Finished background results wait at most this long to share a completion call.
COMPLETE_GATHER_S = 0.25


def lease_batch(capacity: int) -> int:
    """Free slots worth a lease call at once: an eighth of the worker's slots (at least one)."""
    return max(1, capacity // 8)
