"""A process-local wake-up for workers' held lease calls: it fires when this process queues
requests (a realtime call, a validated batch, leases given back or reaped). Other processes'
work is noticed through the store within `RECHECK_S`: nothing depends on this but latency."""

from __future__ import annotations

from fastapi import FastAPI, Request

from minimill.api.box_wakeup import Wakeup

# How often a held lease call looks at the store when nothing in this process woke it.
RECHECK_S = 1.0


def lease_wakeup_of(app: FastAPI) -> Wakeup:
    state = app.state
    if not hasattr(state, "lease_wakeup"):
        state.lease_wakeup = Wakeup()
    wakeup: Wakeup = state.lease_wakeup
    return wakeup


def lease_wakeup(request: Request) -> Wakeup:
    return lease_wakeup_of(request.app)
