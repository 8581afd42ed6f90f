"""The control plane's webhook sender: a background task of every API process.

Each round records the events of objects that have ended, claims the deliveries that are due
and posts them, signed, concurrently; outcomes go back to the store (control/webhook_events.py
owns the rules: claims, backoff, giving up). Any number of processes may run it on one store.
"""

from __future__ import annotations

import asyncio
import logging
import time

import anyio
import httpx

from minimill import __version__
from minimill.control.config import ControlConfig
from minimill.control.store import Store
from minimill.control.url_guard import pick_address
from minimill.control.webhook_events import (
    MAX_PER_CALL,
    Delivery,
    claim_due,
    record_attempt,
    record_ended,
)
from minimill.control.webhook_signing import signed_headers

log = logging.getLogger("minimill.webhooks")


async def _deliver(client: httpx.AsyncClient, store: Store, delivery: Delivery,
                   config: ControlConfig) -> None:
    headers = {**signed_headers(delivery.secret, delivery.event_id, int(time.time()),
                                delivery.payload), "user-agent": f"minimill/{__version__}"}
    error: str | None
    try:
        # Connect to the very address that was checked (a second lookup by the HTTP client
        # could answer differently: DNS rebinding), naming the host in Host and TLS's SNI so
        # that the receiver and its certificate are checked as for the name.
        url = httpx.URL(delivery.url)
        address = await anyio.to_thread.run_sync(pick_address, delivery.url,
                                                 config.webhook_allow_private)
        headers["host"] = url.netloc.decode("ascii")
        answer = await client.post(url.copy_with(host=str(address)),
                                   content=delivery.payload.encode(), headers=headers,
                                   extensions={"sni_hostname": url.host})
        error = None if 200 <= answer.status_code < 300 else f"HTTP {answer.status_code}"
    except Exception as exc:  # unreachable, refused, timed out, a URL httpx cannot use
        error = f"{type(exc).__name__}: {exc}"
    if error is not None:
        log.info("webhook %s to %s, attempt %d: %s", delivery.event_id, delivery.url,
                 delivery.attempts, error)
    await anyio.to_thread.run_sync(record_attempt, store, delivery, time.time(), error, config)


async def run_webhook_sender(store: Store, config: ControlConfig, interval_s: float,
                             timeout_s: float) -> None:
    """Forever: record ended objects' events, deliver what is due."""
    # A claim outlives the slowest answer the sender waits for, so nobody else posts meanwhile.
    claim_s = timeout_s + 30.0
    async with httpx.AsyncClient(timeout=timeout_s, follow_redirects=False) as client:
        while True:
            due: list[Delivery] = []
            try:
                await anyio.to_thread.run_sync(record_ended, store, time.time())
                due = await anyio.to_thread.run_sync(claim_due, store, time.time(), claim_s)
                await asyncio.gather(*(_deliver(client, store, d, config) for d in due))
            except Exception:  # the store may be briefly unreachable; try again next round
                log.exception("webhook round failed")
            if len(due) < MAX_PER_CALL:
                await asyncio.sleep(interval_s)
