"""Price and cost over HTTP (SQLite and PostgreSQL): an operator sets the price list through the
API; every usage a tenant sees (answers, the final stream chunk, batch output lines and totals)
follows it, whatever the serving site declares; operators see the site's measured throughput,
cost and margin, and tenants see none of it."""

from __future__ import annotations

import io
import json
import uuid
from typing import Any

import httpx
import pytest
from api_harness import MODEL, ApiEnv, EchoSite, chat_prompt_tokens, iter_lines, wait_for
from openai import OpenAI

from minimill.control.sites import create_site

# The price list of this module, $ per million tokens.
INPUT, OUTPUT = 2.0, 8.0
# EchoSite answers "echo <words>" (one token a word); the prompt is billed as the control plane
# counts it, whatever the site reports (5).


def bill(content: str, completion_tokens: int, factor: float = 1.0, input_: float = INPUT,
         output: float = OUTPUT) -> float:
    return (chat_prompt_tokens(content) * input_ + completion_tokens * output) / 1e6 * factor


def as_operator(env: ApiEnv) -> httpx.Client:
    return httpx.Client(base_url=env.v1, timeout=30,
                        headers={"Authorization": f"Bearer {env.operator_key}"})


def chat(client: OpenAI, content: str, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **extra)


def usage_cost(usage: Any) -> float:
    assert usage is not None and usage.model_extra is not None
    cost: float = usage.model_extra["cost_usd"]
    return cost


def run_batch(client: OpenAI, contents: list[str]) -> tuple[Any, list[dict[str, Any]]]:
    text = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST",
                                 "url": "/v1/chat/completions",
                                 "body": {"model": MODEL,
                                          "messages": [{"role": "user", "content": c}]}})
                     for i, c in enumerate(contents))
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(text.encode())),
                                  purpose="batch").id
    batch_id = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                     completion_window="24h").id
    done = wait_for(lambda: (b := client.batches.retrieve(batch_id)).status == "completed"
                    and b, timeout_s=60)
    return done, list(iter_lines(client.files.content(done.output_file_id).text))


def test_usage_follows_the_price_list_whatever_the_site_declares(
        env: ApiEnv, client: OpenAI) -> None:
    liar_name = f"liar-{uuid.uuid4().hex[:6]}"
    liar_token = create_site(env.store, liar_name, 0.10, "cpu")
    with as_operator(env) as operator:
        made = operator.post("/prices", json={"model": MODEL, "input_usd_per_mtok": INPUT,
                                              "output_usd_per_mtok": OUTPUT})
        assert made.status_code == 200, made.text
        assert made.json()["entry"] == MODEL and not made.json()["discounted"]
        table = {(p["model"], p["tier"]): p for p in operator.get("/prices").json()["data"]}
        assert table[(MODEL, "background")]["discounted"]
        assert table[(MODEL, "background")]["output_usd_per_mtok"] == pytest.approx(OUTPUT / 2)
        with EchoSite(env.base_url, liar_token, tokens_per_s=1e9, price_per_hour=1e6,
                      serve_delay_s=0.5) as liar:
            realtime = chat(client, "one two three")  # "echo one two three": 4 tokens
            assert usage_cost(realtime.usage) == pytest.approx(bill("one two three", 4))
            flex = chat(client, "one two three", service_tier="flex")
            assert usage_cost(flex.usage) == pytest.approx(bill("one two three", 4, 0.5))
            chunks = list(chat(client, "a b", stream=True,
                               stream_options={"include_usage": True}))
            assert usage_cost(chunks[-1].usage) == pytest.approx(bill("a b", 3))
            done, lines = run_batch(client, ["x", "x y"])
            assert [usage_cost_of(line) for line in lines] == pytest.approx(
                [bill("x", 2, 0.5), bill("x y", 3, 0.5)])
            assert done.usage.model_extra["cost_usd"] == pytest.approx(
                bill("x", 2, 0.5) + bill("x y", 3, 0.5))
            # An explicit background price replaces the discount.
            operator.post("/prices", json={"model": MODEL, "tier": "background",
                                           "input_usd_per_mtok": 0.5,
                                           "output_usd_per_mtok": 1.0}).raise_for_status()
            flex = chat(client, "one two three", service_tier="flex")
            assert usage_cost(flex.usage) == pytest.approx(bill("one two three", 4, 1.0, 0.5, 1.0))
            gone = operator.request("DELETE", "/prices", params={"model": MODEL,
                                                                 "tier": "background"})
            assert gone.status_code == 200 and gone.json()["deleted"]
        assert all(r["reason"] != "stale_epoch" for r in liar.rejected)
        sites = {s["name"]: s for s in operator.get("/sites").json()["data"]}
        # Reset the list for the other tests of the module.
        operator.request("DELETE", "/prices", params={"model": MODEL}).raise_for_status()
    seen = sites[liar_name]
    assert (seen["tokens_per_s"], seen["price_per_hour"]) == (1e9, 1e6)
    # It held each of its 5 non-stream leases at least 0.5 s: what it delivered over the time
    # it held work is a few tokens per second, nothing like what it said.
    assert seen["completions"] == 6 and seen["tokens_generated"] == 20
    assert seen["busy_s"] >= 5 * 0.5 * 0.99
    measured = seen["measured_tokens_per_s"]
    assert measured == pytest.approx(20 / seen["busy_s"], rel=1e-2)
    assert 0 < measured <= 20 / (5 * 0.5 * 0.99), seen
    assert seen["cost_usd"] == pytest.approx(1e6 * seen["busy_s"] / 3600, rel=1e-6)
    assert seen["billed_usd"] == pytest.approx(
        bill("one two three", 4) + bill("one two three", 4, 0.5) + bill("a b", 3)
        + bill("x", 2, 0.5) + bill("x y", 3, 0.5) + bill("one two three", 4, 1.0, 0.5, 1.0))
    assert seen["margin_usd"] == pytest.approx(seen["billed_usd"] - seen["cost_usd"])


