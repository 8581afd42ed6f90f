"""An outage announced for a busy site moves its work to another site before the window opens,
with nothing recomputed and outputs equal to an uninterrupted run.

Real processes: a control plane (`serve --no-local-worker`) and two `minimill worker`s running
the real model, a cheap site (all work goes there first) and a dear one. The same batch runs
twice: once undisturbed (the reference), once with an outage of the cheap site announced
(`minimill sites outage add`) while it is generating. The cheap site hears of it in a heartbeat
answer, checkpoints its requests and releases them; the dear site resumes them at once. Every
token either engine generated ends up in a result: no expiry, no stale completion, no token
decoded twice.
"""

from __future__ import annotations

import io
import json
import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fleet_checks import batch_records, wait_until
from openai import OpenAI
from serve_process import MODEL, Serve, Worker
from sqlalchemy import select

from minimill.control.store import open_store
from minimill.control.tables import requests, sites

pytestmark = pytest.mark.slow
STORIES = ["Write a long story about a lighthouse keeper and a storm.",
           "Write a long story about a clockmaker who lost his keys.",
           "Write a long story about a dragon learning to bake bread.",
           "Write a long story about two robots crossing a desert."]
# Long enough that the busy site cannot finish them before the handback time, however fast
# its engine is: the work must be moved, not finished in place.
MAX_TOKENS = 320
# The busy site hands back its work HANDBACK_LEAD_S before the outage (a lease TTL of 4 s
# makes it 4 / 3 + 1 s: a heartbeat's delay and a second), so about 4.7 s after the notice
# (the CLI that announces it takes 1-3 s of that on a loaded machine).
OUTAGE_IN_S = 7.0
HANDBACK_LEAD_S = 2.0
STATS = {"MINIMILL_WORKER_STATS_S": "0.25"}


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


def lines() -> str:
    return "\n".join(json.dumps({
        "custom_id": f"story-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
                 "messages": [{"role": "user", "content": text}]}})
        for i, text in enumerate(STORIES)) + "\n"


def submit(client: OpenAI) -> str:
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(lines().encode())),
                                   purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                 endpoint="/v1/chat/completions").id


def finished(client: OpenAI, batch_id: str) -> Any:
    return wait_until(lambda: (b := client.batches.retrieve(batch_id)).status in (
        "completed", "failed", "cancelled", "expired") and b, 600, f"batch {batch_id}")


def outputs(client: OpenAI, batch: Any) -> dict[str, str]:
    records = batch_records(client, batch)
    assert len(records) == len(STORIES) and all(r["response"] for r in records), records
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"]
            for r in records}


def completion_tokens(client: OpenAI, batch: Any) -> int:
    return sum(r["response"]["body"]["usage"]["completion_tokens"]
               for r in batch_records(client, batch))


def counter(worker: Worker, after: int = 0) -> int:
    """The worker's latest count of tokens its engine generated."""
    found = re.findall(r"generated_tokens[= ](\d+)", worker.log_text()[after:])
    return int(found[-1]) if found else 0


def test_an_announced_outage_moves_work_before_it_starts(fleet_home: Path) -> None:
    serve = Serve(fleet_home, local_worker=False,
                  extra_env={"MINIMILL_HANDBACK_LEAD_S": str(HANDBACK_LEAD_S)}).start_and_wait()
    store = open_store(serve.db_url())
    workers: list[Worker] = []
    try:
        server = f"http://127.0.0.1:{serve.port}"
        for name, price in (("busy", "0.05"), ("spare", "0.50")):
            made = serve.cli("sites", "create", name, "--price-per-hour", price)
            assert made.returncode == 0, made.stderr
            workers.append(Worker(fleet_home, server, name, made.stdout.split()[-1],
                                  extra_env=STATS))
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.wait_for_log(rf"worker for site '{worker.site}' ready", 180)
        busy, spare = workers
        client = serve.client(timeout=300)

        def holders(batch_id: str) -> list[tuple[str, str, Any]]:
            with store.read() as conn:
                return [tuple(r) for r in conn.execute(
                    select(sites.c.name, requests.c.status, requests.c.progress)
                    .join(sites, sites.c.id == requests.c.site_id)
                    .where(requests.c.batch_id == batch_id))]

        # The reference: undisturbed, all on the cheap site.
        reference_batch = finished(client, submit(client))
        reference = outputs(client, reference_batch)
        assert {name for name, _, _ in holders(reference_batch.id)} == {"busy"}
        wait_until(lambda: re.search(r"held=0\b", busy.log_text()[-200:]), 30, "an idle busy")
        before = {w.site: counter(w) for w in workers}
        offsets = {w.site: len(w.log_text()) for w in workers}

        batch_id = submit(client)

        def generating() -> bool:
            held = holders(batch_id)
            return len(held) == len(STORIES) and all(
                name == "busy" and status == "leased" and progress
                and progress["choices"][0]["tokens"] >= 3  # the stored checkpoint's lengths
                for name, status, progress in held)

        wait_until(generating, 120, "the busy site generating every request")
        start = time.time() + OUTAGE_IN_S
        announced = serve.cli("sites", "outage", "add", "busy", "--from", iso(start),
                              "--to", iso(start + 600))
        assert announced.returncode == 0, announced.stderr
        wait_until(lambda: not any(name == "busy" and status == "leased"
                                   for name, status, _ in holders(batch_id)),
                   OUTAGE_IN_S, "the busy site to hand back its work")
        assert time.time() < start, "handed back only after the window opened"
        done = finished(client, batch_id)
        assert done.status == "completed"

        # Moved, not lost: resumed on the spare site from the busy site's checkpoints.
        assert "handed back" in busy.log_text()[offsets["busy"]:]
        resumed = re.search(r"(\d+) resume from checkpoints \((\d+) tokens\)",
                            spare.log_text()[offsets["spare"]:])
        assert resumed is not None and int(resumed.group(2)) >= 3 * int(resumed.group(1))
        assert outputs(client, done) == reference
        listed = {s["name"]: s for s in json.loads(serve.cli("sites", "list", "--json").stdout)}
        for name in ("busy", "spare"):
            assert listed[name]["leases_expired"] == 0, listed[name]
            assert listed[name]["stale_completions"] == listed[name]["wasted_tokens"] == 0
        assert listed["busy"]["status"] in ("draining", "outage")  # the spare may still run

        # Every token generated for this batch is in its results: none decoded twice.
        for worker in workers:
            worker.stop()
        generated = sum(counter(w, offsets[w.site]) - before[w.site] for w in workers)
        assert generated == completion_tokens(client, done)
    finally:
        for worker in workers:
            worker.stop()
        store.close()
        serve.stop()
