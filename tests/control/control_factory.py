"""Factories for control-plane tests: batch lines, files, batches, sites."""

from __future__ import annotations

import functools
import json
import time
from typing import Any

from minimill.control.batch_load import ingest_pending
from minimill.control.batches import create_batch, get_batch
from minimill.control.config import ControlConfig
from minimill.control.files import create_file
from minimill.control.keys import ensure_tenant
from minimill.control.records import BatchRecord, Site, Tenant
from minimill.control.sites import authenticate_site, create_site
from minimill.control.store import Store
from minimill.models.prompt import render_chat_prompt
from minimill.models.registry import resolve_model
from minimill.models.tokenizer import Tokenizer
from minimill.models.tokenizer_files import load_tokenizer
from minimill.transport.protocol import (
    ChoiceProgress,
    CompleteRequest,
    CompletionItem,
    LeaseRequest,
    Usage,
)

MODEL = "smollm2-135m"
CONFIG = ControlConfig(lease_ttl_s=10.0)


def chat_line(custom_id: str, content: str = "hi", **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": MODEL, "max_tokens": 8,
                                "messages": [{"role": "user", "content": content}], **body}})


def tenant(store: Store, name: str = "acme") -> Tenant:
    return ensure_tenant(store, name)


def site(store: Store, name: str = "s1", price_per_hour: float = 0.36) -> Site:
    found = authenticate_site(store, create_site(store, name, price_per_hour, "cpu"))
    assert found is not None
    return found


def batch(store: Store, owner: Tenant, lines: list[str], now: float | None = None,
          window: str = "24h", config: ControlConfig = CONFIG) -> BatchRecord:
    """A batch whose lines are queued (its ingest ran to the end)."""
    f = create_file(store, owner.id, "batch", "in.jsonl", ["\n".join(lines).encode()])
    created = create_batch(store, owner.id, f.id, "/v1/chat/completions", window, None, config,
                           now=now)
    ingest_pending(store, time.time(), config)
    return get_batch(store, owner.id, created.id)


@functools.cache
def _tokenizer() -> Tokenizer:
    return load_tokenizer(resolve_model(MODEL))[0]


def chat_prompt_tokens(content: str) -> int:
    """The prompt tokens of a one-message chat, as a builtin worker renders and encodes it
    (models/prompt.py): what the control plane bills, whatever a site reports."""
    return len(render_chat_prompt(_tokenizer(), [{"role": "user", "content": content}]))


def ask(capacity: int = 8, tokens_per_s: float | None = 100.0) -> LeaseRequest:
    return LeaseRequest(capacity=capacity, models=[MODEL], tokens_per_s=tokens_per_s)


def success(request_id: str, epoch: int, text: str = "ok", tokens: int = 2) -> CompleteRequest:
    return CompleteRequest(results=[CompletionItem(
        request_id=request_id, epoch=epoch, outcome="succeeded",
        choices=[ChoiceProgress(index=0, token_ids=list(range(tokens)), text=text,
                                finish_reason="stop")],
        usage=Usage(prompt_tokens=3, completion_tokens=tokens))])
