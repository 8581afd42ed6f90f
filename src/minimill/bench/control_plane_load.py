"""What tenants do to the control plane in `minimill bench control-plane`, and the checks that
every request completed exactly once.

One tenant submits a Batch API job; another makes streaming realtime chat calls, a few at a
time, reading each stream to its end. Both over the HTTP API with httpx, as any client would.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

POLL_S = 0.25
TERMINAL = ("completed", "failed", "expired", "cancelled")


@dataclass
class Realtime:
    """Streaming calls from `concurrency` threads; `answered` counts those that ended in a
    finished choice, `errors` the rest (their messages, a few)."""

    base_url: str
    key: str
    model: str
    count: int
    max_tokens: int
    concurrency: int = 64
    answered: int = 0
    errors: list[str] = field(default_factory=list)
    _next: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _take(self) -> int | None:
        with self._lock:
            if self._next >= self.count:
                return None
            self._next += 1
            return self._next - 1

    def _one(self, client: httpx.Client, i: int) -> None:
        body = {"model": self.model, "max_tokens": self.max_tokens, "stream": True,
                "messages": [{"role": "user", "content": f"Realtime request {i}."}]}
        finished = False
        with client.stream("POST", "/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.read()[:200]!r}")
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    finished |= any(c.get("finish_reason") for c in chunk.get("choices", []))
        if not finished:
            raise RuntimeError("the stream ended without a finished choice")

    def _run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=600,
                          headers={"Authorization": f"Bearer {self.key}"}) as client:
            while (i := self._take()) is not None:
                try:
                    self._one(client, i)
                    with self._lock:
                        self.answered += 1
                except (httpx.HTTPError, RuntimeError, ValueError) as exc:
                    with self._lock:
                        self.errors.append(f"{type(exc).__name__}: {exc}")

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._run, daemon=True)
                         for _ in range(min(self.concurrency, self.count))]
        for thread in self._threads:
            thread.start()

    def join(self, timeout_s: float) -> bool:
        """Whether every call ended within timeout_s."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)


def batch_lines(model: str, count: int, max_tokens: int, tag: str = "req") -> bytes:
    return "".join(json.dumps({
        "custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": model, "max_tokens": max_tokens,
                 "messages": [{"role": "user", "content": f"Batch request {i}."}]}}) + "\n"
        for i in range(count)).encode()


class BatchJob:
    """One Batch API job: submitted, waited on, its output files read back."""

    def __init__(self, base_url: str, key: str) -> None:
        self.client = httpx.Client(base_url=base_url, timeout=120,
                                   headers={"Authorization": f"Bearer {key}"})
        self.batch: dict[str, Any] = {}

    def submit(self, content: bytes) -> None:
        uploaded = self.client.post("/files", data={"purpose": "batch"},
                                    files={"file": ("bench.jsonl", content)})
        uploaded.raise_for_status()
        created = self.client.post("/batches", json={
            "input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions",
            "completion_window": "24h"})
        created.raise_for_status()
        self.batch = created.json()

    def done(self) -> bool:
        resp = self.client.get(f"/batches/{self.batch['id']}")
        resp.raise_for_status()
        self.batch = resp.json()
        return self.batch["status"] in TERMINAL

    def custom_ids(self) -> tuple[Counter[str], int]:
        """How often each custom_id is in the output and error files, and the errors."""
        ids: Counter[str] = Counter()
        failed = 0
        for key in ("output_file_id", "error_file_id"):
            if self.batch.get(key):
                resp = self.client.get(f"/files/{self.batch[key]}/content")
                resp.raise_for_status()
                for line in resp.text.splitlines():
                    if line.strip():
                        record = json.loads(line)
                        ids[record["custom_id"]] += 1
                        failed += record.get("error") is not None
        return ids, failed

    def close(self) -> None:
        self.client.close()


def exactly_once(ids: Counter[str], expected: int, tag: str = "req") -> dict[str, int]:
    """Lost and duplicated lines of a batch whose custom_ids are TAG-0 ... TAG-(expected-1)."""
    wanted = {f"{tag}-{i}" for i in range(expected)}
    return {"lost": len(wanted - set(ids)),
            "duplicates": sum(n - 1 for n in ids.values()) + len(set(ids) - wanted)}
