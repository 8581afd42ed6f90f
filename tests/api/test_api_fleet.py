"""The fleet protocol over HTTP: site auth, fencing, expiry with checkpoints, realtime first."""

from __future__ import annotations

import io
import json
import threading
import time
import uuid
from typing import Any

import httpx
from api_harness import MODEL, ApiEnv, wait_for
from openai import OpenAI

from minimill.control.records import SiteScope
from minimill.control.site_view import list_sites
from minimill.control.sites import create_site

# Short enough for a test to wait a lease out, long enough that a server call stalled on a
# loaded 2-core machine does not outlast it: at 1 s, one lease transaction of 1.3 s (CI, two
# test workers beside it) answered a lease already expired, and the tests sharing the store
# after it found its request queued.
LEASE_TTL_S = 3.0
SERVER_SETTINGS = {"lease_ttl_s": LEASE_TTL_S, "janitor_interval_s": 0.1}


def fleet(env: ApiEnv, token: str | None = None) -> httpx.Client:
    return httpx.Client(base_url=env.base_url + "/v1/fleet", timeout=30,
                        headers={"Authorization": f"Bearer {token or env.site_token}"})


def new_site(env: ApiEnv) -> tuple[str, str]:
    name = f"site-{uuid.uuid4().hex[:6]}"
    return name, create_site(env.store, name, 0.72, "cpu")


def one_line_batch(client: OpenAI, content: str) -> str:
    text = json.dumps({"custom_id": "only", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": MODEL, "messages": [{"role": "user",
                                                              "content": content}]}})
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(text.encode())),
                                  purpose="batch").id
    return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


def lease_one(client: httpx.Client) -> dict[str, Any]:
    leases = wait_for(lambda: client.post("/lease", json={"capacity": 1, "models": [MODEL]})
                      .json()["leases"], timeout_s=10)
    lease: dict[str, Any] = leases[0]
    return lease


