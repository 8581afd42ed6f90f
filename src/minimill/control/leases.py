"""Leases with fencing: the control plane's side of the worker protocol (transport/protocol.py).

- `lease`: placement picks queued rows for the asking site from a snapshot (every site's state,
  the head of each tenant's queue with what fair share between tenants needs (lease_queue.py),
  and the background backlog when deadline risk matters); each pick
  becomes `leased` with a bumped fencing epoch, a lease id and an expiry. The site row records
  what the worker said (free capacity after the grant, when, its models, its rate, and the
  price and chip it declares, if any) for metering and the placement of its peers' calls.
  Each lease carries its tenant's prefix-cache salt (tenant_limits.TenantLimits.cache_salt).
- `heartbeat`: extends leases the site still holds at the sent epoch and appends their
  checkpoint deltas (checkpoints.py); everything else is reported revoked.
- `complete`: accepted only at the row's current epoch, from the site that holds (or last held)
  it, while the row is not terminal: the first valid completion wins and each request completes
  exactly once. An accepted one is billed from the operator's price list (prices.py) for the
  control plane's own counts (usage_check.py: the prompt counted at admission, the tokens of
  the choices returned), whatever the site reports or declares; one whose report disagrees
  with them is rejected (`usage_mismatch`), counted against the site, and queued again as if
  its lease had lapsed, without the checkpoints of a site caught misreporting. Resending an
  accepted result is answered `accepted` again, and counted nowhere. Rejections are counted per
  site, with the tokens they threw away: those beyond what the request's next lease resumed
  from. The checks (tokenizing text) run before the write transaction opens.
- `reap_expired`: expired leases go back to `queued`, keeping their checkpoint.
- Released leases (release.py) go back to `queued` at once, with the checkpoint sent; a
  heartbeat answer names the leases a site should release ahead of its announced outage.

Every transition is a conditional UPDATE (on status and epoch), and PostgreSQL candidates are
picked with `FOR UPDATE SKIP LOCKED`, so several control-plane processes can run these at once.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from sqlalchemy import Connection, Update, case, func, select, update

from minimill.control import (
    checkpoints,
    lease_queue,
    lease_rules,
    lease_sql,
    prices,
    prompt_count,
    tenant_limits,
    usage_check,
)
from minimill.control.config import ControlConfig
from minimill.control.lease_rules import RejectReason
from minimill.control.peer_ranks import FleetRanks
from minimill.control.placement import (
    DEFAULT_POLICY,
    Backlog,
    PlacementPolicy,
    Snapshot,
    needs_backlog,
    peer_room,
    place,
)
from minimill.control.prompt_count import counter_for
from minimill.control.records import (
    Kind,
    RequestStatus,
    Site,
    Tier,
    new_id,
)
from minimill.control.release import handback_for
from minimill.control.site_view import PeerView, site_state, site_states
from minimill.control.sites import touch_site
from minimill.control.store import JsonText, Store, retry_conflicts
from minimill.control.tables import requests, sites
from minimill.transport.protocol import (
    CompleteRequest,
    CompleteResponse,
    CompletionItem,
    HeartbeatRequest,
    HeartbeatResponse,
    Lease,
    LeaseRequest,
    LeaseResponse,
    RejectedCompletion,
)

log = logging.getLogger("minimill.leases")
# Most requests handed out by one lease call, whatever capacity a worker claims.
MAX_LEASES_PER_CALL = 1024
# Most queued requests (per tier) one lease call reads: its own capacity plus what the peers
# that go before it will take.
MAX_CANDIDATES = 4 * MAX_LEASES_PER_CALL
# A worker's model list is recorded for placement; a list longer than this is cut.
MAX_MODELS_RECORDED = 64
# Token counts reported by workers are clamped to what the store's integer columns hold.
MAX_COUNT = 2**31 - 1
_QUEUED = RequestStatus.QUEUED.value
_LEASED = RequestStatus.LEASED.value


def _epoch_ok(epoch: int) -> bool:
    """Epochs outside the column's range were never granted (and cannot be bound)."""
    return 0 <= epoch <= MAX_COUNT


def _count(value: int) -> int:
    return min(max(value, 0), MAX_COUNT)


