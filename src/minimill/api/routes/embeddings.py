"""POST /v1/embeddings: one vector per input, computed by a worker like any request."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from minimill.api.deps import ConfigDep, StoreDep, TenantDep, WatcherDep
from minimill.api.embedding_schemas import EmbeddingList
from minimill.api.errors import error_responses
from minimill.api.realtime import serve_realtime
from minimill.control.embeddings import EmbeddingBody
from minimill.control.records import Kind

router = APIRouter(prefix="/v1", tags=["embeddings"],
                   responses=error_responses(400, 401, 404, 409, 500, 504))


@router.post("/embeddings", response_model=EmbeddingList)
async def create_embeddings(body: EmbeddingBody, request: Request, store: StoreDep,
                            tenant: TenantDep, config: ConfigDep,
                            watcher: WatcherDep) -> Response | dict[str, Any]:
    """The last prompt token's final normed hidden state of each input, L2-normalised
    (last-token pooling over the served decoder, the Qwen3-Embedding recipe)."""
    return await serve_realtime(request, Kind.EMBEDDING, body, store, tenant, config, watcher)