def done(request_id: str, epoch: int, text: str) -> dict[str, Any]:
    return {"results": [{"request_id": request_id, "epoch": epoch, "outcome": "succeeded",
                         "choices": [{"index": 0, "text": text, "token_ids": [1, 2],
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 2}}]}


def test_fleet_routes_need_a_site_token(env: ApiEnv) -> None:
    body = {"capacity": 1, "models": [MODEL]}
    assert httpx.post(env.base_url + "/v1/fleet/lease", json=body).status_code == 401
    with fleet(env, env.key) as tenant_key:
        answer = tenant_key.post("/lease", json=body)
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_site_token"
    models = httpx.get(env.v1 + "/models", headers={"Authorization": f"Bearer {env.site_token}"})
    assert models.status_code == 401
    with fleet(env) as ok:
        bad = ok.post("/lease", json={"capacity": -1, "models": [MODEL]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "capacity"


def test_a_replaced_token_or_withdrawn_scope_refuses_the_very_next_call(env: ApiEnv) -> None:
    """Fleet routes check the site token on each call's own store thread, with nothing cached:
    `sites create --replace` (any process, here straight on the store) takes effect at once."""
    name, old_token = new_site(env)
    with fleet(env, old_token) as old:
        assert old.post("/heartbeat", json={"leases": []}).status_code == 200
        assert old.post("/complete", json={"results": []}).status_code == 200
        new_token = create_site(env.store, name, 0.72, "cpu", replace=True)
        # A malformed body too: the token is refused before a word about the body.
        for path, body in (("/heartbeat", {"leases": []}), ("/complete", {"results": []}),
                           ("/complete", {}), ("/release", {"leases": []}),
                           ("/lease", {"capacity": 1, "models": [MODEL]})):
            answer = old.post(path, json=body)
            assert answer.status_code == 401, path
            assert answer.json()["error"]["code"] == "invalid_site_token", path
    with fleet(env, new_token) as new:
        assert new.post("/heartbeat", json={"leases": []}).status_code == 200
    boxes_only = create_site(env.store, name, 0.72, "cpu", replace=True,
                             serves=frozenset({SiteScope.BOXES}))
    with fleet(env, boxes_only) as narrowed:
        for path, body in (("/heartbeat", {"leases": []}), ("/complete", {"results": []}),
                           ("/complete", {}), ("/release", {"leases": []}),
                           ("/lease", {"capacity": 1, "models": [MODEL]})):
            refused = narrowed.post(path, json=body)
            assert refused.status_code == 403, path
            assert refused.json()["error"]["code"] == "site_scope", path


def test_a_bad_declared_price_or_chip_is_refused(env: ApiEnv) -> None:
    with fleet(env) as site:
        for field, value in (("price_per_hour", -1.0), ("chip", "x" * 101), ("chip", " ")):
            bad = site.post("/lease", json={"capacity": 0, "models": [MODEL], field: value})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == field


def test_expired_lease_requeues_with_checkpoint_and_fences_the_zombie(
        env: ApiEnv, client: OpenAI) -> None:
    batch_id = one_line_batch(client, "fenced request")
    zombie_name, zombie_token = new_site(env)
    _, fresh_token = new_site(env)
    with fleet(env, zombie_token) as zombie, fleet(env, fresh_token) as fresh:
        first = lease_one(zombie)
        checkpoint = {"choices": [{"index": 0, "token_ids": [11], "text": "echo"}],
                      "num_prompt_tokens": 3}
        beat = zombie.post("/heartbeat", json={"leases": [
            {"request_id": first["request_id"], "epoch": first["epoch"],
             "checkpoint": checkpoint}]}).json()
        assert first["request_id"] in beat["extended"]
        # The zombie goes silent past the lease TTL; the janitor requeues the request.
        second = lease_one(fresh)
        assert second["request_id"] == first["request_id"]
        assert second["epoch"] == first["epoch"] + 1
        assert second["checkpoint"]["choices"][0]["token_ids"] == [11]
        assert second["checkpoint"]["choices"][0]["text"] == "echo"
        late_beat = zombie.post("/heartbeat", json={"leases": [
            {"request_id": first["request_id"], "epoch": first["epoch"]}]}).json()
        assert late_beat == {"extended": {}, "revoked": [first["request_id"]], "resync": [],
                             "handback": []}
        stale = zombie.post("/complete", json=done(first["request_id"], first["epoch"],
                                                   "zombie")).json()
        assert stale["rejected"] == [{"request_id": first["request_id"],
                                      "reason": "stale_epoch"}]
        ok = fresh.post("/complete", json=done(second["request_id"], second["epoch"],
                                               "echo fresh")).json()
        assert ok["accepted"] == [second["request_id"]]
        # A resend after a lost answer is answered as the first time; the first result stays.
        again = fresh.post("/complete", json=done(second["request_id"], second["epoch"],
                                                  "twice")).json()
        assert again == {"accepted": [second["request_id"]], "rejected": []}
        unknown = fresh.post("/complete", json=done("req_nope", 1, "x")).json()
        assert unknown["rejected"][0]["reason"] == "unknown_request"
    batch = wait_for(lambda: (b := client.batches.retrieve(batch_id)).status == "completed"
                     and b)
    output = client.files.content(batch.output_file_id).text
    assert json.loads(output)["response"]["body"]["choices"][0]["message"]["content"] == \
        "echo fresh"
    stats = {s.name: s for s in list_sites(env.store, time.time())}
    assert stats[zombie_name].stale_completions == 1
    assert stats[zombie_name].leases_expired == 1
    # Of its 2 tokens, the one its checkpoint held went on in the fresh lease.
    assert stats[zombie_name].wasted_tokens == 1


def test_completion_after_reap_at_same_epoch_is_accepted(env: ApiEnv, client: OpenAI) -> None:
    """Nobody re-leased it: the late but still current answer is kept, not wasted."""
    batch_id = one_line_batch(client, "slow site")
    _, token = new_site(env)
    with fleet(env, token) as slow:
        held = lease_one(slow)
        time.sleep(LEASE_TTL_S + 0.6)  # past the TTL: the janitor puts it back in the queue
        answer = slow.post("/complete", json=done(held["request_id"], held["epoch"],
                                                  "late")).json()
    assert answer["accepted"] == [held["request_id"]]
    assert wait_for(lambda: client.batches.retrieve(batch_id).status == "completed")


def test_realtime_is_leased_before_background(env: ApiEnv, client: OpenAI) -> None:
    batch_id = one_line_batch(client, "background work")
    answers: list[Any] = []
    caller = threading.Thread(target=lambda: answers.append(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "realtime"}])))
    caller.start()
    _, token = new_site(env)
    with fleet(env, token) as site:
        time.sleep(0.3)  # let the realtime request reach the queue
        first = lease_one(site)
        assert first["body"]["messages"][0]["content"] == "realtime"
        site.post("/complete", json=done(first["request_id"], first["epoch"], "now"))
        caller.join(timeout=30)
        second = lease_one(site)
        assert second["body"]["messages"][0]["content"] == "background work"
        site.post("/complete", json=done(second["request_id"], second["epoch"], "later"))
    assert answers[0].choices[0].message.content == "now"
    assert wait_for(lambda: client.batches.retrieve(batch_id).status == "completed")


