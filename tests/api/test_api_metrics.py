"""`/metrics`: scraped over real HTTP from a live control plane and parsed with the Prometheus
text parser; operator keys only."""

from __future__ import annotations

import httpx
from api_harness import ApiEnv, wait_for
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from test_api_fleet import done, fleet, lease_one, new_site, one_line_batch

SERVER_SETTINGS = {"lease_ttl_s": 1.0, "janitor_interval_s": 0.1}


def scrape(env: ApiEnv) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    got = httpx.get(env.base_url + "/metrics",
                    headers={"Authorization": f"Bearer {env.operator_key}"})
    assert got.status_code == 200
    assert got.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(got.text) for s in family.samples}


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
          **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_routes_queue_sites_expiries_and_stale_completions(
        env: ApiEnv, client: OpenAI) -> None:
    name, token = new_site(env)
    before = scrape(env)
    batch_id = one_line_batch(client, "count me")
    # A batch answers `validating` at once; its lines are queued by the batch jobs just after.
    assert wait_for(lambda: value(scrape(env), "minimill_queue_depth", tier="background",
                                  status="queued") >= 1, timeout_s=15)
    mid = scrape(env)
    assert value(mid, "minimill_http_requests_total", method="POST", route="/v1/batches",
                 status="200") == value(before, "minimill_http_requests_total", method="POST",
                                        route="/v1/batches", status="200") + 1
    assert value(mid, "minimill_http_request_duration_seconds_count", method="POST",
                 route="/v1/batches") >= 1
    with fleet(env, token) as site:
        first = lease_one(site)
        # Let the lease expire (TTL 1 s, the janitor reaps it), then lease it again.
        wait_for(lambda: value(scrape(env), "minimill_site_lease_expiries_total", site=name,
                               chip="cpu") >= 1, timeout_s=15)
        again = lease_one(site)
        assert again["epoch"] == first["epoch"] + 1
        stale = site.post("/complete", json=done(first["request_id"], first["epoch"], "old"))
        assert stale.json()["rejected"][0]["reason"] == "stale_epoch"
        ok = site.post("/complete", json=done(again["request_id"], again["epoch"], "new"))
        assert ok.json()["accepted"] == [again["request_id"]]
    assert wait_for(lambda: client.batches.retrieve(batch_id).status == "completed")
    after = scrape(env)
    assert value(after, "minimill_site_tokens_total", site=name, chip="cpu") == 2
    assert value(after, "minimill_site_stale_completions_total", site=name, chip="cpu") == 1
    assert value(after, "minimill_site_completions_total", site=name, chip="cpu") == 1
    # Ids do not make new series: the route template is the label.
    assert value(after, "minimill_http_requests_total", method="GET",
                 route="/v1/batches/{batch_id}", status="200") >= 1


def test_metrics_refuse_everyone_but_operators(env: ApiEnv) -> None:
    assert httpx.get(env.base_url + "/metrics").status_code == 404
    tenant = httpx.get(env.base_url + "/metrics",
                       headers={"Authorization": f"Bearer {env.key}"})
    assert tenant.status_code == 404 and "error" in tenant.json()
