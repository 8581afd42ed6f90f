"""Leases the worker gives back unfinished: ahead of an announced outage of its site (the
control plane names them in a heartbeat answer) and when it stops.

Each is stopped first, so its checkpoint is final: everything the engine generated for it
travels with the release, and the next site continues from there with nothing recomputed.
Releases not delivered yet (the control plane unreachable) are kept and sent again; if the
lease expires meanwhile, the control plane still takes the newer checkpoint (release.py).
"""

from __future__ import annotations

import logging

from minimill.fleet.held import HeldLease
from minimill.transport.client import ControlPlaneClient
from minimill.transport.protocol import Checkpoint, Lease, ReleaseItem, ReleaseRequest

log = logging.getLogger("minimill.worker")
MAX_RELEASES_PER_POST = 256
# A post stays well under the control plane's default body limit (16 MiB): releases carry
# whole checkpoints (text, token ids, logprobs), and one post of many long ones would be
# refused as too large on every try. A single larger release still goes, alone.
MAX_RELEASE_POST_BYTES = 4 * 1024 * 1024


class Releases:
    """The release outbox."""

    def __init__(self, client: ControlPlaneClient) -> None:
        self.client = client
        self.pending: dict[str, ReleaseItem] = {}
        self.released = 0
        self.rejected = 0

    def add(self, held: HeldLease) -> None:
        """Stop `held` and queue its release with the progress made so far."""
        held.cancel()
        # A copy: the cancelled task must not touch what is being sent.
        checkpoint = (Checkpoint.model_validate(held.checkpoint().model_dump())
                      if held.progress else None)
        self.pending[held.request_id] = ReleaseItem(
            request_id=held.request_id, epoch=held.lease.epoch, checkpoint=checkpoint)

    def add_unstarted(self, lease: Lease) -> None:
        """Queue the release of a lease never started (its checkpoint stays as it is)."""
        self.pending[lease.request_id] = ReleaseItem(request_id=lease.request_id,
                                                     epoch=lease.epoch)

    def discard(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    async def send(self) -> None:
        """Deliver what is pending (ControlPlaneUnavailable: kept for the next try)."""
        while self.pending:
            items = next_post(list(self.pending.values()))
            resp = await self.client.release(ReleaseRequest(leases=items))
            for item in items:
                if self.pending.get(item.request_id) is item:
                    del self.pending[item.request_id]
            released = set(resp.released)
            self.released += len(released)
            self.rejected += len(resp.rejected)
            log.info("handed back %d leases with their checkpoints (%d tokens)%s",
                     len(released), sum(_tokens(i) for i in items if i.request_id in released),
                     f"; {len(resp.rejected)} were no longer ours" if resp.rejected else "")


def next_post(pending: list[ReleaseItem], max_items: int = MAX_RELEASES_PER_POST,
              max_bytes: int = MAX_RELEASE_POST_BYTES) -> list[ReleaseItem]:
    """The first releases of `pending` that fit one post: at most `max_items` and about
    `max_bytes` of JSON, and never none."""
    items: list[ReleaseItem] = []
    size = 0
    for item in pending[:max_items]:
        item_bytes = len(item.model_dump_json())
        if items and size + item_bytes > max_bytes:
            break
        items.append(item)
        size += item_bytes
    return items


def _tokens(item: ReleaseItem) -> int:
    if item.checkpoint is None:
        return 0
    return sum(len(c.token_ids) for c in item.checkpoint.choices)