def test_realtime_request_survives_a_lost_site(env: ApiEnv, client: OpenAI) -> None:
    answers: list[Any] = []
    caller = threading.Thread(target=lambda: answers.append(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "keep me"}])))
    caller.start()
    _, lost_token = new_site(env)
    _, good_token = new_site(env)
    with fleet(env, lost_token) as lost, fleet(env, good_token) as good:
        gone = lease_one(lost)  # the lost site never answers nor heartbeats
        again = lease_one(good)
        assert again["request_id"] == gone["request_id"]
        good.post("/complete", json=done(again["request_id"], again["epoch"], "survived"))
    caller.join(timeout=30)
    assert answers and answers[0].choices[0].message.content == "survived"


def test_sites_as_json_and_self_announced_outages(env: ApiEnv, client: OpenAI) -> None:
    name, token = new_site(env)
    batch_id = one_line_batch(client, "not during the outage")
    now = time.time()
    with fleet(env, token) as dark:
        announced = dark.post("/outages", json={"start_at": now - 1, "end_at": now + 600})
        assert announced.status_code == 200 and announced.json()["site"] == name
        bad = dark.post("/outages", json={"start_at": now, "end_at": now - 5})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "end"
        assert dark.post("/lease", json={"capacity": 4, "models": [MODEL]}).json()[
            "leases"] == []
    listed = httpx.get(env.v1 + "/sites",
                       headers={"Authorization": f"Bearer {env.operator_key}"})
    assert listed.status_code == 200
    mine = {s["name"]: s for s in listed.json()["data"]}[name]
    assert mine["status"] == "outage" and mine["price_per_hour"] == 0.72
    assert mine["outages"] == [{"start_at": now - 1, "end_at": now + 600}]
    assert httpx.get(env.v1 + "/sites").status_code == 404
    _, other = new_site(env)
    with fleet(env, other) as lit:
        got = lease_one(lit)
        lit.post("/complete", json=done(got["request_id"], got["epoch"], "elsewhere"))
    assert wait_for(lambda: client.batches.retrieve(batch_id).status == "completed")


def test_a_site_lists_and_withdraws_its_outages(env: ApiEnv) -> None:
    _, token = new_site(env)
    _, other_token = new_site(env)
    now = time.time()
    with fleet(env, token) as mine, fleet(env, other_token) as other:
        made = mine.post("/outages", json={"start_at": now + 3600, "end_at": now + 7200})
        assert made.status_code == 200
        outage_id = made.json()["id"]
        past = mine.post("/outages", json={"start_at": now - 600, "end_at": now - 60}).json()
        listed = mine.get("/outages").json()
        assert listed["object"] == "list"
        assert [o["id"] for o in listed["data"]] == [outage_id]
        assert listed["data"][0]["object"] == "outage"
        every = mine.get("/outages", params={"include_past": "true"}).json()["data"]
        assert [o["id"] for o in every] == [past["id"], outage_id]
        assert other.get("/outages").json()["data"] == []
        # Another site's outage, an unknown one, a malformed id: OpenAI-style errors.
        foreign = other.delete(f"/outages/{outage_id}")
        assert foreign.status_code == 404 and foreign.json()["error"]["param"] == "outage_id"
        assert mine.delete("/outages/999999999").status_code == 404
        assert mine.delete(f"/outages/{2**70}").status_code in (400, 404)
        assert mine.delete("/outages/soon").status_code == 400
        gone = mine.delete(f"/outages/{outage_id}")
        assert gone.status_code == 200 and gone.json() == {
            "id": outage_id, "object": "outage.deleted", "deleted": True}
        assert mine.get("/outages").json()["data"] == []
        assert mine.delete(f"/outages/{outage_id}").status_code == 404
    assert httpx.get(env.base_url + "/v1/fleet/outages").status_code == 401


