"""POST /v1/chat/completions (stream and non-stream)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from minimill.api.deps import ConfigDep, StoreDep, TenantDep, WatcherDep
from minimill.api.errors import error_responses
from minimill.api.realtime import serve_realtime
from minimill.api.schemas import ChatCompletion
from minimill.control.bodies import ChatBody
from minimill.control.records import Kind

router = APIRouter(prefix="/v1/chat", tags=["chat"],
                   responses=error_responses(400, 401, 404, 409, 500, 504))

# With stream=true: server-sent events; each event's data is a JSON chunk, the last "[DONE]".
STREAM_RESPONSE: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {
    "schema": {"type": "object", "required": ["data"],
               "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}}}


@router.post("/completions", response_model=ChatCompletion, responses=STREAM_RESPONSE)
async def create_chat_completion(body: ChatBody, request: Request, store: StoreDep,
                                 tenant: TenantDep, config: ConfigDep,
                                 watcher: WatcherDep) -> Response | dict[str, Any]:
    return await serve_realtime(request, Kind.CHAT, body, store, tenant, config, watcher)