def usage_cost_of(line: dict[str, Any]) -> float:
    cost: float = line["response"]["body"]["usage"]["cost_usd"]
    return cost


def test_price_entries_are_checked_over_the_api(env: ApiEnv) -> None:
    with as_operator(env) as operator:
        for body, param in (({"model": MODEL, "input_usd_per_mtok": -1,
                              "output_usd_per_mtok": 1}, "input_usd_per_mtok"),
                            ({"model": MODEL, "tier": "spot", "input_usd_per_mtok": 1,
                              "output_usd_per_mtok": 1}, "tier"),
                            ({"model": "", "input_usd_per_mtok": 1,
                              "output_usd_per_mtok": 1}, "model"),
                            ({"model": MODEL, "input_usd_per_mtok": 1}, "output_usd_per_mtok"),
                            ({"model": MODEL, "input_usd_per_mtok": 2e6,
                              "output_usd_per_mtok": 1}, "input_usd_per_mtok")):
            answer = operator.post("/prices", json=body)
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["param"] == param
        # Infinity is not JSON, and a non-finite price is refused wherever it comes from.
        inf = operator.post("/prices", content=b'{"model": "m", "input_usd_per_mtok": '
                            b'Infinity, "output_usd_per_mtok": 1}',
                            headers={"Content-Type": "application/json"})
        assert inf.status_code == 400
        missing = operator.request("DELETE", "/prices", params={"model": "never-priced"})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_operators_make_keys_over_the_api(env: ApiEnv) -> None:
    with as_operator(env) as operator:
        tenant_key = operator.post("/keys", json={"tenant": "made-by-api"}).json()
        operator_key = operator.post("/keys", json={"operator": True}).json()
        both = operator.post("/keys", json={"tenant": "x", "operator": True})
    assert (tenant_key["tenant"], tenant_key["operator"]) == ("made-by-api", False)
    assert operator_key["operator"] and operator_key["key"].startswith("mmo-")
    assert both.status_code == 400
    as_tenant = {"Authorization": f"Bearer {tenant_key['key']}"}
    assert httpx.get(env.v1 + "/models", headers=as_tenant).status_code == 200
    assert httpx.get(env.v1 + "/sites", headers=as_tenant).status_code == 404
    fresh = {"Authorization": f"Bearer {operator_key['key']}"}
    assert httpx.get(env.v1 + "/sites", headers=fresh).status_code == 200
    assert httpx.get(env.v1 + "/models", headers=fresh).status_code == 403


def test_operators_announce_outages_of_any_site(env: ApiEnv) -> None:
    name = f"dark-{uuid.uuid4().hex[:6]}"
    create_site(env.store, name, 0.1, "cpu")
    with as_operator(env) as operator:
        made = operator.post(f"/sites/{name}/outages", json={"start_at": 2e9,
                                                             "end_at": 2e9 + 60})
        assert made.status_code == 200 and made.json()["site"] == name
        unknown = operator.post("/sites/nowhere/outages", json={"start_at": 2e9,
                                                                "end_at": 2e9 + 60})
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "site"
        listed = {s["name"]: s for s in operator.get("/sites").json()["data"]}
    assert listed[name]["outages"] == [{"start_at": 2e9, "end_at": 2e9 + 60}]
    as_tenant = httpx.post(env.v1 + f"/sites/{name}/outages",
                           json={"start_at": 2e9, "end_at": 2e9 + 60},
                           headers={"Authorization": f"Bearer {env.key}"})
    assert as_tenant.status_code == 404