def _backlog(conn: Connection) -> tuple[Backlog, ...]:
    """Unfinished background work per (deadline, holder), for placement's deadline risk."""
    queued = requests.c.status == _QUEUED
    holder = case((queued, None), else_=requests.c.site_id)
    unbounded = func.sum(case((requests.c.max_tokens.is_(None), 1), else_=0))
    rows = conn.execute(
        select(requests.c.deadline, holder.label("holder"), func.count().label("n"),
               func.coalesce(func.sum(requests.c.max_tokens), 0).label("tokens"),
               unbounded.label("unbounded"))
        .where(requests.c.tier == Tier.BACKGROUND.value,
               requests.c.status.in_([_QUEUED, _LEASED]))
        .group_by(requests.c.deadline, holder)).all()
    return tuple(Backlog(deadline=r.deadline, site_id=r.holder, num_requests=int(r.n),
                         max_tokens=int(r.tokens), num_unbounded=int(r.unbounded or 0))
                 for r in rows)


def policy_for(config: ControlConfig,
               policy: PlacementPolicy = DEFAULT_POLICY) -> PlacementPolicy:
    """A full site only heartbeats (every TTL/3): it counts as alive for at least one TTL, and
    hears of a handback at most TTL/3 late, so it is told that much (and a second) earlier."""
    lead = policy.handback_lead_s if config.handback_lead_s is None else config.handback_lead_s
    return replace(policy, alive_within_s=max(policy.alive_within_s, config.lease_ttl_s),
                   handback_lead_s=max(lead, config.lease_ttl_s / 3 + 1.0))


def _snapshot(conn: Connection, site: Site, ask: LeaseRequest, capacity: int, models: list[str],
              now: float, policy: PlacementPolicy, default_weight: float = 1.0,
              peers: PeerView | None = None) -> Snapshot:
    """The state placement decides on: every site (as `peers` last read them, the asking one
    read now), and enough of the queue to find what the asking site gets after the peers that
    go before it take theirs."""
    queued = capacity > 0 and lease_queue.any_queued(conn)
    ranks: FleetRanks | None = None
    if not queued:
        # Nothing to place: only the asking site matters (what it holds, for its row).
        own = site_state(conn, site.id)
        states = {} if own is None else {site.id: own}
    elif peers is None:
        states = site_states(conn)
    else:
        states, ranks = peers.view(conn, site.id, now, policy)
    me = states[site.id]
    if ask.price_per_hour is not None:
        # The price the worker declares now counts for this call too (its row is written last,
        # after the request rows, to keep the lock order).
        me = replace(me, price_per_hour=ask.price_per_hour)
        states[site.id] = me
    if queued and ranks is None:
        ranks = FleetRanks.of(states.values(), now, policy)  # ranked once for this call
    bare = Snapshot(site=me, capacity=capacity, models=frozenset(models),
                    candidates=(), sites=tuple(states.values()), ranks=ranks)
    if not queued:
        # Work queued since (PostgreSQL's statements each see what committed before them)
        # waits for the next call: placed now, it would be placed without the peers.
        return bare
    # Read what the asking site could get: its capacity past what the peers that go first
    # take. Its equals' room is counted, not read: rows cost far more to read than to count
    # (a thousand equal sites would read thousands of rows at every call, and on PostgreSQL
    # lock them from each other).
    ahead, sharing = peer_room(bare, now, policy)
    window = min(capacity + ahead, MAX_CANDIDATES)
    queue = lease_queue.read(conn, models, window, now, policy.default_remaining_tokens,
                             default_weight)
    beyond = 0
    read = sum(1 for c in queue.candidates if c.tier != Tier.REALTIME)
    if sharing and read >= window:
        counted = lease_queue.count_background(conn, models, now,
                                               min(window + sharing, MAX_CANDIDATES))
        beyond = max(0, counted - read)
    read_queue = replace(bare, candidates=queue.candidates, tenant_load=queue.tenant_load,
                         tenant_weights=queue.tenant_weights, background_beyond=beyond)
    if queue.candidates and needs_backlog(read_queue, now, policy):
        return replace(read_queue, backlog=_backlog(conn))
    return read_queue


