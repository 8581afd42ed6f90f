"""Files and Batches through the official openai client: lifecycle, bad lines, cancel, tenants."""

from __future__ import annotations

import io
import json
from typing import Any

import httpx
import openai
import pytest
from api_harness import MODEL, ApiEnv, EchoSite, chat_prompt_tokens, iter_lines, wait_for
from openai import OpenAI

SERVER_SETTINGS = {"max_batch_lines": 1000}


def line(custom_id: str, content: str, **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": MODEL, "max_tokens": 20,
                                "messages": [{"role": "user", "content": content}], **body}})


def upload(client: OpenAI, text: str, name: str = "input.jsonl") -> str:
    return client.files.create(file=(name, io.BytesIO(text.encode())), purpose="batch").id


def validated(client: OpenAI, batch_id: str, timeout_s: float = 60) -> Any:
    """The batch once its input file has been read (it is created `validating`)."""
    return wait_for(lambda: (b := client.batches.retrieve(batch_id)).status != "validating"
                    and b, timeout_s=timeout_s)


def finished(client: OpenAI, batch_id: str, timeout_s: float = 60) -> Any:
    return wait_for(lambda: (b := client.batches.retrieve(batch_id)).status in (
        "completed", "failed", "expired", "cancelled") and b, timeout_s=timeout_s)


def test_files_lifecycle_and_pagination(client: OpenAI) -> None:
    ids = [upload(client, line(f"f{i}", "x"), name=f"in{i}.jsonl") for i in range(3)]
    got = client.files.retrieve(ids[0])
    assert (got.filename, got.purpose, got.bytes) == ("in0.jsonl", "batch",
                                                      len(line("f0", "x").encode()))
    assert client.files.content(ids[1]).text == line("f1", "x")
    listed = [f.id for f in client.files.list(purpose="batch")]
    assert listed[:3] == ids[::-1]  # newest first
    page = client.files.list(limit=2, purpose="batch")
    assert [f.id for f in page.data] == ids[::-1][:2] and page.has_more
    assert client.files.list(limit=2, after=ids[1], purpose="batch").data[0].id == ids[0]
    assert client.files.delete(ids[2]).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(ids[2])
    with pytest.raises(openai.BadRequestError) as bad:
        client.files.create(file=("a.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    assert bad.value.param == "purpose"


def test_files_expire_as_openai_files_do(client: OpenAI, site: EchoSite) -> None:
    hour = client.files.create(file=("h.jsonl", io.BytesIO(line("h", "x").encode())),
                               purpose="batch",
                               expires_after={"anchor": "created_at", "seconds": 3600})
    assert hour.expires_at == hour.created_at + 3600
    assert client.files.retrieve(hour.id).expires_at == hour.expires_at
    default = client.files.retrieve(upload(client, line("d", "x")))
    assert default.expires_at == default.created_at + 30 * 24 * 3600  # the server's default
    for bad, param in (({"anchor": "created_at", "seconds": 60}, "expires_after.seconds"),
                       ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor")):
        with pytest.raises(openai.BadRequestError) as info:
            client.files.create(file=("b.jsonl", io.BytesIO(b"{}")), purpose="batch",
                                expires_after=bad)  # type: ignore[arg-type]
        assert info.value.param == param
    batch = client.batches.create(input_file_id=hour.id, endpoint="/v1/chat/completions",
                                  completion_window="24h",
                                  output_expires_after={"anchor": "created_at", "seconds": 7200})
    done = finished(client, batch.id)
    assert done.output_file_id
    output = client.files.retrieve(done.output_file_id)
    assert output.expires_at == output.created_at + 7200


def test_batch_of_250_lines_with_bad_lines(client: OpenAI, site: EchoSite) -> None:
    good = [line(f"req-{i}", f"item {i}") for i in range(250)]
    bad = ["{not json",
           line("req-3", "duplicate custom_id"),
           line("bad-model", "x", model="gpt-9"),
           line("bad-temp", "x", temperature="hot"),
           json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings",
                       "body": {"model": MODEL}}),
           line("bad-stream", "x", stream=True)]
    text = "\n".join(good[:100] + bad + good[100:]) + "\n"
    batch = client.batches.create(input_file_id=upload(client, text),
                                  endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    batch = validated(client, batch.id)
    assert batch.status in ("in_progress", "finalizing", "completed")
    assert batch.in_progress_at is not None
    assert batch.request_counts is not None and batch.request_counts.total == 256
    done = finished(client, batch.id)
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (250, 6)
    assert done.completed_at is not None and done.finalizing_at is not None
    assert done.output_file_id and done.error_file_id
    out = list(iter_lines(client.files.content(done.output_file_id).text))
    err = list(iter_lines(client.files.content(done.error_file_id).text))
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(250)]
    first = out[0]["response"]
    assert first["status_code"] == 200
    assert first["body"]["choices"][0]["message"]["content"] == "echo item 0"
    # The built-in price (0.10 $/Mtok in, 0.40 out) at the background discount.
    assert first["body"]["usage"]["cost_usd"] == pytest.approx(
        (chat_prompt_tokens("item 0") * 0.10 + 3 * 0.40) / 1e6 * 0.5)
    codes = {e["custom_id"]: e["error"]["code"] for e in err}
    assert codes == {None: "invalid_json", "req-3": "duplicate_custom_id",
                     "bad-model": "model_not_found", "bad-temp": "invalid_request",
                     "bad-url": "invalid_url", "bad-stream": "invalid_request"}
    assert {e["error"]["line"] for e in err} == set(range(101, 107))
    assert done.usage is not None and done.usage.output_tokens == 750
    assert done.usage.model_extra is not None
    prompts = sum(chat_prompt_tokens(f"item {i}") for i in range(250))
    assert done.usage.input_tokens == prompts
    assert done.usage.model_extra["cost_usd"] == pytest.approx(
        (prompts * 0.10 + 750 * 0.40) / 1e6 * 0.5)


def test_unusable_files_fail_at_validation(client: OpenAI) -> None:
    cases = {"not jsonl\nat all\n": "invalid_file", "\n\n": "empty_file",
             "\n".join(line(f"c{i}", "x") for i in range(1001)): "too_many_lines"}
    for text, code in cases.items():
        batch = validated(client, client.batches.create(
            input_file_id=upload(client, text), endpoint="/v1/chat/completions",
            completion_window="24h").id)
        assert batch.status == "failed" and batch.errors is not None and batch.errors.data
        assert batch.request_counts is not None and batch.request_counts.total == 0
        assert batch.errors.data[0].code == code
    not_utf8 = validated(client, client.batches.create(
        input_file_id=client.files.create(
            file=("b.jsonl", io.BytesIO(b'{"a": 1}\n\xff\xfe\n')), purpose="batch").id,
        endpoint="/v1/chat/completions", completion_window="24h").id)
    assert not_utf8.errors is not None and not_utf8.errors.data
    assert not_utf8.errors.data[0].line == 2


def test_batch_create_rejects_bad_arguments(client: OpenAI) -> None:
    file_id = upload(client, line("a", "b"))
    with pytest.raises(openai.BadRequestError) as window:
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                              completion_window="1h")  # type: ignore[arg-type]
    assert window.value.param == "completion_window"
    with pytest.raises(openai.BadRequestError) as endpoint:
        client.batches.create(input_file_id=file_id, endpoint="/v1/moderations",
                              completion_window="24h")
    assert endpoint.value.param == "endpoint"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                              completion_window="24h")
    longer = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                   completion_window="48h")  # type: ignore[arg-type]
    assert longer.expires_at - longer.created_at == 48 * 3600  # type: ignore[operator]
    client.batches.cancel(longer.id)  # leave no queued work to later tests


