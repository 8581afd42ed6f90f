"""A network partition: one worker is cut off from the control plane (its loopback proxy
black-holes every request), then healed. Its leases expire and resume on the other worker from
their checkpoints and end exactly as an uninterrupted run of the same requests does; after the
heal its stale work is revoked or rejected, never counted twice, and it takes work again."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fleet_checks import accepted_checkpoints, batch_records, wait_until
from proxy import fleet_proxy
from resume_reference import assert_results_match_reference, finished_requests, rendered, trust_line
from serve_process import Serve, Worker, free_port

from minimill.control.records import Kind

pytestmark = pytest.mark.slow
NUM_LINES = 24


def test_partitioned_worker_loses_nothing_and_rejoins(fleet_home: Path, tmp_path: Path) -> None:
    serve = Serve(fleet_home, local_worker=False).start_and_wait()
    workers: list[Worker] = []
    try:
        tokens = {name: serve.cli("sites", "create", name).stdout.strip().splitlines()[-1]
                  for name in ("cut", "ok")}
        with fleet_proxy(f"http://127.0.0.1:{serve.port}", free_port()) as link:
            cut = Worker(fleet_home, link.url, "cut", tokens["cut"]).start_and_wait()
            workers.append(cut)
            path = tmp_path / "jobs.jsonl"
            path.write_text("\n".join(
                trust_line(f"p-{i:02d}", i, f"Write a paragraph about river {i}.", 40)
                for i in range(NUM_LINES)) + "\n")
            client = serve.client()
            uploaded = client.files.create(file=path.open("rb"), purpose="batch")
            batch = client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                          endpoint="/v1/chat/completions")
            wait_until(lambda: len(accepted_checkpoints([link])) >= NUM_LINES // 2, 120,
                       "checkpoints from the worker about to be cut off")

            link.blocked.add("")  # every route hangs: the site is unreachable
            cut_at = time.time()
            ok = Worker(fleet_home, f"http://127.0.0.1:{serve.port}", "ok",
                        tokens["ok"]).start_and_wait()
            workers.append(ok)
            ok.wait_for_log(r"resume from checkpoints", 60)
            cut.wait_for_log(r"(heartbeat|complete) failed", 60)
            time.sleep(max(0.0, cut_at + 8 - time.time()))  # stay cut off past two TTLs
            checkpoints = accepted_checkpoints([link])  # the last ones before the cut
            link.blocked.clear()
            healed_at = time.time()

            done = wait_until(lambda: (b := client.batches.retrieve(batch.id)).status in (
                "completed", "failed", "cancelled", "expired") and b, 300, "the batch")
            assert done.status == "completed"
            records = batch_records(client, done)
            assert sorted(r["custom_id"] for r in records) == \
                sorted(f"p-{i:02d}" for i in range(NUM_LINES))  # each exactly once
            assert all(r["response"]["status_code"] == 200 for r in records)
            for record in records:
                request_id = record["response"]["request_id"]
                for choice in checkpoints.get(request_id, {"choices": []})["choices"]:
                    text = record["response"]["body"]["choices"][choice["index"]]["message"][
                        "content"]
                    assert text.startswith(choice["text"])

            # Healed: the cut-off worker talks to the control plane again.
            wait_until(lambda: any(e.path.endswith("/lease") and e.at > healed_at
                                   for e in link.exchanges), 30, "a lease call after the heal")
        # The cut worker may still be retrying its late complete when the batch ends: wait
        # for it to hear that its leases are gone.
        wait_until(lambda: "leases revoked" in cut.log_text() or "rejected" in cut.log_text(),
                   60, "the cut worker to learn its leases were revoked")

        # Each result, those resumed on the other worker included, is what an uninterrupted
        # run gives.
        for worker in workers:
            worker.stop()  # idle now; the reference run below gets the CPU
        compared = assert_results_match_reference(finished_requests(serve.db_url(),
                                                                    batch_id=batch.id))
        assert compared.resumed
        for record in records:
            request_id = record["response"]["request_id"]
            assert record["response"]["body"]["choices"] == rendered(
                Kind.CHAT, compared.reference[request_id], request_id)
    finally:
        for worker in workers:
            worker.stop()
        serve.stop()
