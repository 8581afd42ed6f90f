"""`minimill worker --price-per-hour --chip`: what a real worker declares reaches the site
registry (GET /v1/sites) with its first lease call."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_process import Serve, Worker

pytestmark = pytest.mark.slow


def listed_site(serve: Serve, operator_key: str, name: str) -> dict[str, Any]:
    answer = httpx.get(serve.base_url + "/sites",
                       headers={"Authorization": f"Bearer {operator_key}"}, timeout=10)
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] = {s["name"]: s for s in answer.json()["data"]}[name]
    return found


def test_worker_declares_its_price_and_chip(fleet_home: Path) -> None:
    serve = Serve(fleet_home, local_worker=False).start_and_wait()
    worker: Worker | None = None
    try:
        created = serve.cli("sites", "create", "declared", "--price-per-hour", "0.1",
                            "--chip", "cpu")
        assert created.returncode == 0, created.stderr
        token = created.stdout.strip().splitlines()[-1]
        operator = serve.cli("keys", "create", "--operator")
        assert operator.returncode == 0, operator.stderr
        operator_key = operator.stdout.strip().splitlines()[-1]
        assert (listed_site(serve, operator_key, "declared")["price_per_hour"],
                listed_site(serve, operator_key, "declared")["chip"]) == (0.1, "cpu")
        worker = Worker(fleet_home, f"http://127.0.0.1:{serve.port}", "declared", token,
                        extra_args=("--price-per-hour", "0.37", "--chip", "testchip"))
        worker.start_and_wait()
        # A starting worker first gives back what an earlier run of the site held (a release
        # call: the site is seen, with what it registered); its first lease call follows.
        deadline = time.time() + 10
        while (mine := listed_site(serve, operator_key, "declared"))["chip"] != "testchip":
            assert time.time() < deadline, (mine, worker.log_text()[-2000:])
            time.sleep(0.1)
        assert mine["status"] != "new"
        assert (mine["price_per_hour"], mine["chip"]) == (0.37, "testchip")
    finally:
        if worker is not None:
            worker.stop()
        serve.stop()
