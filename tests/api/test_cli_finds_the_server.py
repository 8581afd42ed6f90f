"""One way to find the server, as a user meets it: client commands read MINIMILL_BASE_URL and
MINIMILL_API_KEY, else OPENAI_BASE_URL and OPENAI_API_KEY (what `serve` prints); operator
commands ask the running server with an operator key and say so, and a command that reads
never leaves an empty store behind; errors are one line naming the request."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from api_harness import ApiEnv
from openai import OpenAI

from minimill.control.sites import create_site

pytestmark = pytest.mark.parametrize("env", ["sqlite"], indirect=True)
CLIENT_VARS = ("MINIMILL_BASE_URL", "MINIMILL_API_KEY", "OPENAI_BASE_URL", "OPENAI_API_KEY",
               "MINIMILL_OPERATOR_KEY")


def minimill(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`minimill ARGS` in a shell that has only `env` of the client variables, and an empty
    MINIMILL_HOME."""
    clean = {k: v for k, v in os.environ.items() if k not in CLIENT_VARS}
    return subprocess.run([sys.executable, "-m", "minimill.cli", *args], capture_output=True,
                          text=True, timeout=120,
                          env={**clean, "MINIMILL_HOME": str(home), "COLUMNS": "200", **env})


def test_batch_status_with_only_openai_variables(env: ApiEnv, tmp_path: Path) -> None:
    with OpenAI(base_url=env.v1, api_key=env.key, max_retries=0) as client:
        line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "smollm2-135m", "max_tokens": 4,
                         "messages": [{"role": "user", "content": "hi"}]}}
        file_id = client.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())),
                                      purpose="batch").id
        batch_id = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id
    shown = minimill(tmp_path, "batch", "status", batch_id,
                     OPENAI_BASE_URL=env.v1, OPENAI_API_KEY=env.key)
    assert shown.returncode == 0, shown.stderr
    assert batch_id in shown.stdout and f"input_file_id: {file_id}" in shown.stdout
    # MINIMILL_* wins over OPENAI_* when both are set.
    both = minimill(tmp_path, "batch", "status", batch_id, MINIMILL_BASE_URL=env.v1,
                    MINIMILL_API_KEY=env.key, OPENAI_BASE_URL="http://127.0.0.1:9/v1",
                    OPENAI_API_KEY="wrong")
    assert both.returncode == 0, both.stderr
    # An error is one line that names the request.
    missing = minimill(tmp_path, "box", "exec", "box_nope", "true",
                       OPENAI_BASE_URL=env.v1, OPENAI_API_KEY=env.key)
    assert missing.returncode == 1
    [error] = missing.stderr.splitlines()
    assert error.startswith("error: No such box: box_nope (HTTP 404, box_not_found, request "
                            "req_"), error
    assert not (tmp_path / "data").exists()


def test_sites_list_against_a_server(env: ApiEnv, tmp_path: Path) -> None:
    create_site(env.store, "mill-over-http", 0.05, "cpu")
    shown = minimill(tmp_path, "sites", "list", "--operator-key", env.operator_key,
                     MINIMILL_BASE_URL=env.v1)
    assert shown.returncode == 0, shown.stderr
    assert "mill-over-http" in shown.stdout
    assert shown.stderr.strip() == f"server: {env.base_url}"
    listed = minimill(tmp_path, "sites", "list", "--json", OPENAI_BASE_URL=env.v1,
                      MINIMILL_OPERATOR_KEY=env.operator_key)
    assert "mill-over-http" in [s["name"] for s in json.loads(listed.stdout)]
    prices = minimill(tmp_path, "prices", "list", "--operator-key", env.operator_key,
                      MINIMILL_BASE_URL=env.v1)
    assert prices.returncode == 0 and "smollm2-135m" in prices.stdout, prices.stderr
    # A tenant's key is no operator key: refused in one line.
    refused = minimill(tmp_path, "sites", "list", "--operator-key", env.key,
                       MINIMILL_BASE_URL=env.v1)
    assert refused.returncode == 1 and "operator key" in refused.stderr
    # Without an operator key it reads the store, and an empty MINIMILL_HOME has none: it
    # says so rather than printing an empty table from a store it just created.
    for args in (("sites", "list"), ("sites", "outage", "list"), ("prices", "list"),
                 ("keys", "list")):
        local = minimill(tmp_path, *args)
        assert local.returncode == 1 and "error: no store at" in local.stderr, local
    assert not (tmp_path / "data" / "minimill.db").exists()
