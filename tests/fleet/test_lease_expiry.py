"""A worker frozen past its lease TTL: the request resumes on another worker from the frozen
worker's last checkpoint and ends exactly as an uninterrupted run of it does (text, token ids,
logprobs, through a stop-string prefix held back at every step), and the frozen worker's late
completion is rejected as stale.

Real processes throughout: a control plane (`serve --no-local-worker`) and workers A and B, each
reaching it through a recording loopback proxy. A's proxy holds A's heartbeats after A wakes up,
so A learns nothing of its lost lease before it tries to complete; B's proxy holds B's
completion until A's has been answered, so A's result arrives while B holds the newer epoch
(and B shows that an undeliverable result is kept and delivered later).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from fleet_checks import accepted_history, wait_until
from proxy import FleetProxy, fleet_proxy
from resume_reference import NEVER, assert_results_match_reference, finished_requests
from serve_process import MODEL, Serve, Worker, free_port

pytestmark = pytest.mark.slow


def last_checkpoint(proxy: FleetProxy) -> tuple[str, dict[str, Any]] | None:
    """The newest checkpoint the control plane accepted from the proxied worker."""
    history = accepted_history([proxy])
    return (history[-1][1], history[-1][2]) if history else None


def site_token(serve: Serve, name: str) -> str:
    result = serve.cli("sites", "create", name, "--price-per-hour", "0.1")
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_frozen_worker_loses_its_lease_and_its_late_result(fleet_home: Path) -> None:
    serve = Serve(fleet_home, local_worker=False).start_and_wait()
    workers: list[Worker] = []
    try:
        token_a, token_b = site_token(serve, "site-a"), site_token(serve, "site-b")
        upstream = f"http://127.0.0.1:{serve.port}"
        with fleet_proxy(upstream, free_port()) as proxy, \
                fleet_proxy(upstream, free_port()) as proxy_b:
            worker_a = Worker(fleet_home, proxy.url, "site-a", token_a).start_and_wait()
            workers.append(worker_a)
            pool = concurrent.futures.ThreadPoolExecutor(1)
            # Long enough to be unfinished when A freezes; the reference run repeats it whole.
            answer = pool.submit(
                serve.client(timeout=300).chat.completions.create, model=MODEL,
                messages=[{"role": "user", "content": "Write a long essay on the history of "
                                                      "Rome, with many details."}],
                max_tokens=128, temperature=0, stop=NEVER, logprobs=True, top_logprobs=2)

            def checkpoint_with_tokens() -> tuple[str, dict[str, Any]] | None:
                found = last_checkpoint(proxy)
                return found if found and len(found[1]["choices"][0]["token_ids"]) >= 5 \
                    else None

            wait_until(checkpoint_with_tokens, 120, "a checkpoint from worker A")
            os.kill(worker_a.pid, signal.SIGSTOP)
            proxy.blocked.add("/heartbeat")
            time.sleep(0.5)  # let any heartbeat already in flight land
            found = last_checkpoint(proxy)
            assert found is not None
            request_id, checkpoint = found
            assert not answer.done()

            proxy_b.blocked.add("/complete")
            worker_b = Worker(fleet_home, proxy_b.url, "site-b", token_b).start_and_wait()
            workers.append(worker_b)
            worker_b.wait_for_log(rf"resume from checkpoints \(\d+ tokens\): {request_id}", 60)
            os.kill(worker_a.pid, signal.SIGCONT)

            def rejected_completion() -> dict[str, Any] | None:
                for exchange in proxy.find("/complete"):
                    for rejection in exchange.response.get("rejected", []):
                        if rejection["request_id"] == request_id:
                            return dict(rejection)
                return None

            rejection = wait_until(rejected_completion, 120, "worker A's late completion")
            assert rejection["reason"] == "stale_epoch"
            proxy_b.blocked.clear()
            choice = answer.result(timeout=300).choices[0]
            pool.shutdown()
            text = choice.message.content or ""
            assert text.startswith(checkpoint["choices"][0]["text"])
            assert len(text) > len(checkpoint["choices"][0]["text"])

        for worker in workers:
            worker.stop()  # done; the reference run below gets the CPU
        # The resumed result is what an uninterrupted run gives, as stored and as answered.
        compared = assert_results_match_reference(finished_requests(serve.db_url(),
                                                                    request_ids=[request_id]))
        assert compared.resumed == [request_id]
        reference = compared.reference[request_id][0]
        assert text == reference.text
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert [(t.token, t.logprob) for t in choice.logprobs.content] == \
            [(lp["token"], lp["logprob"]) for lp in reference.logprobs or []]

        listing = serve.cli("sites", "list", "--json")
        sites = {s["name"]: s for s in json.loads(listing.stdout)}
        assert sites["site-a"]["stale_completions"] == 1
        assert sites["site-a"]["wasted_tokens"] > 0
        assert sites["site-b"]["completions"] == 1
    finally:
        for worker in workers:
            worker.signal_group(signal.SIGCONT)
            worker.stop()
        serve.stop()
