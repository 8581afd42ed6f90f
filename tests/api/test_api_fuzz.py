"""Property-based fuzzing of every operation in the generated OpenAPI schema (schemathesis).

Valid and invalid requests alike must never get a 5xx, and every response must match the
schema (status codes, content types, bodies). Whether each invalid request is refused is not
checked here (the auth header is always replaced by a valid one, and objects in query strings
cannot be sent faithfully): test_api_errors.py covers refusals. A protocol site answers
realtime calls, so chat and completions requests run end to end. Bounded: a few examples per
operation and mode.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from api_harness import MODEL, ApiEnv, EchoSite
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.slow

SERVER_SETTINGS = {"max_file_bytes": 20_000, "realtime_timeout_s": 20.0}
# Deterministic and small by default; MINIMILL_FUZZ_EXAMPLES=500 MINIMILL_FUZZ_RANDOM=1 for a
# longer, randomized hunt.
EXAMPLES_PER_MODE = int(os.environ.get("MINIMILL_FUZZ_EXAMPLES", "12"))
# The generated requests exercise validation and routing, which both backends share; the
# PostgreSQL run takes a third of them so the suite stays short (set the variable to override).
EXAMPLES_FOR_BACKEND = {"postgres": int(os.environ.get("MINIMILL_FUZZ_EXAMPLES", "4"))}
DERANDOMIZE = not os.environ.get("MINIMILL_FUZZ_RANDOM")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def echo_site(env: ApiEnv) -> Iterator[EchoSite]:
    with EchoSite(env.base_url, env.site_token, token_delay_s=0.0) as s:
        yield s


def _served_model(case: Any, use_served: bool) -> Any:
    # Random model names only ever reach the 404 path; half the cases name the served model.
    if use_served and isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL
    return case


# One known-valid body per generation endpoint, checked like the generated ones: generated
# "valid" bodies satisfy the schema but may still break rules it cannot state (a user message
# needs content, an integer may not be written 3.0), so whether any of them gets through is
# luck; these always do, end to end through the site.
VALID_BODIES = {
    "/v1/chat/completions": {"model": MODEL, "max_tokens": 8, "logit_bias": {"5": 1.5},
                             "messages": [{"role": "user", "content": "Say hi."}]},
    "/v1/completions": {"model": MODEL, "prompt": "Once upon", "max_tokens": 4,
                        "frequency_penalty": 0.5},
    "/v1/responses": {"model": MODEL, "input": [{"role": "user", "content": "Say hi."}],
                      "instructions": "Be brief.", "max_output_tokens": 8},
    "/v1/embeddings": {"model": MODEL, "input": ["Say hi.", "Say bye."],
                       "encoding_format": "base64"},
}


def _fuzz(env: ApiEnv, operation: Any, mode: GenerationMode) -> None:
    token = env.site_token if operation.path.startswith("/v1/fleet") else env.key
    headers = {"Authorization": f"Bearer {token}"}
    valid = VALID_BODIES.get(operation.path)
    if mode.is_positive and valid is not None and operation.method.upper() == "POST":
        response = operation.Case(body=dict(valid), media_type="application/json") \
            .call_and_validate(base_url=env.base_url, headers=headers, checks=CHECKS,
                               timeout=60)
        assert response.status_code == 200, response.text
    strategy = operation.as_strategy(generation_mode=mode)
    if mode.is_positive:
        strategy = st.tuples(strategy, st.booleans()).map(lambda t: _served_model(*t))

    examples = EXAMPLES_FOR_BACKEND.get(env.backend, EXAMPLES_PER_MODE)

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), derandomize=DERANDOMIZE)
    @given(case=strategy)
    def run(case: Any) -> None:
        case.call_and_validate(base_url=env.base_url, headers=headers, checks=CHECKS,
                               timeout=60)

    run()


def test_fuzz_openapi_schema(env: ApiEnv, echo_site: EchoSite) -> None:
    # The first /openapi.json builds the schema (seconds on a busy machine).
    document = httpx.get(env.base_url + "/openapi.json", timeout=120).raise_for_status().json()
    schema = schemathesis.openapi.from_dict(document)
    results = list(schema.get_all_operations())
    operations = [r.ok() for r in results if isinstance(r, Ok)]
    assert len(operations) == len(results), "the generated schema has invalid operations"
    assert len(operations) >= 15
    started = time.monotonic()
    failures = []
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                _fuzz(env, operation, mode)
            except Exception as exc:  # collect every operation's findings, then fail once
                failures.append(f"{operation.method.upper()} {operation.path} [{mode}]: {exc}")
    assert not failures, "\n\n".join(failures)
    # Valid chat and completions calls ran end to end through the site.
    assert echo_site.completed
    assert time.monotonic() - started < 240 or EXAMPLES_PER_MODE > 12
