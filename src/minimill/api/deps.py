"""Dependencies as Annotated aliases: the store, settings, and who calls: a tenant, an operator
or a site. Each route takes exactly one of TenantDep, OperatorDep and SiteDep (the route walk
in tests/api/test_api_roles.py checks every route with every kind of credential):

- tenant routes answer 401 to no key, an unknown key or a site token, and 403 to an operator
  key (a valid key of the wrong role); a harness credential (an agent lease's, `mmh-`) passes
  as its agent's tenant on the few routes a harness needs (api/harness_auth.py), 403
  elsewhere, and 401 once its lease ended;
- operator routes answer any other caller as an unknown URL would (404), so that a tenant does
  not learn they exist;
- worker protocol routes answer 401 to anything but a site token, and 403 to a site token
  not registered for their part of the protocol (`sites create NAME --serves tokens,boxes,
  agents`): token leases (TokenFleetDep, checked on the thread of the call's store work),
  box hosts (BoxSiteDep), agent runners (AgentSiteDep);
  a site's own outages answer any of its tokens (SiteDep).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from minimill.api import harness_auth
from minimill.api.box_wakeup import Wakeup
from minimill.api.errors import unknown_url
from minimill.api.lease_wakeup import lease_wakeup_of
from minimill.api.progress import ProgressWatcher
from minimill.control import harness_keys
from minimill.control.config import ControlConfig
from minimill.control.errors import AuthenticationError, PermissionDeniedError
from minimill.control.keys import authenticate, authenticate_operator, is_revoked
from minimill.control.records import Operator, Site, SiteScope, Tenant
from minimill.control.site_view import PeerView
from minimill.control.sites import TOKEN_PREFIX as SITE_TOKEN_PREFIX
from minimill.control.sites import authenticate_site
from minimill.control.store import Store

_bearer = HTTPBearer(auto_error=False, description="An API key (tenants), an operator key, "
                     "or a site token (workers, /v1/fleet/ routes).")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


# The lookups below are `async def`: FastAPI runs a plain `def` dependency on a thread of its
# pool, and a fleet call solved four of them (a hop to a thread and back each, about as much
# CPU as the call's own store work) to read three attributes.
async def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


async def get_config(request: Request) -> ControlConfig:
    config: ControlConfig = request.app.state.config
    return config


async def get_watcher(request: Request) -> ProgressWatcher:
    watcher: ProgressWatcher = request.app.state.watcher
    return watcher


StoreDep = Annotated[Store, Depends(get_store)]
ConfigDep = Annotated[ControlConfig, Depends(get_config)]
WatcherDep = Annotated[ProgressWatcher, Depends(get_watcher)]


def get_tenant(request: Request, store: StoreDep, credentials: Credentials) -> Tenant:
    if credentials is None:
        raise AuthenticationError("You didn't provide an API key. Send it as 'Authorization: "
                                  "Bearer YOUR_KEY' (minimill keys create --tenant NAME).",
                                  code="missing_api_key")
    if credentials.credentials.startswith(harness_keys.HARNESS_KEY_PREFIX):
        harness = harness_keys.authenticate(store, credentials.credentials, time.time())
        if harness is None:
            raise AuthenticationError("This harness credential's agent lease has ended.",
                                      code="invalid_api_key")
        harness_auth.admit(request, store, harness)
        return harness.tenant
    tenant = authenticate(store, credentials.credentials)
    if tenant is None:
        if authenticate_operator(store, credentials.credentials) is not None:
            raise PermissionDeniedError(
                "An operator key reaches the fleet routes only; this route needs a tenant's "
                "API key (minimill keys create --tenant NAME).", code="operator_key")
        if is_revoked(store, credentials.credentials):
            raise AuthenticationError("This API key was revoked; ask the operator for a new "
                                      "one.", code="invalid_api_key")
        raise AuthenticationError("Incorrect API key provided.", code="invalid_api_key")
    return tenant


def get_operator(store: StoreDep, credentials: Credentials) -> Operator:
    operator = (authenticate_operator(store, credentials.credentials)
                if credentials is not None else None)
    if operator is None:
        raise unknown_url()
    return operator


def get_site(store: StoreDep, credentials: Credentials) -> Site:
    return SiteCall(_site_token(credentials), None).site(store)


def _site_token(credentials: HTTPAuthorizationCredentials | None) -> str:
    if credentials is None:
        raise AuthenticationError("A site token is required (minimill sites create NAME).",
                                  code="missing_site_token")
    return credentials.credentials


_SCOPE_ROUTES = {SiteScope.TOKENS: "token leases", SiteScope.BOXES: "box hosts",
                 SiteScope.AGENTS: "agent runners"}


@dataclass(frozen=True, slots=True)
class SiteCall:
    """A worker protocol call's site token, not yet checked: the route checks it with `site`
    on the thread, and just before the transactions, of the call's own store work. Checked by
    a dependency, it cost every call a trip to a thread of its own besides.
    Nothing is cached: a token replaced or a scope withdrawn (`sites create --replace`, from
    any process) refuses the very next call."""

    token: str
    scope: SiteScope | None  # the part of the protocol the route is for; None: any

    def site(self, store: Store) -> Site:
        """The calling site; 401 for a token of no site, 403 for a site not registered for
        the route's part of the protocol."""
        site = authenticate_site(store, self.token)
        if site is None:
            raise AuthenticationError("Incorrect site token provided.",
                                      code="invalid_site_token")
        if self.scope is not None and self.scope not in site.serves:
            serves = ",".join(sorted(s.value for s in site.serves))
            raise PermissionDeniedError(
                f"Site {site.name!r} serves {serves}: this route is for "
                f"{_SCOPE_ROUTES[self.scope]} (the operator registers a site for it with "
                f"`minimill sites create {site.name} --replace --serves "
                f"{serves},{self.scope.value}`).", code="site_scope")
        return site


