"""The simulator is the live control plane's policy: one scenario file
(examples/scenarios/sim-vs-live.yaml), run by the simulator and through a real control plane,
sends the same number of requests to each site.

Live: `minimill serve --no-local-worker` on SQLite; each site of the scenario registered with
`minimill sites create` at its $/h (and its chip, so that no two count as the same hardware),
its announced outage with `minimill sites outage add`; one `minimill worker --engine fake:RATE`
process per site at the site's tokens/s, with --capacity = tokens/s * lease_work_s / tokens
(the requests a simulated site takes in one lease call); the batch submitted with the official
openai client; where each request completed read from the store.

Deterministic despite real processes: every worker has reported its free room before the
batch arrives, the batch fits in one round (the sites' capacities hold it all), and a fake
request takes lease_work_s seconds whatever else runs, so no slot frees up while the batch is
being placed. Each request then goes to the cheapest live site (effective $/Mtok, from the
price and the declared rate) that still has room, as placement.place says, whichever worker
happens to ask first.
"""

from __future__ import annotations

import io
import json
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import select

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from serve_process import MODEL, Serve, Worker

from minimill.control.records import RequestStatus
from minimill.control.site_view import site_states
from minimill.control.store import open_store
from minimill.control.tables import requests, sites
from minimill.sim.engine import Simulation
from minimill.sim.policies import LIVE_POLICY
from minimill.sim.scenario import Scenario, load
from minimill.sim.world import HOUR_S, build

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "examples" / "scenarios" / "sim-vs-live.yaml"
STARTUP_S = 120.0  # serve and four workers importing at once on two busy cores
RUN_S = 90.0


@dataclass(frozen=True, slots=True)
class LiveSite:
    """A scenario site as the live fleet runs it."""

    name: str
    price_per_hour: float
    tokens_per_s: float
    capacity: int
    outages_h: tuple[tuple[float, float], ...]  # (start, end), hours from the scenario's 0


def live_sites(scenario: Scenario) -> list[LiveSite]:
    """One site per group (named after its chip, as the simulated site's chip), with the
    capacity that makes one lease call take what a simulated lease call takes."""
    (batch,) = scenario.workloads
    assert batch.kind == "batch"
    out = []
    for group in scenario.groups:
        assert group.count == 1 and group.uptime == 1.0
        chip = scenario.chips[group.chip]
        rate = chip.tokens_per_s * group.chips
        capacity = rate * scenario.lease_work_s / batch.tokens
        assert capacity == int(capacity) >= 1, "lease_work_s of work must be whole requests"
        region = scenario.regions[group.region]
        assert region.price_profile is None and region.weather.outages_per_day == 0
        out.append(LiveSite(group.chip, chip.usd_per_hour * group.chips * group.price_factor,
                            rate, int(capacity),
                            tuple((o.start_h, o.end_h) for o in region.outages)))
    assert len({s.name for s in out}) == len(out), "one site per chip"
    return out


def simulated(scenario: Scenario, policy: str = LIVE_POLICY) -> Counter[str]:
    """Requests leased per site by the simulator (each exactly once here: nothing fails)."""
    world = build(scenario)
    tally = Simulation(scenario, world, policy).run()
    assert tally.completed == scenario.num_requests
    chips = {site.site_id: site.chip for site in world.sites}
    placed: Counter[str] = Counter()
    for (site_id, _tier), n in tally.placed.items():
        placed[chips[site_id]] += n
    return placed


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    home = tmp_path / "home"
    home.mkdir()
    scenario = load(SCENARIO)
    # No model to load: the control plane only routes the model name the fake workers serve.
    control = Serve(home, local_worker=False,
                    extra_env={"MINIMILL_LEASE_TTL_S": f"{scenario.lease_ttl_s:g}"})
    try:
        yield control.start_and_wait(STARTUP_S)
    finally:
        control.stop()


def wait_until(what: str, check: object, timeout: float) -> None:
    assert callable(check)
    deadline = time.time() + timeout
    while not check():
        if time.time() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def live(serve: Serve, scenario: Scenario, fleet: list[LiveSite]) -> Counter[str]:
    """Requests completed per site when the scenario's batch runs on the live fleet."""
    origin = time.time() - 60  # the scenario's hour 0: just before the work arrives
    workers = []
    for site in fleet:
        made = serve.cli("sites", "create", site.name, "--price-per-hour",
                         f"{site.price_per_hour:g}", "--chip", site.name)
        assert made.returncode == 0, made.stderr
        token = made.stdout.strip().splitlines()[-1]
        for start_h, end_h in site.outages_h:
            told = serve.cli("sites", "outage", "add", site.name,
                             "--from", _iso(origin + start_h * HOUR_S),
                             "--to", _iso(origin + end_h * HOUR_S))
            assert told.returncode == 0, told.stderr
        workers.append(Worker(serve.home, f"http://127.0.0.1:{serve.port}", site.name, token,
                              engine=f"fake:{site.tokens_per_s:g}",
                              extra_args=("--capacity", str(site.capacity))))
    store = open_store(serve.db_url())
    try:
        for worker in workers:  # all at once: the imports overlap
            worker.start()
        for worker in workers:
            worker.wait_for_log(rf"worker for site '{worker.site}' ready", STARTUP_S)

        def all_reported() -> bool:
            """Every site said its rate and its whole free room a moment ago."""
            now = time.time()
            with store.read() as conn:
                by_id = site_states(conn)
                names = dict(conn.execute(select(sites.c.id, sites.c.name)).tuples().all())
            states = {names[site_id]: state for site_id, state in by_id.items()}
            return all(
                (s := states[site.name]).free_capacity == site.capacity
                and s.tokens_per_s == site.tokens_per_s
                and s.capacity_at is not None and now - s.capacity_at < 1.0
                for site in fleet)

        wait_until("every worker reports its free room", all_reported, STARTUP_S)
        (batch,) = scenario.workloads
        lines = [json.dumps({"custom_id": f"r{i}", "method": "POST",
                             "url": "/v1/chat/completions",
                             "body": {"model": MODEL, "max_tokens": batch.tokens,
                                      "messages": [{"role": "user", "content": f"r{i}"}]}})
                 for i in range(batch.requests)]
        client = serve.client()
        file_id = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())),
                                      purpose="batch").id
        batch_id = client.batches.create(input_file_id=file_id,
                                         endpoint="/v1/chat/completions",
                                         completion_window="24h").id
        wait_until("the batch completes",
                   lambda: client.batches.retrieve(batch_id).status == "completed", RUN_S)
        with store.read() as conn:
            rows = conn.execute(
                select(sites.c.name, requests.c.status)
                .join(sites, sites.c.id == requests.c.site_id)
                .where(requests.c.batch_id == batch_id)).all()
        assert len(rows) == batch.requests
        assert {r.status for r in rows} == {RequestStatus.SUCCEEDED.value}
        return Counter(r.name for r in rows)
    finally:
        store.close()
        for worker in workers:
            worker.stop()


def test_simulator_and_live_control_plane_send_work_to_the_same_sites(serve: Serve) -> None:
    scenario = load(SCENARIO)
    fleet = live_sites(scenario)
    expected = simulated(scenario)
    # The comparison can tell policies apart: round-robin places this batch otherwise.
    assert simulated(scenario, "naive") != expected
    # Work spills over from full cheap sites to dearer ones, and none goes into an outage.
    assert len(expected) > 2
    assert all(expected[s.name] == 0 for s in fleet if s.outages_h)
    placed = live(serve, scenario, fleet)
    assert placed == expected, f"live {dict(placed)} != simulated {dict(expected)}"