def _declared(ask: LeaseRequest) -> dict[str, Any]:
    """The price and chip the worker declares, as site-row values (none when it declares none:
    the site keeps what `minimill sites create` registered)."""
    values: dict[str, Any] = {}
    if ask.price_per_hour is not None:
        values["price_per_hour"] = ask.price_per_hour
    if ask.chip is not None:
        values["chip"] = ask.chip.strip()
    if ask.held_sessions is not None:
        values["held_sessions"] = list(ask.held_sessions)
    return values


def checkpoint_interval_s(config: ControlConfig, site_holds: int) -> float:
    """How often a site holding `site_holds` leases checkpoints each ordinary one: the
    configured interval, longer where that would write more than site_checkpoints_per_s rows a
    second (at 256 leases and the defaults, every 8 s instead of every 2 s)."""
    return max(config.checkpoint_interval_s, site_holds / config.site_checkpoints_per_s)


@retry_conflicts
def lease(store: Store, site: Site, ask: LeaseRequest, now: float, config: ControlConfig,
          policy: PlacementPolicy = DEFAULT_POLICY, peers: PeerView | None = None,
          gone: Callable[[], bool] | None = None) -> LeaseResponse:
    """Grant the asking site up to `ask.capacity` leases, as placement decides (`peers`: the
    process's view of the other sites; None reads them all now). `gone`, asked once the write
    transaction has begun, says the worker no longer waits for the answer: then nothing is
    granted (what would be would wait out its lease unread), and the site row is touched as
    for any call. With `ask.ask_id`, the leases a call under the same id was granted and the
    site still holds come first, at their epoch (that call's answer was lost)."""
    capacity = min(ask.capacity, MAX_LEASES_PER_CALL)
    models = [m for m in ask.models if m]
    expires_at = now + config.lease_ttl_s
    # The site names its ask: the lease id is the site's and the ask's, so a retry finds what
    # the lost answer carried (REDELIVER matches the site too: one site's name for an ask
    # reaches nothing of another's).
    lease_id = f"lse_{ask.ask_id}" if ask.ask_id else new_id("lse_")
    policy = policy_for(config, policy)
    with store.write() as conn:
        adopted: list[Any] = []
        held: list[str] = []
        redelivered = 0  # of `adopted`: granted before, under this ask
        if gone is not None and gone():
            capacity = 0
            ask = ask.model_copy(update={"adopt_held": False})
        if ask.adopt_held:
            # The site's previous run's leases, at a new epoch: a late message of that run
            # is fenced off like any other stale holder's.
            held = list(conn.execute(
                select(requests.c.id)
                .where(requests.c.site_id == site.id, requests.c.status == _LEASED)
                .order_by(requests.c.seq).limit(capacity)).scalars().all())
            adopted = [] if not held else list(conn.execute(
                update(requests)
                .where(requests.c.id.in_(held), requests.c.site_id == site.id,
                       requests.c.status == _LEASED)
                .values(epoch=requests.c.epoch + 1, lease_id=lease_id,
                        lease_expires_at=expires_at, leased_at=now,
                        version=requests.c.version + 1,
                        lease_base_tokens=requests.c.checkpoint_tokens)
                .returning(*lease_sql.GRANTED)).all())
            capacity = max(0, capacity - len(adopted))
        elif ask.ask_id:
            # What earlier calls of this name were granted and the site still holds: extended,
            # and handed over unless the worker left this call too (it asks again under the
            # same name; at a thousand sites a retry could itself time out in the queue).
            # Adopting takes every held lease, these included. The worker never saw these (it
            # held no slot for them: they fit its capacity).
            again = conn.execute(lease_sql.REDELIVER, {
                "b_site_id": site.id, "b_lease_id": lease_id,
                "b_expires_at": expires_at}).all()
            if capacity:
                adopted = list(again)
                held = sorted(r.id for r in adopted)
                capacity = max(0, capacity - len(adopted))
                redelivered = len(adopted)
        taken_back = {r.id for r in adopted}
        rows: list[Any] = []
        snapshot = _snapshot(conn, site, ask, capacity, models, now, policy,
                             config.tenant_limits.weight, peers)
        picked = place(snapshot, now, policy) if snapshot.candidates and capacity else []
        if picked:
            rows = list(conn.execute(lease_sql.GRANT, {
                "b_ids": picked, "b_lease_id": lease_id, "b_site_id": site.id,
                "b_expires_at": expires_at, "b_now": now}).all())
        # Adopted leases are in `in_flight` already.
        site_holds = snapshot.site.in_flight + len(rows)
        rows = adopted + rows
        # Adopted first, in the order they were queued in (RETURNING's order is unspecified).
        picked = [i for i in held if i in taken_back] + picked
        resumed = checkpoints.load(conn, [r.id for r in rows if r.progress])
        tenants_of = tenant_limits.of_tenants(conn, {r.tenant_id for r in rows},
                                              config.tenant_limits)
        # What the worker said, for the placement of its peers' lease calls; its measured
        # rate covers a time in which it held what it held before this call.
        touch_site(conn, site.id, now, config.lease_ttl_s, ask.tokens_per_s,
                   busy=snapshot.site.in_flight > 0,
                   free_capacity=min(ask.capacity, MAX_COUNT) - len(rows), capacity_at=now,
                   models=[m[:200] for m in models[:MAX_MODELS_RECORDED]],
                   added={"leases_granted": len(rows) - redelivered}, **_declared(ask))
    if peers is not None:
        peers.remember(replace(snapshot.site, in_flight=site_holds,
                               free_capacity=min(ask.capacity, MAX_COUNT) - len(rows),
                               capacity_at=now, last_seen_at=now), now)
    # Hand leases out in placement order (RETURNING order is unspecified).
    rank = {request_id: i for i, request_id in enumerate(picked)}
    interval_s = checkpoint_interval_s(config, site_holds)
    leases = [Lease(request_id=r.id, lease_id=lease_id, epoch=r.epoch, expires_at=expires_at,
                    kind=Kind(r.kind).wire_kind, model=r.model, body=r.body, seed=r.seed,
                    checkpoint=resumed.get(r.id),
                    stream=bool(r.stream), background=r.tier == Tier.BACKGROUND.value,
                    checkpoint_interval_s=(config.stream_checkpoint_interval_s if r.stream
                                           else interval_s),
                    session_key=r.session_key,
                    cache_salt=tenants_of[r.tenant_id].cache_salt(r.tenant_id))
              for r in sorted(rows, key=lambda r: rank[r.id])]
    return LeaseResponse(leases=leases, lease_ttl_s=config.lease_ttl_s)


