"""POST /v1/completions (stream and non-stream)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from minimill.api.deps import ConfigDep, StoreDep, TenantDep, WatcherDep
from minimill.api.errors import error_responses
from minimill.api.realtime import serve_realtime
from minimill.api.routes.chat import STREAM_RESPONSE
from minimill.api.schemas import Completion
from minimill.control.bodies import CompletionBody
from minimill.control.records import Kind

router = APIRouter(prefix="/v1", tags=["completions"],
                   responses=error_responses(400, 401, 404, 409, 500, 504))


@router.post("/completions", response_model=Completion, responses=STREAM_RESPONSE)
async def create_completion(body: CompletionBody, request: Request, store: StoreDep,
                            tenant: TenantDep, config: ConfigDep,
                            watcher: WatcherDep) -> Response | dict[str, Any]:
    return await serve_realtime(request, Kind.COMPLETION, body, store, tenant, config, watcher)
