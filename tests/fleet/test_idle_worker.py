"""An idle worker costs next to no CPU: with nothing to lease it polls its control plane a few
times a second and otherwise sleeps. (A worker whose event loop spun on a closed wakeup socket
burned half a core and halved the fleet's throughput; this is the check that would have
caught it.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

from serve_process import Serve, Worker

IDLE_S = 4.0
# Lease polls every 0.2 s, heartbeats and a stats line: a few percent of a core at most.
MAX_IDLE_CPU_FRACTION = 0.15


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_worker_sleeps(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    control = Serve(home, local_worker=False).start_and_wait()
    try:
        made = control.cli("sites", "create", "idle", "--price-per-hour", "1")
        assert made.returncode == 0, made.stderr
        token = made.stdout.strip().splitlines()[-1]
        worker = Worker(home, f"http://127.0.0.1:{control.port}", "idle", token,
                        engine="fake:100").start_and_wait()
        try:
            worker.wait_for_log(r"start: [\d.]+s to first lease", 60)
            assert worker.popen is not None
            before, began = cpu_seconds(worker.popen.pid), time.monotonic()
            time.sleep(IDLE_S)
            used = cpu_seconds(worker.popen.pid) - before
            fraction = used / (time.monotonic() - began)
            assert fraction < MAX_IDLE_CPU_FRACTION, \
                f"an idle worker used {fraction:.0%} of a core:\n{worker.log_text()[-1500:]}"
        finally:
            worker.stop()
    finally:
        control.stop()