@retry_conflicts
def heartbeat(store: Store, site: Site, beat: HeartbeatRequest, now: float,
              config: ControlConfig) -> HeartbeatResponse:
    """Extend the leases still held at their epochs; append checkpoints; report the rest."""
    expires_at = now + config.lease_ttl_s
    extended: set[str] = set()
    plausible = [i for i in beat.leases if _epoch_ok(i.epoch)]
    encoded = checkpoints.encode(plausible)  # before the write transaction opens
    with store.write(urgent=True) as conn:
        for start in range(0, len(plausible), 500):
            part = plausible[start:start + 500]
            held = conn.execute(lease_sql.EXTEND, {
                "b_site_id": site.id, "b_expires_at": expires_at,
                "b_pairs": [(i.request_id, i.epoch) for i in part]}).scalars().all()
            extended.update(held)
        resync = checkpoints.save(conn, [i for i in plausible if i.request_id in extended],
                                  encoded)
        touch_site(conn, site.id, now, config.lease_ttl_s, beat.tokens_per_s,
                   busy=bool(extended))
        handback = handback_for(conn, site.id, now, policy_for(config)) if extended else []
    return HeartbeatResponse(
        extended={i.request_id: expires_at for i in beat.leases if i.request_id in extended},
        revoked=[i.request_id for i in beat.leases if i.request_id not in extended],
        resync=resync, handback=handback)


