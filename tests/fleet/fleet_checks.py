"""Checks shared by the fleet failure tests: waiting, batch results, recorded checkpoints and
completions, a worker's engine processes."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
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


def _apply(state: dict[int, dict[str, Any]], item: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The progress after a heartbeat item's checkpoint: a whole one replaces, a delta's
    pieces extend each choice at the lengths they say they extend."""
    if item.get("checkpoint"):
        return {c["index"]: {"text": c.get("text", ""), "token_ids": list(c.get("token_ids", []))}
                for c in item["checkpoint"]["choices"]}
    new = {i: dict(c) for i, c in state.items()}
    for d in item["delta"]["choices"]:
        old = new.get(d["index"], {"text": "", "token_ids": []})
        new[d["index"]] = {
            "text": old["text"][:d.get("base_chars", 0)] + d.get("text", ""),
            "token_ids": old["token_ids"][:d.get("base_tokens", 0)] + d.get("token_ids", [])}
    return new


def accepted_history(proxies: Iterable[FleetProxy]) -> list[tuple[float, str,
                                                                  dict[str, Any]]]:
    """(when, request_id, checkpoint) for every checkpoint the control plane accepted from the
    proxied workers, oldest first, rebuilt from each lease's checkpoint and the deltas after it
    (a checkpoint as `{"choices": [{"index", "text", "token_ids"}]}`)."""
    exchanges = sorted((e for proxy in proxies for e in proxy.find("")), key=lambda e: e.at)
    held: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    history: list[tuple[float, str, dict[str, Any]]] = []
    for exchange in exchanges:
        if exchange.status != 200:
            continue
        if exchange.path.endswith("/lease"):
            for lease in exchange.response["leases"]:
                held[(lease["request_id"], lease["epoch"])] = _apply(
                    {}, {"checkpoint": lease.get("checkpoint") or {"choices": []}})
        if not exchange.path.endswith("/heartbeat"):
            continue
        for item in exchange.request["leases"]:
            key = (item["request_id"], item["epoch"])
            if not (item.get("checkpoint") or item.get("delta")) or key not in held \
                    or item["request_id"] not in exchange.response["extended"] \
                    or item["request_id"] in exchange.response.get("resync", []):
                continue
            held[key] = _apply(held[key], item)
            history.append((exchange.at, item["request_id"], {"choices": [
                {"index": i, **c} for i, c in sorted(held[key].items())]}))
    return history


def accepted_checkpoints(proxies: Iterable[FleetProxy]) -> dict[str, dict[str, Any]]:
    """request_id -> the newest checkpoint the control plane accepted (lease still held)."""
    return {request_id: checkpoint for _, request_id, checkpoint in accepted_history(proxies)}


def batch_records(client: Any, batch: Any) -> list[dict[str, Any]]:
    """Every line of a finished batch's output and error files."""
    records: list[dict[str, Any]] = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id:
            records += [json.loads(line) for line in client.files.content(file_id).read()
                        .splitlines() if line.strip()]
    return records


def resume_points(proxies: Iterable[FleetProxy],
                  decode: Callable[[Sequence[int]], str]) -> Counter[str]:
    """Of the leases the proxied workers were handed with a checkpoint to continue, how many
    continued at each kind of point resuming can get wrong (a lease may count under several):
    inside a split UTF-8 character, with a stop-string prefix held back, after a choice had
    finished, with n > 1, with logprobs, sampled (temperature > 0)."""
    points: Counter[str] = Counter()
    for exchange in (e for proxy in proxies for e in proxy.find("/lease")):
        if exchange.status != 200:
            continue
        for lease in exchange.response["leases"]:
            choices = (lease.get("checkpoint") or {}).get("choices") or []
            if not any(c.get("token_ids") for c in choices):
                continue
            points["resumed"] += 1
            running = [(c, decode(c["token_ids"])) for c in choices
                       if c.get("finish_reason") is None]
            points["mid UTF-8"] += any(d.endswith("\ufffd") for _, d in running)
            # Decoded but not handed out, beyond an unfinished character: a stop's prefix.
            points["held-back stop prefix"] += any(len(c["text"]) < len(d.rstrip("\ufffd"))
                                                   for c, d in running)
            points["after a finished choice"] += len(running) < len(choices)
            points["n > 1"] += (lease["body"].get("n") or 1) > 1
            points["logprobs"] += any(c.get("logprobs") for c in choices)
            points["sampled"] += lease["body"].get("temperature", 1.0) > 0
    return points


def leased_with_tokens(link: FleetProxy) -> set[str]:
    """Requests whose checkpoint the control plane accepted with some tokens in it."""
    return {request_id for request_id, checkpoint in accepted_checkpoints([link]).items()
            if any(choice["token_ids"] for choice in checkpoint["choices"])}


def accepted_completions(*links: FleetProxy) -> Counter[str]:
    """How many times the control plane accepted each request's completion."""
    return Counter(request_id for link in links for exchange in link.find("/complete")
                   if exchange.status == 200 for request_id in exchange.response["accepted"])


def _spawned(pid: int) -> list[int]:
    """The children of `pid` started by multiprocessing's spawn (not its resource tracker)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def engine_peer_pids(worker_pid: int) -> list[int]:
    """The pipeline stages or expert-parallel ranks of a worker's engine: what its engine
    process (a spawned child of the worker) spawned in turn."""
    return [peer for engine in _spawned(worker_pid) for peer in _spawned(engine)]
