"""Attack: learn what another tenant sent by timing or counting the prefix cache. Tenant B
sends a prompt it suspects tenant A sent; with a cache shared across tenants the answer's
`cached_tokens` (or its speed) would tell. Through a real `serve` (control plane, local worker,
the real model) and the official openai client: across tenants nothing is cached, within a
tenant the prefix is reused, and between two tenants that the operator let share
(`minimill tenants set NAME --share-prefix-cache`) it is reused too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_process import MODEL, Serve, make_home

SECRET = ("Merger memo, strictly confidential: Quillfeather Ltd acquires Brambleworth for "
          "four hundred million, announced on the first Monday of spring. " * 12).strip()


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory, model_file: Path) -> Iterator[Serve]:
    proc = Serve(make_home(tmp_path_factory.mktemp("probe"), model_file.parent.parent))
    try:
        yield proc.start_and_wait()
    finally:
        proc.stop()


def key_of(serve: Serve, tenant: str) -> str:
    done = serve.cli("keys", "create", "--tenant", tenant, "--db", serve.db_url())
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def cached(serve: Serve, key: str, system: str, question: str) -> int:
    answer: Any = serve.client(key).chat.completions.create(
        model=MODEL, temperature=0, max_tokens=2,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
    assert answer.usage.prompt_tokens > 200
    return int(answer.usage.prompt_tokens_details.cached_tokens)


def test_another_tenants_prompt_is_not_cached_for_the_prober(serve: Serve) -> None:
    victim, prober = key_of(serve, "victim"), key_of(serve, "prober")
    assert cached(serve, victim, SECRET, "Summarize.") == 0
    # The prober guesses the victim's prompt exactly: nothing of it is cached for it.
    assert cached(serve, prober, SECRET, "Summarize.") == 0
    assert cached(serve, prober, SECRET, "Summarize it.") > 0  # its own probe is, now
    # The victim's own next request does reuse its prefix.
    assert cached(serve, victim, SECRET, "Who acquires whom?") > 200


def test_tenants_that_opt_in_share_their_prefixes(serve: Serve) -> None:
    left, right, outsider = (key_of(serve, t) for t in ("team-left", "team-right", "outsider"))
    for tenant in ("team-left", "team-right"):
        done = serve.cli("tenants", "set", tenant, "--share-prefix-cache", "--db",
                         serve.db_url())
        assert done.returncode == 0, done.stderr
    handbook = SECRET.replace("Merger memo", "Shared handbook")
    assert cached(serve, left, handbook, "Summarize.") == 0
    assert cached(serve, right, handbook, "Summarize.") > 200
    assert cached(serve, outsider, handbook, "Summarize.") == 0