@retry_conflicts
def complete(store: Store, site: Site, done: CompleteRequest, now: float,
             config: ControlConfig) -> CompleteResponse:
    """Accept completions at the current epoch whose usage holds up; reject the others and
    count them."""
    accepted: list[str] = []
    finished: list[str] = []
    rejected: list[RejectedCompletion] = []
    generated = wasted = stale = refused = 0
    billed_total = 0.0
    admitted = _admitted(store, [i.request_id for i in done.results
                                 if i.outcome == "succeeded"])
    # Counted, checked and encoded before the write transaction: tokenizing text and encoding
    # megabytes of results would hold every other writer up.
    verdicts = [_verdict(item, admitted.get(item.request_id)) for item in done.results]
    encoded = [_result_json(item) if verdict is not None and verdict.refused is None else None
               for item, verdict in zip(done.results, verdicts, strict=True)]
    with store.write() as conn:
        price_list = prices.load_price_list(conn)
        for item, verdict, result in zip(done.results, verdicts, encoded, strict=True):
            finish: Update | None = None
            values: dict[str, Any] = {"b_request_id": item.request_id,
                                      "b_epoch": item.epoch, "b_site_id": site.id, "b_now": now}
            billed = 0.0
            tokens_out = _returned_tokens(item)
            if verdict is not None and verdict.refused is not None \
                    and _requeue_refused(conn, site, item, verdict.refused):
                refused += 1
                rejected.append(RejectedCompletion(request_id=item.request_id,
                                                   reason="usage_mismatch",
                                                   message=verdict.refused))
                continue
            if item.outcome == "succeeded" and verdict is not None \
                    and verdict.refused is None:
                tokens_out = verdict.completion_tokens
                model, tier = admitted[item.request_id][:2]
                billed = prices.billed_usd(
                    price_list.lookup(model, tier, config.background_price_factor),
                    verdict.prompt_tokens, tokens_out, verdict.cached_tokens)
                finish = lease_sql.SUCCEED
                values.update(
                    b_result=result, b_prompt_tokens=verdict.prompt_tokens,
                    b_completion_tokens=tokens_out, b_billed_usd=billed,
                    b_cached_tokens=verdict.cached_tokens)
            elif item.outcome == "failed":
                error = item.error.model_dump() if item.error else {
                    "code": "server_error", "message": "the worker reported a failure"}
                finish = lease_sql.FAIL
                values["b_error"] = {**error, "source": "serving"}
            # A succeeded one without a verdict names no request (or a refused one this site
            # does not hold): the fencing below rejects it.
            hit = finish is not None and _epoch_ok(item.epoch) and conn.execute(
                finish, values).rowcount
            if hit:
                accepted.append(item.request_id)
                finished.append(item.request_id)
                generated += tokens_out
                billed_total += billed
                continue
            row = conn.execute(lease_sql.ROW_STATE,
                               {"b_request_id": item.request_id}).first()
            if row is not None and _completed_by(row, item.epoch, site.id):
                accepted.append(item.request_id)  # a resend after a lost answer
                continue
            reason: RejectReason = lease_rules.reject_reason(
                None if row is None else RequestStatus(row.status))
            rejected.append(RejectedCompletion(request_id=item.request_id, reason=reason))
            # Counted once per (request, epoch): a resend of a refused result is the same work.
            if row is not None and _epoch_ok(item.epoch) and conn.execute(
                    lease_sql.MARK_WASTED,
                    {"b_request_id": item.request_id, "b_epoch": item.epoch}).rowcount:
                stale += 1
                # What a later lease resumed from was kept; the rest was generated for nothing.
                kept = row.lease_base_tokens if row.epoch > item.epoch else 0
                wasted += max(0, tokens_out - kept)
        checkpoints.drop(conn, finished)
        # Whatever it completed, accepted or too late, it held until now.
        touch_site(
            conn, site.id, now, config.lease_ttl_s, busy=bool(accepted) or stale > 0,
            accepted_tokens=generated,
            added={"completions": len(finished), "tokens_generated": generated,
                   "stale_completions": stale, "usage_rejections": refused,
                   "wasted_tokens": wasted, "billed_usd": billed_total})
    if refused:
        log.warning("site %s: %d completions rejected, their usage reports disagree with what "
                    "they returned (%s)", site.name, refused,
                    "; ".join(r.message or "" for r in rejected if r.reason == "usage_mismatch"))
    return CompleteResponse(accepted=accepted, rejected=rejected)


def _result_json(item: CompletionItem) -> JsonText:
    """The row's `result` of a succeeded completion, encoded."""
    return JsonText(json.dumps({"choices": [
        c.model_dump(mode="json", exclude=None if c.embedding is not None else {"embedding"})
        for c in item.choices]}))


