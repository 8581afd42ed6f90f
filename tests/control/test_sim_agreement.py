"""The simulator is the control plane's policy: the same small case, driven through the live
control plane's lease calls on a real SQLite store and through the simulator, sends the same
work to the same sites (realtime to the fastest reliable site, background to the cheapest, the
dear site left idle)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from control_factory import CONFIG, MODEL, batch, chat_line, tenant

from minimill.control.bodies import ChatBody, prepare_body
from minimill.control.leases import lease
from minimill.control.records import Kind
from minimill.control.requests import submit
from minimill.control.sites import authenticate_site, create_site
from minimill.control.store import open_store
from minimill.sim.engine import Simulation
from minimill.sim.scenario import parse
from minimill.sim.world import build
from minimill.transport.protocol import LeaseRequest

# name: ($/hour, tokens/s)
SITES = {"x": (0.5, 1000.0), "y": (2.0, 1000.0), "z": (3.0, 5000.0)}
BACKGROUND, REALTIME = 20, 5


def live_placement(tmp_path: Path) -> Counter[tuple[str, str]]:
    store = open_store(f"sqlite:///{tmp_path / 'minimill.db'}")
    try:
        sites = {}
        for name, (price, _) in SITES.items():
            found = authenticate_site(store, create_site(store, name, price, name))
            assert found is not None
            sites[name] = found
        now = time.time()

        def ask(name: str, at: float) -> list[str]:
            request = LeaseRequest(capacity=100, models=[MODEL], tokens_per_s=SITES[name][1])
            return [x.request_id for x in lease(store, sites[name], request, at, CONFIG).leases]

        for name in SITES:  # every site reports its free room, as idle workers do
            assert ask(name, now) == []
        owner = tenant(store)
        batch(store, owner, [chat_line(f"b{i}") for i in range(BACKGROUND)], now=now)
        realtime = set()
        for i in range(REALTIME):
            parsed = ChatBody.model_validate({"model": MODEL, "max_tokens": 8, "messages": [
                {"role": "user", "content": f"r{i}"}]})
            realtime.add(submit(store, owner.id, prepare_body(Kind.CHAT, parsed, [MODEL]),
                                now + 0.1, CONFIG))
        placed: Counter[tuple[str, str]] = Counter()
        for step, name in enumerate(("y", "z", "x")):  # the dear site asks first
            for request_id in ask(name, now + 0.2 + step * 0.01):
                placed[(name, "realtime" if request_id in realtime else "background")] += 1
        return placed
    finally:
        store.close()


def simulated_placement() -> Counter[tuple[str, str]]:
    scenario = parse({
        "name": "agree", "duration_h": 1, "arrival_bin_s": 60,
        "chips": {name: {"tokens_per_s": rate, "usd_per_hour": price}
                  for name, (price, rate) in SITES.items()},
        "sites": [{"count": 1, "chip": name, "uptime": 1.0} for name in SITES],
        "workloads": [{"kind": "batch", "requests": BACKGROUND, "tokens": 8},
                      {"kind": "realtime", "requests_per_s": 1, "tokens": 8,
                       "end_h": REALTIME / 3600}],
        "policies": ["cost"]})
    world = build(scenario)
    tally = Simulation(scenario, world, "cost").run()
    names = {site.site_id: site.chip for site in world.sites}
    return Counter({(names[site_id], tier): n for (site_id, tier), n in tally.placed.items()})


def test_simulator_and_control_plane_send_work_to_the_same_sites(tmp_path: Path) -> None:
    live = live_placement(tmp_path)
    simulated = simulated_placement()
    assert live == Counter({("z", "realtime"): REALTIME, ("x", "background"): BACKGROUND})
    assert simulated == live
