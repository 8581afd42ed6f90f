"""Realtime chat/completions/embeddings calls: queue a row, wait for a worker's completion,
answer.

The call inserts a request row (tier realtime, or background for service_tier "flex") and
waits: woken at once when the completion arrives through this process, else by the shared
poller. A client that goes away cancels its request, so no worker keeps generating for nobody.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from minimill.api.lease_wakeup import lease_wakeup_of
from minimill.api.progress import ProgressWatcher, Watch
from minimill.api.rate_headers import remember
from minimill.api.streaming import ChunkStream, num_choices
from minimill.control.bodies import ChatBody, CompletionBody, prepare_body
from minimill.control.checkpoints import has_output
from minimill.control.config import ControlConfig
from minimill.control.embeddings import EmbeddingBody, prepare_embedding, render_embeddings
from minimill.control.errors import ConflictError, ControlError, RequestTimeoutError
from minimill.control.records import Kind, RequestRecord, RequestStatus, Tenant
from minimill.control.render import render_response, usage_dict
from minimill.control.requests import cancel_request, get_request, submit_limited
from minimill.control.store import Store
from minimill.control.tenant_limits import limits_for


class WorkerReportedError(ControlError):
    """The worker failed the request (e.g. context_length_exceeded): a 400 for the client."""


def _raise_for(record: RequestRecord) -> None:
    error = record.error or {}
    if record.status == RequestStatus.FAILED:
        failure = WorkerReportedError(str(error.get("message") or "the request failed"),
                                      param=error.get("param"), code=error.get("code"))
        if error.get("code") == "server_error":
            failure.status_code, failure.error_type = 500, "server_error"
        raise failure
    if record.status == RequestStatus.EXPIRED:
        raise RequestTimeoutError("No worker finished the request in time; try again later.",
                                  code="timeout")
    raise ConflictError("The request was cancelled.", code="cancelled")


async def _wait(request: Request, store: Store, record: RequestRecord, watch: Watch,
                done: Callable[[RequestRecord], bool]) -> RequestRecord | None:
    """The row once `done` holds for it; None if the client went away first."""
    while not done(record):
        if not await watch.changed(request.is_disconnected):
            return None
        record = await anyio.to_thread.run_sync(get_request, store, record.tenant_id,
                                                record.id, False)
        if not record.terminal and time.time() > record.created_at + _timeout(request):
            raise RequestTimeoutError("No worker finished the request in time; try again "
                                      "later.", code="timeout")
    return record


def _timeout(request: Request) -> float:
    config: ControlConfig = request.app.state.config
    # The janitor expires the row at its deadline; this is the backstop without a janitor.
    return config.realtime_timeout_s + 5.0


async def serve_realtime(request: Request, kind: Kind,
                         body: ChatBody | CompletionBody | EmbeddingBody,
                         store: Store, tenant: Tenant, config: ControlConfig,
                         watcher: ProgressWatcher) -> Response | dict[str, Any]:
    prepared = (prepare_embedding(body, config.served_models, config.context_length_of)
                if isinstance(body, EmbeddingBody)
                else prepare_body(kind, body, config.served_models, config.context_length_of))
    # A call retried with the same Idempotency-Key waits for the first one's request; such a
    # request outlives a client that goes away (its retry will come for it).
    idempotency_key = (request.headers.get("idempotency-key") or "")[:500] or None
    limits = await anyio.to_thread.run_sync(limits_for, store, tenant.id,
                                            config.tenant_limits)
    request_id, rate = await anyio.to_thread.run_sync(submit_limited, store, tenant.id,
                                                      prepared, time.time(), config,
                                                      idempotency_key, limits)
    remember(request, rate)
    lease_wakeup_of(request.app).notify(1)  # a worker waiting in its lease call takes it at once
    watch = watcher.watch(request_id)
    handed_over = False
    record: RequestRecord | None = await anyio.to_thread.run_sync(get_request, store,
                                                                   tenant.id, request_id)
    try:
        assert record is not None
        if prepared.stream:
            record = await _wait(request, store, record, watch,
                                 lambda r: r.terminal or has_output(r.progress))
            if record is None:
                return Response(status_code=204)
            if record.terminal and record.status != RequestStatus.SUCCEEDED:
                _raise_for(record)
            assert not isinstance(body, EmbeddingBody)  # embeddings never stream
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = ChunkStream(request, store, watcher, watch, record, include_usage,
                                 num_choices(kind, prepared.body))
            handed_over = True
            return StreamingResponse(stream.events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        record = await _wait(request, store, record, watch, lambda r: r.terminal)
        if record is None:
            return Response(status_code=204)
        if record.status != RequestStatus.SUCCEEDED:
            _raise_for(record)
        if kind == Kind.EMBEDDING:
            return render_embeddings(record.model or prepared.model, prepared.body,
                                     (record.result or {}).get("choices", []),
                                     record.prompt_tokens, record.billed_usd)
        return render_response(kind, record.id, record.model or prepared.model,
                               record.created_at, record.tier,
                               (record.result or {}).get("choices", []),
                               usage_dict(record.prompt_tokens, record.completion_tokens,
                                          record.billed_usd, record.cached_tokens))
    finally:
        if not handed_over:
            watcher.unwatch(watch)
            if (record is None or not record.terminal) and idempotency_key is None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(cancel_request, store, request_id,
                                                   time.time(), "the client went away")
