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
  agents`): token leases (TokenSiteDep), box hosts (BoxSiteDep), agent runners (AgentSiteDep);
  a site's own outages answer any of its tokens (SiteDep).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from minimill.api import harness_auth
from minimill.api.errors import unknown_url
from minimill.api.progress import ProgressWatcher
from minimill.control import harness_keys
from minimill.control.config import ControlConfig
from minimill.control.errors import AuthenticationError, PermissionDeniedError
from minimill.control.keys import authenticate, authenticate_operator, is_revoked
from minimill.control.records import Operator, Site, SiteScope, Tenant
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
    if credentials is None:
        raise AuthenticationError("A site token is required (minimill sites create NAME).",
                                  code="missing_site_token")
    site = authenticate_site(store, credentials.credentials)
    if site is None:
        raise AuthenticationError("Incorrect site token provided.", code="invalid_site_token")
    return site


_SCOPE_ROUTES = {SiteScope.TOKENS: "token leases", SiteScope.BOXES: "box hosts",
                 SiteScope.AGENTS: "agent runners"}


def _site_serving(scope: SiteScope) -> Callable[[Site], Awaitable[Site]]:
    async def check(site: Annotated[Site, Depends(get_site)]) -> Site:
        if scope not in site.serves:
            serves = ",".join(sorted(s.value for s in site.serves))
            raise PermissionDeniedError(
                f"Site {site.name!r} serves {serves}: this route is for {_SCOPE_ROUTES[scope]} "
                f"(the operator registers a site for it with `minimill sites create "
                f"{site.name} --replace --serves {serves},{scope.value}`).", code="site_scope")
        return site

    return check


TenantDep = Annotated[Tenant, Depends(get_tenant)]
OperatorDep = Annotated[Operator, Depends(get_operator)]
SiteDep = Annotated[Site, Depends(get_site)]
TokenSiteDep = Annotated[Site, Depends(_site_serving(SiteScope.TOKENS))]
BoxSiteDep = Annotated[Site, Depends(_site_serving(SiteScope.BOXES))]
AgentSiteDep = Annotated[Site, Depends(_site_serving(SiteScope.AGENTS))]
