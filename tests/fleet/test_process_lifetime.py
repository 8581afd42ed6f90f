"""Processes die with their parent, and a worker stops promptly on SIGTERM at any stage.

Real processes and real signals: a worker told to stop while it loads its model, or while its
control plane does not answer; a worker whose owner is killed -9 (started from the owner's
main thread: the kernel's parent-death signal; from a helper thread: the watchdog); and
`minimill bench fleet` stopped by SIGTERM, after which none of the processes it started is
left (checked by pid).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fleet_checks import wait_until
from serve_process import FAST_ENV, MODEL, Worker, chat_line, free_port, minimill_cmd

from minimill.lifetime import owned_env

pytestmark = pytest.mark.slow
PROMPT_EXIT_S = 5.0


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it has stopped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def unreachable_worker(home: Path, site: str) -> Worker:
    """A worker whose control plane is a port nobody listens on."""
    return Worker(home, f"http://127.0.0.1:{free_port()}", site, "mms-nobody")


def stopped_within(worker: Worker, seconds: float) -> float:
    assert worker.popen is not None
    sent = time.monotonic()
    worker.popen.send_signal(signal.SIGTERM)
    code = worker.popen.wait(timeout=30)
    took = time.monotonic() - sent
    assert code == 0, worker.log_text()[-2000:]
    assert took < seconds, f"took {took:.1f}s:\n{worker.log_text()[-2000:]}"
    return took


def test_sigterm_while_the_worker_starts(fleet_home: Path) -> None:
    worker = unreachable_worker(fleet_home, "starting")
    worker.start()
    try:
        worker.wait_for_log(r"worker for site 'starting' starting", 60)
        stopped_within(worker, PROMPT_EXIT_S)
        log = worker.log_text()
        assert "SIGTERM while starting" in log and "ready" not in log
    finally:
        worker.stop()


def test_sigterm_while_the_control_plane_is_unreachable(fleet_home: Path) -> None:
    worker = unreachable_worker(fleet_home, "cut-off")
    worker.start()
    try:
        worker.wait_for_log(r"worker for site 'cut-off' ready", 180)
        worker.wait_for_log(r"lease failed", 30)  # it is retrying by now
        stopped_within(worker, PROMPT_EXIT_S)
        assert "worker stopped" in worker.log_text()
    finally:
        worker.stop()


OWNER = """
import subprocess, sys, threading, time
from minimill.lifetime import owned_env
how, log, args = sys.argv[1], sys.argv[2], sys.argv[3:]
box = []
def start():
    box.append(subprocess.Popen(args, env=owned_env(), stdout=subprocess.DEVNULL,
                                stderr=open(log, "wb")))
if how == "thread":
    helper = threading.Thread(target=start)
    helper.start()
    helper.join()  # the thread that started the worker is gone from here on
else:
    start()
print(box[0].pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("spawned_from", ["main", "thread"])
def test_a_worker_dies_with_its_owner(fleet_home: Path, tmp_path: Path,
                                      spawned_from: str) -> None:
    """kill -9 of the process that started a worker: the worker stops by itself."""
    env = {**os.environ, **FAST_ENV, "MINIMILL_HOME": str(fleet_home),
           "MINIMILL_SITE_TOKEN": "mms-nobody"}
    log = tmp_path / f"worker-{spawned_from}.log"
    args = minimill_cmd("worker", "--server", f"http://127.0.0.1:{free_port()}", "--site",
                        f"orphan-{spawned_from}", "--model", MODEL, "--dtype", "float32")
    owner = subprocess.Popen([sys.executable, "-c", OWNER, spawned_from, str(log), *args],
                             env=env, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        assert owner.stdout is not None
        worker_pid = int(owner.stdout.readline())
        wait_until(lambda: "ready" in log.read_text(errors="replace"), 180,
                   "the worker to be ready")
        # Started from a helper thread that has ended, it must still be running.
        time.sleep(1.0)
        assert alive(worker_pid), log.read_text()[-2000:]
        owner.kill()
        owner.wait(timeout=10)
        wait_until(lambda: not alive(worker_pid), PROMPT_EXIT_S + 2,
                   "the orphaned worker to exit")
        assert "parent process" in log.read_text(errors="replace")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(owner.pid, signal.SIGKILL)
        if owner.stdout is not None:
            owner.stdout.close()


def test_bench_fleet_stopped_by_sigterm_leaves_nothing_running(tmp_path: Path,
                                                               model_file: Path) -> None:
    workload = tmp_path / "tiny.jsonl"
    workload.write_text("\n".join(chat_line(f"t-{i}", f"Count to {i}.", max_tokens=64)
                                  for i in range(4)) + "\n")
    bench = subprocess.Popen(
        minimill_cmd("bench", "fleet", "--workload", str(workload), "--json",
                     "--kill-every-s", "1000"),
        env=owned_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        def fleet_up() -> list[int] | None:
            if bench.poll() is not None:  # it gave up (or finished) before it was seen up
                output = bench.stdout.read() if bench.stdout is not None else b""
                raise AssertionError(f"bench fleet exited with {bench.returncode}: "
                                     f"{output.decode(errors='replace')[-2000:]}")
            kids = children(bench.pid)
            homes = {_home_of(pid) for pid in kids} - {None}
            ready = [h for h in homes if h is not None and any(
                "ready" in p.read_text(errors="replace") for p in Path(h).glob("worker-*.log"))]
            return kids if len(kids) == 4 and ready else None

        kids = wait_until(fleet_up, 300, "serve and three workers")
        grandchildren = [g for k in kids for g in children(k)]
        bench.send_signal(signal.SIGTERM)
        bench.wait(timeout=90)
        everyone = [bench.pid, *kids, *grandchildren]
        wait_until(lambda: not any(alive(pid) for pid in everyone), 10,
                   "every process the benchmark started to exit")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(bench.pid, signal.SIGKILL)
        if bench.stdout is not None:
            bench.stdout.close()


def _home_of(pid: int) -> str | None:
    with contextlib.suppress(OSError):
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if item.startswith(b"MINIMILL_HOME="):
                return item.split(b"=", 1)[1].decode()
    return None


def test_owned_env_names_the_parent_and_the_thread() -> None:
    env = owned_env({"A": "1"})
    assert env["A"] == "1" and env["MINIMILL_PARENT_PID"] == str(os.getpid())
    assert env["MINIMILL_PARENT_DEATH_SIGNAL"] == "1"  # from the main thread
    box: list[dict[str, str]] = []
    helper = threading.Thread(target=lambda: box.append(owned_env({})))
    helper.start()
    helper.join()
    assert box[0]["MINIMILL_PARENT_DEATH_SIGNAL"] == "0"
