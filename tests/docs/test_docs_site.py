"""The generated pages say what the code and the data say: the CLI reference names every
command, the HTTP API reference every route, the benchmarks page every recorded run; the
README's figures are recorded runs; the Grafana dashboard queries only metrics /metrics serves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gen_api_reference
import gen_benchmarks
import gen_cli_reference
import pytest
from fastapi.testclient import TestClient

from minimill.api.app import create_app
from minimill.control.keys import create_operator_key
from minimill.control.sites import create_site
from minimill.control.store import open_store

ROOT = Path(__file__).resolve().parents[2]


def _command_paths(command: object, path: str) -> list[str]:
    paths = [path]
    if hasattr(command, "list_commands"):
        ctx = gen_cli_reference._context(command, path.rsplit(" ", 1)[-1])
        for name in command.list_commands(ctx):  # type: ignore[attr-defined]
            sub = command.get_command(ctx, name)  # type: ignore[attr-defined]
            if sub is not None and not sub.hidden:
                paths += _command_paths(sub, f"{path} {name}")
    return paths


def test_cli_reference_has_every_command_and_option() -> None:
    page = gen_cli_reference.render()
    paths = _command_paths(gen_cli_reference.root_command(), "minimill")
    assert {"minimill serve", "minimill worker", "minimill box exec", "minimill sites outage add",
            "minimill agent run"} <= set(paths)
    for path in paths:
        assert f"`{path}`" in page, path
    assert "`--kv-flash-dir <str>`" in page and "MINIMILL_SITE_TOKEN" in page


def test_http_reference_has_every_route_and_the_operator_routes() -> None:
    schema = gen_api_reference.openapi_schema()
    page = gen_api_reference.render(schema)
    for path, item in schema["paths"].items():
        for method in item:
            assert f"### `{method.upper()} {path}`" in page, (method, path)
    assert "`GET /v1/sites`" in page and "`PUT /v1/sites/{site}/price_schedule`" in page
    for name in schema["components"]["schemas"]:
        assert f"{{#{gen_api_reference._anchor(name)}}}" in page, name


def test_benchmarks_page_renders_every_run() -> None:
    runs = gen_benchmarks.load_runs()
    assert len(runs) >= 40
    page = gen_benchmarks.render(runs)
    for run in runs:
        assert run["machine"] in page and f"`{run['command']}`" in page, run["file"]


def test_a_result_file_without_its_machine_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text(json.dumps({"bench": "engine", "date": None,
                                                   "command": "x", "figures": {}}))
    with pytest.raises(ValueError, match="machine"):
        gen_benchmarks.load_runs(tmp_path)


def _numbers(value: object) -> set[float]:
    if isinstance(value, dict):
        return {n for v in value.values() for n in _numbers(v)}
    if isinstance(value, list):
        return {n for v in value for n in _numbers(v)}
    return {float(value)} if isinstance(value, int | float) else set()


def test_readme_figures_are_recorded_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Figures"):readme.index("## Read more")]
    recorded = {n for run in gen_benchmarks.load_runs() for n in _numbers(run)}
    # The measured figures of the table (decimals, not ratios like 4.71x, shares like 37% or
    # names like qwen3-moe-2.9b).
    figures = {float(m.replace(",", "")) for m in
               re.findall(r"(?<![\w.])(\d[\d,]*\.\d+)(?![\w%])", table)}
    assert len(figures) >= 8
    assert figures <= recorded, figures - recorded


def test_grafana_dashboard_queries_only_served_metrics(tmp_path: Path) -> None:
    dashboard = json.loads((ROOT / "docs/operator-guide/grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    wanted = {name for e in exprs for name in re.findall(r"\bminimill_\w+", e)}
    store = open_store(f"sqlite:///{tmp_path}/store.db")
    try:
        create_site(store, "mill-a", 0.1, "cpu")
        key = create_operator_key(store)
        with TestClient(create_app(store=store)) as client:
            client.get("/v1/models")  # an HTTP request, so the HTTP series exist
            scrape = client.get("/metrics", headers={"Authorization": f"Bearer {key}"})
    finally:
        store.close()
    assert scrape.status_code == 200
    served = set(re.findall(r"^(minimill_\w+?)(?:\{| )", scrape.text, re.M))
    assert len(wanted) >= 10
    assert wanted <= served, wanted - served
