"""The operators' dashboard in headless Chromium (Debian's `chromium`, `make chromium`, driven
through Playwright): it loads for an operator key (header or the cookie its ?key= link sets),
is refused to a tenant key, shows the sites of a live fleet, and a batch's progress moves as
a site completes its lines. The screenshot is kept in test-artifacts/dashboard.png."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from api_harness import MODEL, ApiEnv, wait_for
from openai import OpenAI
from test_api_fleet import done, fleet, new_site

CHROMIUM = shutil.which("chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium: "
                                "make chromium")


def batch_of(client: OpenAI, lines: int) -> str:
    text = "\n".join(json.dumps({
        "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": f"line {i}"}]}})
        for i in range(lines))
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(text.encode())),
                                  purpose="batch").id
    return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


def test_dashboard_in_headless_chromium(env: ApiEnv, client: OpenAI) -> None:
    from playwright.sync_api import expect, sync_playwright

    name, token = new_site(env)
    batch_id = batch_of(client, 3)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox"])
        try:
            tenant = browser.new_context(
                extra_http_headers={"Authorization": f"Bearer {env.key}"})
            refused = tenant.new_page().goto(env.base_url + "/dashboard")
            assert refused is not None and refused.status == 404
            nobody = browser.new_context().new_page().goto(env.base_url + "/dashboard/data")
            assert nobody is not None and nobody.status == 404

            # A browser signs in with the key once; the cookie carries it from then on.
            page = browser.new_context().new_page()
            loaded = page.goto(f"{env.base_url}/dashboard?key={env.operator_key}")
            assert loaded is not None and loaded.status == 200
            assert page.url == env.base_url + "/dashboard"
            expect(page.locator(f'tr[data-site="{name}"]')).to_be_visible(timeout=15_000)
            progress = page.locator(f'tr[data-batch="{batch_id}"] td.done')
            expect(progress).to_have_text("0/3", timeout=15_000)

            with fleet(env, token) as site:
                leases = wait_for(lambda: site.post("/lease", json={
                    "capacity": 3, "models": [MODEL]}).json()["leases"], timeout_s=10)
                first = leases[0]
                site.post("/complete", json=done(first["request_id"], first["epoch"], "a"))
                expect(progress).to_have_text("1/3", timeout=15_000)
                for lease in leases[1:]:
                    site.post("/complete", json=done(lease["request_id"], lease["epoch"], "b"))
                # A lease call may have got fewer than 3: finish what is left.
                for _ in range(3):
                    more = site.post("/lease", json={"capacity": 3, "models": [MODEL]}).json()
                    for lease in more["leases"]:
                        site.post("/complete",
                                  json=done(lease["request_id"], lease["epoch"], "c"))
            expect(progress).to_have_text("3/3", timeout=15_000)
            expect(page.locator("#queue")).to_be_visible()
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        finally:
            browser.close()
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 0
