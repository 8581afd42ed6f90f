"""A harness is a tenant's code: on a real runner it cannot read the site token, the store or
the runner's files, reach the network, start processes or take the runner down with it."""

from __future__ import annotations

import socket
from pathlib import Path

from serve_process import Serve, Worker
from test_agent_durability import start_runner

from minimill.client.agents import Agents

PROBE = '''
import glob
import os
import socket
import subprocess
import threading


def attempt(action):
    try:
        return "allowed: " + repr(action())[:200]
    except BaseException as exc:
        return "refused: " + type(exc).__name__


def forked():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    return pid


def environments():
    seen = []
    for path in glob.glob("/proc/*/environ"):
        try:
            seen.append(open(path, "rb").read().decode(errors="replace"))
        except OSError:
            pass
    return seen


async def main(ctx, task):
    if task == "crash":
        print("about to leave", flush=True)
        os._exit(3)
    report = {
        "env": sorted(os.environ),
        "environs": environments(),
        "store": attempt(lambda: open(task["store"], "rb").read(16)),
        "home": attempt(lambda: os.listdir(task["home"])),
        "network": attempt(lambda: socket.create_connection(("127.0.0.1", task["port"]), 3)),
        "subprocess": attempt(lambda: subprocess.run(["/bin/true"])),
        "fork": attempt(forked),
        "thread": attempt(lambda: threading.Thread(target=print).start()),
        "write_package": attempt(lambda: open("/opt/minimill/minimill/planted.py", "w")),
        "memory": attempt(lambda: len(bytearray(3 * 1024**3))),
        "processes": [p for p in os.listdir("/proc") if p.isdigit()],
    }
    await ctx.log("probed")  # its effects still work after all that
    return report
'''


def test_a_harness_cannot_reach_the_runners_secrets(serve: Serve, tmp_path: Path) -> None:
    harness = tmp_path / "probe.py"
    harness.write_text(PROBE)
    runner = start_runner(serve, "runner-sandbox")
    token = runner.env["MINIMILL_SITE_TOKEN"]
    store = serve.home / "data" / "minimill.db"
    assert token and store.exists()
    try:
        with Agents(serve.base_url, serve.key) as agents:
            probe = agents.run(harness, {"store": str(store), "home": str(serve.home),
                                         "port": serve.port})
            crash = agents.run(harness, "crash")
            report = agents.wait(probe, timeout_s=120)
            assert report["status"] == "succeeded", report
            seen = report["result"]
            # Nothing of the runner's environment: no site token, no API key, no paths.
            assert not [k for k in seen["env"] if "TOKEN" in k or "KEY" in k
                        or k.startswith("MINIMILL")], seen["env"]
            assert seen["environs"] and not any(token in env for env in seen["environs"])
            assert seen["store"] == "refused: FileNotFoundError", seen["store"]
            assert seen["home"] == "refused: FileNotFoundError", seen["home"]
            assert seen["network"].startswith("refused: "), seen["network"]
            assert seen["subprocess"] == "refused: PermissionError", seen["subprocess"]
            assert seen["fork"] == "refused: PermissionError", seen["fork"]
            assert seen["thread"] == "allowed: None", seen["thread"]  # threads are no fork
            assert seen["write_package"].startswith("refused: "), seen["write_package"]
            assert seen["memory"] == "refused: MemoryError", seen["memory"]
            assert len(seen["processes"]) <= 3, seen["processes"]  # its own PID namespace
            assert agents.logs(probe) == ["probed"]
            # A harness that kills its own process fails; the runner goes on.
            crashed = agents.wait(crash, timeout_s=120)
            assert crashed["status"] == "failed", crashed
            assert "exit code 3" in crashed["error"]["message"], crashed["error"]
            assert "about to leave" in crashed["error"]["message"], crashed["error"]
        assert runner.popen.poll() is None
        assert not (Path(__file__).parents[2] / "src/minimill/planted.py").exists()
        # The control plane was reachable from the host all along.
        with socket.create_connection(("127.0.0.1", serve.port), 3):
            pass
    finally:
        runner.stop()


def test_a_runner_refuses_to_start_without_a_sandbox(serve: Serve, tmp_path: Path) -> None:
    """Without bubblewrap a runner refuses to run harnesses unless the operator opts out."""
    token = serve.cli("sites", "create", "runner-nobwrap",
                      "--serves", "agents").stdout.strip().split()[-1]
    empty = tmp_path / "bin"
    empty.mkdir()
    python_dir = str(Path(__import__("sys").executable).parent)
    worker = Worker(serve.home, serve.base_url.removesuffix("/v1"), "runner-nobwrap", token,
                    engine="none", extra_args=("--agents", "1"),
                    extra_env={"PATH": f"{python_dir}:{empty}"})
    worker.start()
    assert worker.popen.wait(timeout=120) == 2
    assert "cannot run agents: bubblewrap (bwrap) is not installed" in worker.log_text()
