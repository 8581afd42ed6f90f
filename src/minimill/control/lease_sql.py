"""The statements of the lease calls' hot path (leases.py), built once with bound parameters.

A lease, heartbeat or completion call runs a handful of statements; built afresh each time (a
new expression tree, its cache key computed) they cost SQLAlchemy more CPU than the database
spends running them. Built once here, each execution only binds its values. Every transition
stays a conditional UPDATE on status and epoch, as leases.py describes.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Float, Integer, String, Update, bindparam, select, tuple_, update

from minimill.control import lease_rules
from minimill.control.records import RequestStatus
from minimill.control.tables import requests

_LEASED = RequestStatus.LEASED.value
_GRANTABLE = [s.value for s in lease_rules.GRANTABLE]
# The state machine's status sets (lease_rules), as column values.
HELD_STATUSES = [s.value for s in lease_rules.HELD]
COMPLETABLE_STATUSES = [s.value for s in lease_rules.COMPLETABLE]

# What a lease hands out of each row it grants.
GRANTED = (requests.c.id, requests.c.epoch, requests.c.kind, requests.c.model,
           requests.c.body, requests.c.seed, requests.c.progress, requests.c.stream,
           requests.c.session_key, requests.c.tenant_id, requests.c.tier)

# Parameters (each named with a b_ prefix): ids (a list), lease_id, site_id, expires_at,
# now.
GRANT = (update(requests)
         .where(requests.c.id.in_(bindparam("b_ids", expanding=True)),
                requests.c.status.in_(_GRANTABLE))
         .values(status=_LEASED, epoch=requests.c.epoch + 1,
                 lease_id=bindparam("b_lease_id", type_=String()),
                 site_id=bindparam("b_site_id", type_=String()),
                 lease_expires_at=bindparam("b_expires_at", type_=Float()),
                 leased_at=bindparam("b_now", type_=Float()),
                 attempts=requests.c.attempts + 1, version=requests.c.version + 1,
                 lease_base_tokens=requests.c.checkpoint_tokens)
         .returning(*GRANTED))

# The leases granted under one lease id that its site still holds, extended: a lease call
# retried after its answer was lost gets them again at their epoch. Parameters: site_id,
# lease_id, expires_at.
REDELIVER = (update(requests)
             .where(requests.c.site_id == bindparam("b_site_id", type_=String()),
                    requests.c.status == _LEASED,
                    requests.c.lease_id == bindparam("b_lease_id", type_=String()))
             .values(lease_expires_at=bindparam("b_expires_at", type_=Float()))
             .returning(*GRANTED))

# Parameters: site_id, pairs (a list of (request id, epoch)), expires_at.
EXTEND = (update(requests)
          .where(requests.c.site_id == bindparam("b_site_id", type_=String()),
                 requests.c.status.in_(HELD_STATUSES),
                 tuple_(requests.c.id, requests.c.epoch).in_(
                     bindparam("b_pairs", expanding=True)))
          .values(lease_expires_at=bindparam("b_expires_at", type_=Float()))
          .returning(requests.c.id))

# Parameters: ids (a list).
ADMITTED = (select(requests.c.id, requests.c.model, requests.c.tier,
                   requests.c.counted_prompt_tokens, requests.c.prompt_count_exact,
                   requests.c.num_choices, requests.c.max_tokens, requests.c.kind)
            .where(requests.c.id.in_(bindparam("b_ids", expanding=True))))


def _finish(**values: Any) -> Update:
    """A completion's conditional UPDATE: at the sent epoch, from the holder, not terminal.
    Parameters: request_id, epoch, site_id, now, and the named values'."""
    return (update(requests)
            .where(requests.c.id == bindparam("b_request_id", type_=String()),
                   requests.c.epoch == bindparam("b_epoch", type_=Integer()),
                   requests.c.site_id == bindparam("b_site_id", type_=String()),
                   requests.c.status.in_(COMPLETABLE_STATUSES))
            .values(finished_at=bindparam("b_now", type_=Float()), lease_expires_at=None,
                    version=requests.c.version + 1, progress=None, **values))


# Parameters: those of _finish, and result, prompt_tokens, completion_tokens, billed_usd,
# cached_tokens.
SUCCEED = _finish(status=RequestStatus.SUCCEEDED.value,
                  result=bindparam("b_result", type_=requests.c.result.type),
                  prompt_tokens=bindparam("b_prompt_tokens", type_=Integer()),
                  completion_tokens=bindparam("b_completion_tokens", type_=Integer()),
                  billed_usd=bindparam("b_billed_usd", type_=Float()),
                  cached_tokens=bindparam("b_cached_tokens", type_=Integer()))
# Parameters: those of _finish, and error.
FAIL = _finish(status=RequestStatus.FAILED.value,
               error=bindparam("b_error", type_=requests.c.error.type))

# Parameters: request_id.
ROW_STATE = (select(requests.c.status, requests.c.epoch, requests.c.site_id,
                    requests.c.lease_base_tokens, requests.c.wasted_epoch)
             .where(requests.c.id == bindparam("b_request_id", type_=String())))

# Parameters: request_id, epoch.
MARK_WASTED = (update(requests)
               .where(requests.c.id == bindparam("b_request_id", type_=String()),
                      requests.c.wasted_epoch.is_distinct_from(
                          bindparam("b_epoch", type_=Integer())))
               .values(wasted_epoch=bindparam("b_epoch", type_=Integer())))
