"""Two control-plane processes on one PostgreSQL store, a site on each; one process is killed
with SIGKILL while a batch runs, and started again once its site's leases went to the other
site. Every request completes exactly once with the text an uninterrupted run gives, the
checkpoints the store accepted for a request only ever grow and are prefixes of its result,
and the late results of the site whose control plane died are refused for their stale epoch
(fencing), not accepted beside the results of the site that took the requests over.

Each site talks through a recording proxy (proxy.py), which sees every checkpoint and
completion the control plane accepted or refused. The sites run the fake engine: no model, made
-up tokens that depend only on the request's seed and position, so a resumed request continues
exactly as the uninterrupted one would and its whole text is known in advance.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from fleet_checks import accepted_history, batch_records, wait_until
from proxy import FleetProxy, fleet_proxy
from serve_process import MODEL, Serve, Worker, free_port

from minimill.fleet.fake_engine import fake_token_id

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
NUM_LINES = 96
MAX_TOKENS = 24
CAPACITY = 16
# Tokens/s of a full site: a request takes MAX_TOKENS * CAPACITY / RATE = 3.8 s, several of
# the 0.5 s checkpoints, and the two sites need three rounds for the batch.
RATE = 100.0


def _line(i: int) -> str:
    return json.dumps({"custom_id": f"k-{i:03d}", "method": "POST",
                       "url": "/v1/chat/completions",
                       "body": {"model": MODEL, "max_tokens": MAX_TOKENS, "seed": i,
                                "messages": [{"role": "user", "content": f"line {i}"}]}})


def _expected_text(i: int) -> str:
    return "".join(f" t{fake_token_id(i, p)}" for p in range(MAX_TOKENS))


def _in_flight(link: FleetProxy) -> dict[str, int]:
    """Request id -> epoch of each lease granted through `link` and not yet reported back."""
    granted = {lease["request_id"]: lease["epoch"]
               for e in link.find("/lease") if e.status == 200
               for lease in e.response.get("leases", [])}
    for e in link.find("/complete"):
        for result in (e.request or {}).get("results", []):
            granted.pop(result["request_id"], None)
    return granted


def _granted_later(links: list[FleetProxy], held: dict[str, int]) -> bool:
    """Whether some request of `held` (id -> epoch) was granted again at a later epoch."""
    return any(lease["request_id"] in held and lease["epoch"] > held[lease["request_id"]]
               for link in links for e in link.find("/lease") if e.status == 200
               for lease in e.response.get("leases", []))


def _accepted_through(links: list[FleetProxy]) -> set[str]:
    """The request ids whose completion a control plane accepted, as the proxies saw it."""
    return {rid for link in links for e in link.find("/complete") if e.status == 200
            for rid in e.response.get("accepted", [])}


def _checkpointed(link: FleetProxy) -> bool:
    return any(item.get("checkpoint") or item.get("delta")
               for e in link.find("/heartbeat") if e.status == 200
               for item in e.request["leases"])


def test_a_control_plane_killed_mid_batch_loses_and_doubles_nothing(
        fleet_home: Path, pg_url: str, tmp_path: Path) -> None:
    env = {"MINIMILL_SITE_CHECKPOINTS_PER_S": "1000"}
    planes = [Serve(fleet_home, db=pg_url, local_worker=False, extra_env=env)
              for _ in range(2)]
    workers: list[Worker] = []
    try:
        for plane in planes:
            plane.start_and_wait()
        with contextlib.ExitStack() as stack:
            links = [stack.enter_context(fleet_proxy(f"http://127.0.0.1:{p.port}", free_port()))
                     for p in planes]
            for i, (plane, link) in enumerate(zip(planes, links, strict=True)):
                token = plane.cli("sites", "create", f"mill-{i}", "--db", pg_url).stdout
                workers.append(Worker(fleet_home, link.url, f"mill-{i}", token.split()[-1],
                                      engine=f"fake:{RATE}",
                                      extra_args=("--capacity", str(CAPACITY))))
            for worker in workers:
                worker.start_and_wait()

            path = tmp_path / "batch.jsonl"
            path.write_text("\n".join(_line(i) for i in range(NUM_LINES)) + "\n")
            client = planes[0].client()
            uploaded = client.files.create(file=path.open("rb"), purpose="batch")
            batch = client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                          endpoint="/v1/chat/completions")

            # Kill the second plane while its site holds leases it has checkpointed.
            wait_until(lambda: _checkpointed(links[1]) and len(_in_flight(links[1])) >= 4, 120,
                       "checkpointed leases through the second control plane")
            planes[1].kill9()
            held = _in_flight(links[1])
            # Its site cannot reach it; the leases expire and the first site takes them over.
            wait_until(lambda: _granted_later(links, held), 120,
                       "the dead plane's leases granted again")
            planes[1].start_and_wait()  # the stranded site's late results now reach the store

            done = wait_until(lambda: (b := client.batches.retrieve(batch.id)).status in (
                "completed", "failed", "cancelled", "expired") and b, 300, "the batch")
            assert done.status == "completed"
            records = batch_records(client, done)
            # A proxy records an exchange once its answer is back, which can be after the
            # test sees the batch that answer ended completed.
            wait_until(lambda: {r["response"]["request_id"] for r in records}
                       <= _accepted_through(links), 60,
                       "the proxies' record of every result's accepted completion")
            history = accepted_history(links)
            completions = [e for link in links for e in link.find("/complete")
                           if e.status == 200]
            late = [r for e in links[1].find("/complete") if e.status == 200
                    for r in e.response.get("rejected", [])]

        # Nothing lost, nothing twice, each the text an uninterrupted run gives.
        ids = Counter(r["custom_id"] for r in records)
        assert set(ids) == {f"k-{i:03d}" for i in range(NUM_LINES)} and max(ids.values()) == 1
        texts: dict[str, str] = {}
        for r in records:
            body: dict[str, Any] = r["response"]["body"]
            i = int(r["custom_id"][2:])
            assert body["choices"][0]["message"]["content"].strip() == \
                _expected_text(i).strip(), r["custom_id"]
            texts[r["response"]["request_id"]] = _expected_text(i)

        # Checkpoints accepted in order: each request's only grow, each a prefix of its text.
        lengths: dict[str, int] = {}
        for _, request_id, checkpoint in history:
            (choice,) = checkpoint["choices"]
            assert texts[request_id].startswith(choice["text"]), request_id
            assert len(choice["token_ids"]) >= lengths.get(request_id, 0), request_id
            lengths[request_id] = len(choice["token_ids"])
        resumed = {lease["request_id"] for link in links for e in link.find("/lease")
                   if e.status == 200 for lease in e.response.get("leases", [])
                   if any(c.get("token_ids") for c in
                          (lease.get("checkpoint") or {}).get("choices") or [])}
        assert resumed & set(held)  # the dead plane's site's work went on from checkpoints

        # Fencing: one accepted completion per request; the stranded site's late results for
        # requests granted again were refused, and the store counted each refusal.
        accepted = Counter(rid for e in completions for rid in e.response.get("accepted", []))
        assert set(accepted) == set(texts) and max(accepted.values()) == 1
        refused = [r for e in completions for r in e.response.get("rejected", [])]
        assert late and {r["request_id"] for r in late} <= set(held)
        assert {r["reason"] for r in refused} <= {"stale_epoch", "already_completed"}
        sites = json.loads(planes[0].cli("sites", "list", "--json", "--db", pg_url).stdout)
        assert sum(s["stale_completions"] for s in sites) == len(refused)
    finally:
        for worker in workers:
            worker.stop()
        for plane in planes:
            plane.stop()