def _returned_tokens(item: CompletionItem) -> int:
    """What a result that is not billed (failed, or too late) holds, for the site's counters:
    its token ids (a choice with text only: a token per 4 characters), never its report."""
    return _count(sum(len(c.token_ids) or -(-len(c.text) // 4) for c in item.choices))


def _verdict(item: CompletionItem, admitted: tuple[Any, ...] | None
             ) -> usage_check.Verdict | None:
    """The usage check of a succeeded completion (None: not a succeeded one, or a request
    that does not exist, which the fencing rejects)."""
    if item.outcome != "succeeded" or admitted is None:
        return None
    model, _tier, facts = admitted
    return usage_check.check(item, facts, counter_for(model))


def _requeue_refused(conn: Connection, site: Site, item: CompletionItem, why: str) -> bool:
    """Send a request whose completion was refused back to the queue, as a lapsed lease would
    be, but without its checkpoint (written by the same site); False if the site does not
    hold it at that epoch (the fencing then rejects the completion as for any other)."""
    if not _epoch_ok(item.epoch):
        return False
    hit = conn.execute(
        update(requests)
        .where(requests.c.id == item.request_id, requests.c.epoch == item.epoch,
               requests.c.site_id == site.id, requests.c.status.in_(lease_sql.COMPLETABLE_STATUSES))
        .values(status=_QUEUED, lease_id=None, lease_expires_at=None, progress=None,
                checkpoint_tokens=0, lease_base_tokens=0,
                version=requests.c.version + 1)).rowcount
    if hit:
        checkpoints.drop(conn, [item.request_id])
        log.warning("site %s: completion of %s refused: %s", site.name, item.request_id, why)
    return bool(hit)


def _completed_by(row: Any, epoch: int, site_id: str) -> bool:
    """Whether the row's outcome is this site's completion at this epoch (only a completion
    ends a row as succeeded or failed at a leased epoch)."""
    return (row.status in (RequestStatus.SUCCEEDED, RequestStatus.FAILED) and row.epoch == epoch
            and row.site_id == site_id)


def _admitted(store: Store, request_ids: list[str]
              ) -> dict[str, tuple[str, str, usage_check.Admitted]]:
    """(model, tier, what was counted at admission) of each request: its price depends on the
    first two, its bill on the rest; none of them ever changes, so they are read before the
    write transaction."""
    found: dict[str, tuple[str, str, usage_check.Admitted]] = {}
    with store.read() as conn:
        rows: list[Any] = []
        for start in range(0, len(request_ids), 500):
            rows += conn.execute(lease_sql.ADMITTED,
                                 {"b_ids": request_ids[start:start + 500]}).all()
        # Batch lines completed before the batch jobs counted their prompts: counted now.
        late = prompt_count.count_rows(conn, [
            r.id for r in rows if r.counted_prompt_tokens is None and r.num_choices is not None])
    for r in rows:
        counted = late.get(r.id)
        found[r.id] = (r.model or "", r.tier, usage_check.Admitted(
            prompt_tokens=counted.tokens if counted else r.counted_prompt_tokens,
            prompt_exact=bool(counted.exact if counted else r.prompt_count_exact),
            num_choices=r.num_choices, max_tokens=r.max_tokens,
            embedding=r.kind == Kind.EMBEDDING.value))
    return found


def work_queued(store: Store) -> bool:
    """Whether any request waits in the queue (a read: a held lease call's later looks)."""
    with store.read() as conn:
        return lease_queue.any_queued(conn)


def held_by(store: Store, site_id: str) -> int:
    """Leases the site holds now."""
    with store.read() as conn:
        return int(conn.execute(
            select(func.count()).select_from(requests)
            .where(requests.c.site_id == site_id,
                   requests.c.status.in_(lease_sql.HELD_STATUSES))).scalar() or 0)


@retry_conflicts
def reap_expired(store: Store, now: float) -> int:
    """Send expired leases back to the queue with their checkpoints; returns how many."""
    with store.write() as conn:
        rows = conn.execute(
            update(requests)
            # lease_rules.is_expired: held, and its expiry passed
            .where(requests.c.status.in_(lease_sql.HELD_STATUSES),
                   requests.c.lease_expires_at < now)
            .values(status=_QUEUED, lease_id=None, lease_expires_at=None,
                    version=requests.c.version + 1)
            .returning(requests.c.site_id)).scalars().all()
        for site_id, count in Counter(rows).items():
            conn.execute(update(sites).where(sites.c.id == site_id)
                         .values(leases_expired=sites.c.leases_expired + count))
    return len(rows)
