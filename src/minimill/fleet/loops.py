"""The worker's loops over the leases it holds (see site/worker.py for the process around them).

The lease loop asks for as many requests as the engine has free sequences (a busy worker
gathers a few free slots first, and holds finished background results a moment to share a
completion call: gathering.py); the heartbeat loop
extends every lease each ttl/3 and sends checkpoints every lease's checkpoint_interval_s (the
control plane's settings, streaming leases more often), each holding only what is new since the
last accepted one, and hands back the leases its answers name (an outage of the site is near:
releases.py); the completion loop sends finished results in batches with their epoch, keeping
any it could not deliver until the control plane accepts or rejects them (a resend of an
accepted result is accepted again). A stale-epoch rejection means another site owns the request
now: the result is dropped. A revoked lease is aborted unless it has finished: its result is
still delivered, since an expired lease nobody else took keeps its epoch. Requests stay under
the control plane's body limits: checkpoints per heartbeat and results per completion call are
capped in bytes, and a result too large to deliver at all fails its request.

`stop()` ends leasing at once; running requests get `drain_timeout_s` to finish, then the rest
are checkpointed and handed back, so they resume elsewhere without waiting for an expiry. A
second `stop()` skips the wait (shutdown.py). An engine that dies for good (its process
gone) stops the worker the same way without the wait: `run` then raises EngineDiedError.
A request whose engine call failed goes back with its checkpoint at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time

from minimill.fleet.engines import EngineAdapter, EngineDiedError
from minimill.fleet.gathering import COMPLETE_GATHER_S, LEASE_GATHER_S, lease_batch
from minimill.fleet.held import HeldLease, SentCheckpoint, Tally, approx_bytes
from minimill.fleet.releases import Releases
from minimill.fleet.sessions import HeldSessions
from minimill.fleet.shutdown import drain
from minimill.transport.client import (
    Backoff,
    ControlPlaneClient,
    ControlPlaneUnavailable,
    PayloadTooLarge,
    send_within,
    sleep_backoff,
)
from minimill.transport.protocol import (
    CompleteRequest,
    CompletionItem,
    ErrorInfo,
    HeartbeatItem,
    HeartbeatRequest,
    Lease,
    LeaseRequest,
    ReleaseRequest,
)

log = logging.getLogger("minimill.worker")

IDLE_POLL_S = 0.2  # with no free slot, how long before looking again
# A lease call after one that got nothing waits at the control plane up to this long for work
# (answered at once when work comes, with the slots the worker's finished requests freed
# meanwhile): a worker costs the control plane a call every few seconds, not several a second.
LEASE_WAIT_S = 2.0
# How long a worker whose engine died waits for its lease call's answer before dropping it.
LEASE_ANSWER_WAIT_S = LEASE_WAIT_S + 3.0
BUSY_POLL_S = 0.05  # shortest gap between lease calls while slots free up
COMPLETE_BATCH_S = 0.03  # results wait this long to share one POST
MAX_COMPLETIONS_PER_POST = 256
ENGINE_COOLDOWN_S = 5.0  # no new leases for this long after the engine failed
HEARTBEAT_TICK_S = 0.25  # the heartbeat loop's longest sleep
# Request sizes kept well under the control plane's fleet body limit (64 MiB by default).
MAX_CHECKPOINT_BYTES_PER_BEAT = 4 * 1024 * 1024
MAX_COMPLETION_BYTES_PER_POST = 8 * 1024 * 1024


class Worker:
    """Holds leases and runs the three loops until `stop()`."""

    def __init__(self, client: ControlPlaneClient, adapter: EngineAdapter, *, capacity: int,
                 drain_timeout_s: float = 10.0, stats_every_s: float = 0.0,
                 price_per_hour: float | None = None, chip: str | None = None) -> None:
        self.client = client
        self.adapter = adapter
        self.capacity = capacity
        # Declared with every lease call, so the registry follows a restart with new values.
        self.price_per_hour = price_per_hour
        self.chip = chip
        self.drain_timeout_s = drain_timeout_s
        self.stats_every_s = stats_every_s  # > 0: log the token counter this often
        self.held: dict[str, HeldLease] = {}
        self.outbox: dict[str, CompletionItem] = {}
        self.lease_ttl_s = 30.0
        self.releases = Releases(client)
        self.stopping = asyncio.Event()
        self.hurry = asyncio.Event()  # a second stop(): no waiting for running requests
        self._wake_lease = asyncio.Event()
        self._wake_complete = asyncio.Event()
        self._engine_cooldown_until = 0.0
        self._last_full_heartbeat = time.monotonic()
        self._free_since: float | None = None  # when a slot first stood free (gathering.py)
        self._max_per_post = MAX_COMPLETIONS_PER_POST
        self.stats = {"leased": 0, "succeeded": 0, "failed": 0, "rejected": 0, "revoked": 0,
                      "handed_back": 0}
        self.first_lease_at: float | None = None  # monotonic time of the first lease answer
        self.tally = Tally()
        self.sessions = HeldSessions()  # reported with lease calls, for placement affinity
        # Ask for the site's held leases back with the next lease call (worker.py: a start
        # whose engine's KV survived the previous run).
        self.adopt_held = False
        # The name of the lease call to make, kept while its calls fail: a call whose answer
        # was lost (a timeout at a loaded control plane) is made again under it, and gets
        # back what it was granted (protocol.LeaseRequest.ask_id).
        self._ask_id: str | None = None
        # Or give them all back before the first lease call (a give-back after it would
        # return that call's new leases too).
        self.give_back_held = False
        # Why the engine is gone for good, once it is: the worker hands everything back and
        # `run` raises EngineDiedError.
        self.engine_death: str | None = None

    # ---- bookkeeping -------------------------------------------------------------------------
    def free_capacity(self) -> int:
        busy = sum(h.num_running for h in self.held.values())
        return max(0, self.capacity - busy)

    def _on_lease_done(self, held: HeldLease) -> None:
        if self.held.get(held.request_id) is not held:
            return  # revoked or replaced meanwhile
        if held.result is not None:
            self.outbox[held.request_id] = held.result
            self._wake_complete.set()
        elif held.engine_failed:
            # Handed back with what it made so far: it resumes on another site at once, not
            # when its lease lapses.
            self.hand_back([held.request_id])
            self._engine_cooldown_until = time.monotonic() + ENGINE_COOLDOWN_S
        self._wake_lease.set()

    def _take(self, lease: Lease) -> HeldLease:
        old = self.held.pop(lease.request_id, None)
        if old is not None:  # re-leased to us at a newer epoch: the old run is stale
            old.cancel()
        self.outbox.pop(lease.request_id, None)
        self.releases.discard(lease.request_id)
        held = HeldLease(lease, self.adapter, self.tally)
        if lease.session_key:
            self.sessions.add(lease.session_key)
        self.held[lease.request_id] = held
        self.stats["leased"] += 1
        held.start(self._on_lease_done)
        return held

    def _drop(self, request_id: str) -> None:
        held = self.held.pop(request_id, None)
        if held is not None:
            held.cancel()
        self.outbox.pop(request_id, None)

    def hand_back(self, request_ids: list[str]) -> int:
        """Stop the named leases that are still running and queue their releases."""
        count = 0
        for request_id in request_ids:
            held = self.held.get(request_id)
            if held is None or held.result is not None:
                continue  # not ours, or finished: its completion is on the way
            del self.held[request_id]
            self.releases.add(held)
            count += 1
        if count:
            self.stats["handed_back"] += count
            self._wake_lease.set()
        return count

    # ---- loops ---------------------------------------------------------------------------------
    async def wait(self, event: asyncio.Event, timeout: float) -> None:
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass
        event.clear()

    async def lease_loop(self) -> None:
        backoff = Backoff()
        wait_s = 0.0  # the first call, and one after a grant, come back at once
        while not self.stopping.is_set():
            if self.give_back_held:
                await self._give_back_held(backoff)
                continue
            free = self.free_capacity()
            if free <= 0 or time.monotonic() < self._engine_cooldown_until:
                await self.wait(self._wake_lease, IDLE_POLL_S)
                continue
            gather_s = self._lease_gather_s(free)
            if gather_s > 0:
                await self.wait(self._wake_lease, gather_s)
                continue
            self._free_since = None
            if self._ask_id is None:
                self._ask_id = secrets.token_urlsafe(12)
            try:
                held_sessions = self.sessions.changed()
                resp = await self.client.lease(LeaseRequest(
                    capacity=free, models=self.adapter.models,
                    tokens_per_s=self.adapter.tokens_per_s(),
                    price_per_hour=self.price_per_hour, chip=self.chip,
                    held_sessions=held_sessions, adopt_held=self.adopt_held,
                    wait_s=0.0 if self.adopt_held else wait_s,
                    # Free slots plus every lease held: as the control plane counts a held
                    # call's slots (a request of n choices frees n slots, one lease).
                    slots=free + len(self.held), ask_id=self._ask_id))
            except ControlPlaneUnavailable as exc:
                if held_sessions is not None:
                    self.sessions.unsent()
                await sleep_backoff(backoff, "lease", exc)
                continue
            backoff.reset()
            self.adopt_held = False
            self._ask_id = None
            self.lease_ttl_s = resp.lease_ttl_s
            if self.first_lease_at is None:
                self.first_lease_at = time.monotonic()
            if self.stopping.is_set():
                for lease in resp.leases:  # granted as we stopped: straight back, unstarted
                    self.releases.add_unstarted(lease)
                break
            taken = [self._take(lease) for lease in resp.leases]
            resumed = [h for h in taken if h.resumed_tokens]
            if resumed:
                log.info("leased %d requests; %d resume from checkpoints (%d tokens): %s",
                         len(taken), len(resumed), sum(h.resumed_tokens for h in resumed),
                         " ".join(h.request_id for h in resumed[:8])
                         + (" ..." if len(resumed) > 8 else ""))
            wait_s = 0.0 if resp.leases else LEASE_WAIT_S
            await asyncio.sleep(BUSY_POLL_S)

    def _lease_gather_s(self, free: int) -> float:
        """How much longer to wait for more free slots before asking (0: ask now)."""
        if free >= lease_batch(self.capacity) or not self.held or self.adopt_held:
            return 0.0
        now = time.monotonic()
        if self._free_since is None:
            self._free_since = now
        return max(0.0, self._free_since + LEASE_GATHER_S - now)

    async def _give_back_held(self, backoff: Backoff) -> None:
        try:
            answer = await self.client.release(ReleaseRequest(all_held=True))
        except ControlPlaneUnavailable as exc:  # e.g. serve's control plane still starting
            await sleep_backoff(backoff, "giving back the previous run's leases before the "
                                "first lease", exc)
            return
        backoff.reset()
        self.give_back_held = False
        if answer.released:
            log.info("gave back %d leases the previous run of this site held",
                     len(answer.released))

    async def _give_back_everything(self) -> None:
        answer = await self.client.release(ReleaseRequest(all_held=True))
        if answer.released:
            log.info("gave back %d more leases the site held", len(answer.released))

    def _heartbeat_items(self, force_all: bool) -> tuple[list[HeartbeatItem],
                                                         dict[str, SentCheckpoint]]:
        now = time.monotonic()
        full = force_all or now - self._last_full_heartbeat >= self.lease_ttl_s / 3
        items, sent = [], {}
        budget = MAX_CHECKPOINT_BYTES_PER_BEAT
        for held in self.held.values():
            due = held.checkpoint_due(now) or (force_all and held.dirty)
            if due:
                # Past the budget the lease is only extended; its checkpoint waits a beat.
                size = held.pending_bytes()
                due = size <= budget or budget == MAX_CHECKPOINT_BYTES_PER_BEAT
                budget -= size
            if full or due:
                item, checkpoint = held.heartbeat_item(with_checkpoint=due)
                items.append(item)
                if checkpoint is not None:
                    sent[held.request_id] = checkpoint
        if full:
            self._last_full_heartbeat = now
        return items, sent

    async def _send_releases(self) -> None:
        """Hand back what is pending; a failure must not hold up the heartbeats of the rest.
        Once the engine has died the drain sends them, after the lease call in flight."""
        if not self.releases.pending or self.engine_death is not None:
            return
        try:
            await self.releases.send()
        except ControlPlaneUnavailable as exc:
            log.warning("handing back %d leases failed (%s); trying again",
                        len(self.releases.pending), exc)

    async def heartbeat_once(self, force_all: bool = False) -> None:
        await self._send_releases()
        items, checkpoints = self._heartbeat_items(force_all)
        if not items:
            return
        beat = HeartbeatRequest(leases=items, tokens_per_s=self.adapter.tokens_per_s())
        try:
            resp = await self.client.heartbeat(beat)
        except PayloadTooLarge:
            # The checkpoints did not fit: the leases must still be extended.
            for item in items:
                item.checkpoint = item.delta = None
            self._answer_checkpoints(checkpoints, None, set())
            resp = await self.client.heartbeat(beat)
        except ControlPlaneUnavailable:
            self._answer_checkpoints(checkpoints, None, set())
            raise
        sent = {i.request_id: i.epoch for i in items}
        self._answer_checkpoints(checkpoints, set(resp.extended), set(resp.resync))
        revoked = [r for r in resp.revoked
                   if r in self.held and self.held[r].lease.epoch == sent.get(r)
                   and self.held[r].result is None]  # a finished result is still offered
        for request_id in revoked:
            self._drop(request_id)
        if revoked:
            self.stats["revoked"] += len(revoked)
            log.info("%d leases revoked (cancelled, expired or taken over); aborted them",
                     len(revoked))
            self._wake_lease.set()
        if resp.handback and self.hand_back(resp.handback):
            log.info("an outage of this site is near: handing back %d leases",
                     len(self.releases.pending))
            await self._send_releases()

    def _answer_checkpoints(self, checkpoints: dict[str, SentCheckpoint],
                            extended: set[str] | None, resync: set[str]) -> None:
        """Record the answer to the checkpoints sent (`extended` None: no answer came)."""
        for request_id, checkpoint in checkpoints.items():
            held = self.held.get(request_id)
            if held is not None:
                accepted = extended is not None and request_id in extended \
                    and request_id not in resync
                held.checkpoint_answered(checkpoint, accepted, request_id in resync)

    async def heartbeat_loop(self) -> None:
        backoff = Backoff(cap_s=2.0)
        while True:
            # Streaming leases are checkpointed as often as the control plane asks.
            await asyncio.sleep(min((h.checkpoint_interval_s for h in self.held.values()
                                     if h.lease.stream), default=HEARTBEAT_TICK_S))
            try:
                await self.heartbeat_once()
                backoff.reset()
            except ControlPlaneUnavailable as exc:
                await sleep_backoff(backoff, "heartbeat", exc)

    def _next_completions(self) -> list[CompletionItem]:
        """Results for one call: at most MAX_COMPLETIONS_PER_POST, and about
        MAX_COMPLETION_BYTES_PER_POST (at least one)."""
        items: list[CompletionItem] = []
        size = 0
        for item in self.outbox.values():
            size += approx_bytes(item.choices)
            if items and (len(items) >= self._max_per_post
                          or size > MAX_COMPLETION_BYTES_PER_POST):
                break
            items.append(item)
        return items

    async def complete_once(self) -> None:
        items = self._next_completions()
        if not items:
            return
        try:
            resp = await self.client.complete(CompleteRequest(results=items))
        except PayloadTooLarge:
            if len(items) > 1:
                self._max_per_post = max(1, len(items) // 2)
                return
            # Never deliverable as it is: fail the request rather than retry forever.
            big = items[0]
            log.warning("result of %s is larger than the control plane accepts; failing it",
                        big.request_id)
            self.outbox[big.request_id] = CompletionItem(
                request_id=big.request_id, epoch=big.epoch, outcome="failed",
                error=ErrorInfo(code="server_error",
                                message="the result is larger than the server accepts"))
            return
        self._max_per_post = MAX_COMPLETIONS_PER_POST
        sent = {i.request_id: i for i in items}
        for request_id in resp.accepted:
            item = sent.get(request_id)
            if item is not None:
                self.stats["succeeded" if item.outcome == "succeeded" else "failed"] += 1
                self._settle(item)
        for rejection in resp.rejected:
            item = sent.get(rejection.request_id)
            if item is not None:
                self.stats["rejected"] += 1
                log.info("completion of %s (epoch %d) rejected: %s%s; result dropped",
                         rejection.request_id, item.epoch, rejection.reason,
                         f" ({rejection.message})" if rejection.message else "")
                self._settle(item)

    def _settle(self, item: CompletionItem) -> None:
        if self.outbox.get(item.request_id) is item:
            del self.outbox[item.request_id]
        held = self.held.get(item.request_id)
        if held is not None and held.lease.epoch == item.epoch:
            del self.held[item.request_id]
            self._wake_lease.set()

    def _results_wait(self) -> bool:
        """Whether every result ready is of background work and may wait for company."""
        if self.stopping.is_set() or len(self.outbox) >= self._max_per_post:
            return False
        return all((held := self.held.get(request_id)) is not None and held.lease.background
                   for request_id in self.outbox)

    async def complete_loop(self) -> None:
        backoff = Backoff()
        while True:
            await self.wait(self._wake_complete, 1.0)
            await asyncio.sleep(COMPLETE_BATCH_S)
            gather_until = time.monotonic() + COMPLETE_GATHER_S
            while self.outbox and self._results_wait() and time.monotonic() < gather_until:
                await self.wait(self._wake_complete, gather_until - time.monotonic())
            while self.outbox:
                try:
                    await self.complete_once()
                    backoff.reset()
                except ControlPlaneUnavailable as exc:
                    await sleep_backoff(backoff, "complete", exc)

    async def stats_loop(self, every_s: float) -> None:
        """Log the token counter often, so that a benchmark can count work a kill -9 lost."""
        while True:
            await asyncio.sleep(every_s)
            counts = getattr(self.adapter, "step_counts", None)
            steps, step_seqs = counts() if counts is not None else (0, 0)
            log.info("stats generated_tokens=%d held=%d steps=%d step_seqs=%d",
                     self.tally.generated_tokens, len(self.held), steps, step_seqs)

    # ---- lifecycle -----------------------------------------------------------------------------
    def engine_died(self, reason: str) -> None:
        """The engine is gone: no more leases, and everything unfinished goes back at once
        (the drain does not wait for requests that cannot finish). The releases wait until
        the lease call in flight has answered (`run`): sent before, they could be granted
        straight back to a call that is then dropped, its answer never read."""
        if self.engine_death is not None:
            return
        self.engine_death = reason
        log.error("the engine died (%s): handing back %d leases; the site goes down",
                  reason, sum(1 for h in self.held.values() if h.result is None)
                  + len(self.releases.pending))
        self.stopping.set()
        self.hurry.set()
        self._wake_lease.set()

    def stop(self) -> None:
        if not self.stopping.is_set():
            log.info("stopping: no new leases; finishing %d running requests", len(self.held))
            self.stopping.set()
            self._wake_lease.set()
        elif not self.hurry.is_set():
            log.info("stopping now: handing back what is still running")
            self.hurry.set()

    async def run(self) -> None:
        """Serve until `stop()`; raises EngineDiedError (after handing back and delivering
        what it can) if the engine dies."""
        loop = asyncio.get_running_loop()

        def on_death(reason: str) -> None:  # in the engine's reader thread
            with contextlib.suppress(RuntimeError):  # the loop has ended: nothing to hand back
                loop.call_soon_threadsafe(self.engine_died, reason)

        self.adapter.on_death(on_death)
        loops = [asyncio.create_task(c) for c in
                 (self.heartbeat_loop(), self.complete_loop())]
        if self.stats_every_s > 0:
            loops.append(asyncio.create_task(self.stats_loop(self.stats_every_s)))
        lease_task = asyncio.create_task(self.lease_loop())
        stop_task = asyncio.create_task(self.stopping.wait())
        try:
            # A loop only ends early by raising (e.g. SiteAuthError): surface that at once.
            await asyncio.wait([stop_task, lease_task, *loops],
                               return_when=asyncio.FIRST_COMPLETED)
            for task in (lease_task, *loops):
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            if self.engine_death is not None:
                # The site's leases are about to go back: a lease call dropped now could still
                # be granted them at the control plane (it has not seen the drop yet), its
                # answer unread. Its answer is read instead (the lease loop gives back what it
                # got), within the call's wait.
                await asyncio.wait({lease_task}, timeout=LEASE_ANSWER_WAIT_S)
            # A lease call in flight may wait for an unreachable control plane: drop it (what
            # it would have granted lapses and goes elsewhere).
            lease_task.cancel()
            await asyncio.gather(lease_task, return_exceptions=True)
            await drain(self)
            if self.engine_death is not None:
                # A lease answer that was lost as the call was dropped is handed back too.
                await send_within(self._give_back_everything, "the site's last leases")
                raise EngineDiedError(self.engine_death)
        finally:
            stop_task.cancel()
            lease_task.cancel()
            for task in loops:
                task.cancel()
            await asyncio.gather(lease_task, *loops, return_exceptions=True)