def _site_serving(scope: SiteScope) -> Callable[[Store, HTTPAuthorizationCredentials | None],
                                                Site]:
    def check(store: StoreDep, credentials: Credentials) -> Site:
        return SiteCall(_site_token(credentials), scope).site(store)

    return check


# Lease transactions running at once in one process. On SQLite they queue for its one write
# lock anyway; unbounded, a thousand sites' lease calls held every thread of the pool waiting
# for it, and the heartbeats and completions that free their slots found none.
LEASE_THREADS = 8


@dataclass(frozen=True, slots=True)
class TokenFleetCall:
    """All that a token lease call (lease, heartbeat, complete, release) takes, read from
    app.state at once: FastAPI's solving of a dependency per part, each keyed, cached and
    awaited, cost these calls more CPU than their thread's store work."""

    site: SiteCall  # checked by the call's work (token_calls.py), on its store work's thread
    store: Store
    config: ControlConfig
    watcher: ProgressWatcher
    lease_wakeup: Wakeup
    lease_threads: anyio.CapacityLimiter  # bounds this process's lease transactions
    peer_view: PeerView
    ingest_wake: asyncio.Event  # set when a completion ended a batch: finalize it now


def token_fleet_call(app: FastAPI, token: str) -> TokenFleetCall:
    """A token lease call of `token` (a site token by its shape, not yet checked) to `app`;
    the FastAPI routes' dependency and the lean path (lean_fleet.py) both build it here."""
    state = app.state
    limiter: anyio.CapacityLimiter | None = getattr(state, "lease_threads", None)
    if limiter is None:  # made on first use, in the loop that serves the app
        limiter = state.lease_threads = anyio.CapacityLimiter(LEASE_THREADS)
    return TokenFleetCall(SiteCall(token, SiteScope.TOKENS), state.store, state.config,
                          state.watcher, lease_wakeup_of(app), limiter, state.peer_view,
                          state.ingest_wake)


async def get_token_fleet_call(request: Request, credentials: Credentials) -> TokenFleetCall:
    token = _site_token(credentials)
    # Anything not shaped as a site token (a tenant's or an operator's key) is refused here,
    # before its body is read, as a dependency that checked the store refused it.
    if not token.startswith(SITE_TOKEN_PREFIX):
        raise AuthenticationError("Incorrect site token provided.", code="invalid_site_token")
    call = token_fleet_call(request.app, token)
    # A body FastAPI refuses never reaches the route: its 400 checks the token first
    # (errors.py), so that a site learns nothing of a part it does not serve.
    request.state.deferred_auth = functools.partial(call.site.site, call.store)
    return call


TenantDep = Annotated[Tenant, Depends(get_tenant)]
OperatorDep = Annotated[Operator, Depends(get_operator)]
SiteDep = Annotated[Site, Depends(get_site)]
# The token lease routes, the hottest of the protocol, check the token themselves (SiteCall).
TokenFleetDep = Annotated[TokenFleetCall, Depends(get_token_fleet_call)]
BoxSiteDep = Annotated[Site, Depends(_site_serving(SiteScope.BOXES))]
AgentSiteDep = Annotated[Site, Depends(_site_serving(SiteScope.AGENTS))]
