"""`minimill cost`: $/Mtok and $/Ttok from $/hour and measured tokens/s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minimill.sim.cost import CostError, bench_tokens_per_s, cost


def cost_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "minimill.cli", "cost", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_formula_and_references() -> None:
    # $3.6/h at 1,000 tok/s: 3.6M tokens an hour, $1 per million.
    report = cost(3.6, 1000.0, "given", references=[("api", 2.0)])
    assert report.usd_per_mtok == pytest.approx(1.0)
    assert report.usd_per_ttok == pytest.approx(1e6)
    assert report.references[0].ratio == pytest.approx(2.0)
    # Paid hours it is down make each token dearer.
    assert cost(3.6, 1000.0, "given", uptime=0.8).usd_per_mtok == pytest.approx(1.25)
    with pytest.raises(CostError):
        cost(3.6, 0.0, "given")


def test_reads_bench_engine_json(tmp_path: Path) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"output_tok_s": 90.0, "device": "cpu"}) + "\n"
                     + json.dumps({"output_tok_s": 110.0}) + "\n")
    assert bench_tokens_per_s(bench) == pytest.approx(100.0)
    done = cost_cli("--usd-per-hour", "0.36", "--bench", str(bench), "--json",
                    "--reference", "hosted=0.5")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["tokens_per_s"] == 100.0 and report["usd_per_mtok"] == pytest.approx(1.0)
    assert report["references"][0]["ratio"] == pytest.approx(0.5)


def test_cli_errors_say_what_is_wrong(tmp_path: Path) -> None:
    done = cost_cli("--usd-per-hour", "1")
    assert done.returncode == 2 and "--tokens-per-s or --bench" in done.stderr
    junk = tmp_path / "junk.json"
    junk.write_text("not json\n")
    done = cost_cli("--usd-per-hour", "1", "--bench", str(junk))
    assert done.returncode == 2 and "bench engine --json" in done.stderr
    done = cost_cli("--usd-per-hour", "1", "--tokens-per-s", "5", "--reference", "x")
    assert done.returncode == 2 and "NAME=USD_PER_MTOK" in done.stderr
    assert "Traceback" not in done.stderr
