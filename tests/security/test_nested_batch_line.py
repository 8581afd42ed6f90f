"""Attack: stall everyone's batches with lines the ingester cannot parse.

A line nested 1,000 deep makes the JSON decoder raise RecursionError (not ValueError); it used
to escape the line's parse and abort the ingest round, again at every retry, and batches are
claimed oldest first. Here one tenant submits five such batches (each also carrying absurd
sizes) ahead of another tenant's batch: every nested or absurd line becomes that line's error,
the good lines beside them are served, and the other tenant's batch finishes."""

from __future__ import annotations

import io
import json
from typing import Any

from api_harness import MODEL, ApiEnv, EchoSite, iter_lines, wait_for
from openai import OpenAI

from minimill.control.batch_ingest import Line, LineParser


def line(custom_id: str, **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": MODEL, "max_tokens": 8,
                                "messages": [{"role": "user", "content": custom_id}], **body}})


def nested(custom_id: str, depth: int) -> str:
    return line(custom_id).replace('"max_tokens": 8', '"max_tokens": ' + "[" * depth + "]" * depth)


HOSTILE = {
    "deep": nested("deep", 1000),
    "deeper": nested("deeper", 20_000),
    "huge-n": line("huge-n", n=10**12),
    "huge-int": line("huge-int").replace('"max_tokens": 8', '"max_tokens": 1' + "0" * 5000),
    "huge-float": line("huge-float", temperature=1e308),
    "bias": line("bias", logit_bias={str(i): 1 for i in range(5000)}),
}


def batch(client: OpenAI, lines: list[str]) -> str:
    file_id = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())),
                                  purpose="batch").id
    return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


def test_every_hostile_line_is_its_own_error() -> None:
    parser = LineParser("/v1/chat/completions", (MODEL,))
    for custom_id, text in HOSTILE.items():
        parsed = parser.parse(Line(1, len(text), text.encode()), 2**30)
        assert parsed is not None and parsed.prepared is None, custom_id
        assert parsed.error is not None and parsed.error.message, custom_id


def test_nested_lines_beside_another_tenants_batch(env: ApiEnv) -> None:
    with OpenAI(base_url=env.v1, api_key=env.new_key("attacker"), max_retries=0) as attacker, \
            OpenAI(base_url=env.v1, api_key=env.new_key("neighbour"),
                   max_retries=0) as neighbour, EchoSite(env.base_url, env.site_token):
        hostile = [batch(attacker, [*HOSTILE.values(), line(f"good-{i}")]) for i in range(5)]
        honest = batch(neighbour, [line(f"n{i}") for i in range(3)])
        done = wait_for(lambda: (b := neighbour.batches.retrieve(honest)).status
                        in ("completed", "failed") and b, timeout_s=120)
        assert done.status == "completed" and done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (3, 0)
        for batch_id in hostile:
            ended = wait_for(lambda b=batch_id: (r := attacker.batches.retrieve(b)).status
                             in ("completed", "failed") and r, timeout_s=120)
            assert ended.status == "completed", ended.errors
            assert ended.request_counts is not None
            assert (ended.request_counts.completed, ended.request_counts.failed) == (
                1, len(HOSTILE))
            errors = list(iter_lines(attacker.files.content(ended.error_file_id).text))
            assert len(errors) == len(HOSTILE)
            # Lines that never ran: each says why, on its own line number.
            assert all(e["response"] is None and e["error"]["message"] for e in errors)
            assert sorted(e["error"]["line"] for e in errors) == list(range(1, len(HOSTILE) + 1))
            codes = {e["custom_id"]: e["error"]["code"] for e in errors}
            assert codes[None] == "invalid_json" and codes["huge-n"] == "invalid_request"