def test_list_batches_paginates_newest_first(client: OpenAI) -> None:
    file_id = upload(client, line("a", "b"))
    made = [client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h").id for _ in range(3)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1][:2] and page.has_more
    nxt = client.batches.list(limit=2, after=made[1])
    assert nxt.data[0].id == made[0]
    for batch_id in made:
        client.batches.cancel(batch_id)


def test_cancel_mid_batch_keeps_finished_results(env: ApiEnv, client: OpenAI) -> None:
    text = "\n".join(line(f"c{i}", f"n {i}") for i in range(30))
    batch = client.batches.create(input_file_id=upload(client, text),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    with EchoSite(env.base_url, env.site_token, max_leases=10) as echo:
        wait_for(lambda: len(echo.completed) == 10)
    fleet = httpx.Client(base_url=env.base_url + "/v1/fleet", timeout=30,
                         headers={"Authorization": f"Bearer {env.site_token}"})
    held = fleet.post("/lease", json={"capacity": 5, "models": [MODEL]}).json()["leases"]
    assert len(held) == 5
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    beat = fleet.post("/heartbeat", json={"leases": [
        {"request_id": h["request_id"], "epoch": h["epoch"]} for h in held]}).json()
    assert sorted(beat["revoked"]) == sorted(h["request_id"] for h in held)
    late = fleet.post("/complete", json={"results": [
        {"request_id": held[0]["request_id"], "epoch": held[0]["epoch"],
         "outcome": "succeeded", "choices": [{"index": 0, "text": "late"}]}]}).json()
    assert late["rejected"][0]["reason"] == "already_completed"
    fleet.close()
    done = finished(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    assert done.output_file_id and done.error_file_id
    out = list(iter_lines(client.files.content(done.output_file_id).text))
    err = list(iter_lines(client.files.content(done.error_file_id).text))
    assert len(out) == 10 and len(err) == 20
    assert {e["error"]["code"] for e in err} == {"batch_cancelled"}
    assert sorted(o["custom_id"] for o in out + err) == sorted(f"c{i}" for i in range(30))
    assert client.batches.cancel(batch.id).status == "cancelled"  # idempotent


def test_tenants_never_see_each_other(env: ApiEnv, client: OpenAI, site: EchoSite) -> None:
    file_id = upload(client, line("t1", "secret words"))
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = finished(client, batch.id)
    assert done.output_file_id
    with OpenAI(base_url=env.v1, api_key=env.new_key("tenant-b"), max_retries=0) as other:
        for call in (lambda: other.files.retrieve(file_id),
                     lambda: other.files.content(file_id),
                     lambda: other.files.content(done.output_file_id or ""),
                     lambda: other.files.delete(file_id),
                     lambda: other.batches.retrieve(batch.id),
                     lambda: other.batches.cancel(batch.id),
                     lambda: other.batches.create(input_file_id=file_id, completion_window="24h",
                                                  endpoint="/v1/chat/completions")):
            with pytest.raises(openai.NotFoundError):
                call()
        assert other.files.list().data == [] and other.batches.list().data == []
    assert client.files.retrieve(file_id).id == file_id