def test_a_released_lease_goes_to_the_next_site_with_its_checkpoint(env: ApiEnv,
                                                                     client: OpenAI) -> None:
    _, first_token = new_site(env)
    _, second_token = new_site(env)
    batch_id = one_line_batch(client, "hand me over")
    checkpoint = {"num_prompt_tokens": 4, "choices": [
        {"index": 0, "token_ids": [7, 8, 9], "text": "so far"}]}
    with fleet(env, first_token) as first, fleet(env, second_token) as second:
        held = lease_one(first)
        released = first.post("/release", json={"leases": [
            {"request_id": held["request_id"], "epoch": held["epoch"],
             "checkpoint": checkpoint}]})
        assert released.status_code == 200
        assert released.json() == {"released": [held["request_id"]], "rejected": []}
        again = lease_one(second)  # at once: no expiry to wait for
        assert again["request_id"] == held["request_id"]
        assert again["epoch"] == held["epoch"] + 1
        assert again["checkpoint"]["choices"][0]["token_ids"] == [7, 8, 9]
        stale = first.post("/release", json={"leases": [
            {"request_id": held["request_id"], "epoch": held["epoch"]}]})
        assert stale.json() == {"released": [], "rejected": [held["request_id"]]}
        bad = first.post("/release", json={"leases": [{"request_id": 5}]})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        second.post("/complete", json=done(again["request_id"], again["epoch"], "so far, done"))
    assert wait_for(lambda: client.batches.retrieve(batch_id).status == "completed")


def test_operators_set_and_clear_a_site_price_schedule(env: ApiEnv) -> None:
    name, _ = new_site(env)
    operator = {"Authorization": f"Bearer {env.operator_key}"}
    hour = int(time.time() // 3600) % 24
    hourly = [0.72] * 24
    hourly[hour] = 0.05  # cheap right now
    put = httpx.put(f"{env.v1}/sites/{name}/price_schedule", headers=operator,
                    json={"hourly_usd": hourly})
    assert put.status_code == 200 and put.json()["hourly_usd"][hour] == 0.05
    listed = {s["name"]: s for s in httpx.get(env.v1 + "/sites", headers=operator)
              .json()["data"]}[name]
    assert listed["price_now"] == 0.05 and listed["price_per_hour"] == 0.72
    bad = httpx.put(f"{env.v1}/sites/{name}/price_schedule", headers=operator,
                    json={"hourly_usd": [-1]})
    assert bad.status_code == 400 and "error" in bad.json()
    missing = httpx.put(f"{env.v1}/sites/no-such-site/price_schedule", headers=operator,
                        json={"hourly_usd": [1]})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "site"
    assert httpx.delete(f"{env.v1}/sites/{name}/price_schedule",
                        headers=operator).status_code == 200
    listed = {s["name"]: s for s in httpx.get(env.v1 + "/sites", headers=operator)
              .json()["data"]}[name]
    assert listed["price_now"] == 0.72


def test_a_request_id_with_a_nul_byte_is_refused_not_a_server_error(env: ApiEnv) -> None:
    """A site's message is hostile until checked: a NUL byte in a request id reached
    PostgreSQL's text comparison and answered 500."""
    with fleet(env) as site:
        for path, body in (("/complete", done("req_\x00", 1, "x")),
                           ("/heartbeat", {"leases": [{"request_id": "req_\x00", "epoch": 1}]}),
                           ("/release", {"leases": [{"request_id": "req_\x00", "epoch": 1}]})):
            answer = site.post(path, json=body)
            assert answer.status_code == 400, (path, answer.text)
