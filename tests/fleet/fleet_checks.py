"""Checks shared by the fleet failure tests: waiting, batch results, recorded checkpoints."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from proxy import FleetProxy

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str) -> T:
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def accepted_checkpoints(proxies: Iterable[FleetProxy]) -> dict[str, dict[str, Any]]:
    """request_id -> the newest checkpoint the control plane accepted (lease still held)."""
    newest: dict[str, tuple[float, dict[str, Any]]] = {}
    for proxy in proxies:
        for exchange in proxy.find("/heartbeat"):
            if exchange.status != 200:
                continue
            for item in exchange.request["leases"]:
                checkpoint, request_id = item.get("checkpoint"), item["request_id"]
                if checkpoint and request_id in exchange.response["extended"]:
                    if request_id not in newest or newest[request_id][0] <= exchange.at:
                        newest[request_id] = (exchange.at, checkpoint)
    return {request_id: checkpoint for request_id, (_, checkpoint) in newest.items()}


def batch_records(client: Any, batch: Any) -> list[dict[str, Any]]:
    """Every line of a finished batch's output and error files."""
    records: list[dict[str, Any]] = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id:
            records += [json.loads(line) for line in client.files.content(file_id).read()
                        .splitlines() if line.strip()]
    return records
