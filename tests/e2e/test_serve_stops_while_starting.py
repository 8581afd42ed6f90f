"""`minimill serve` stops within a few seconds at any moment of a first start (a fresh
MINIMILL_HOME), its starting worker included, and leaves nothing behind: no process of its
group, no box directory, no half-written file in the home; and the first start says what it
is doing while it does it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from serve_process import Serve, make_home

STOP_WITHIN_S = 5.0
INTO_THE_START_S = 2.0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _files(home: Path) -> set[str]:
    """Every file under `home`, not through the links to the shared model cache."""
    return {os.path.relpath(os.path.join(top, name), home)
            for top, _dirs, names in os.walk(home) for name in names}


@pytest.mark.parametrize("moment", ["serve", "worker"])
def test_sigterm_two_seconds_into_a_first_start(tmp_path: Path, model_file: Path,
                                                moment: str) -> None:
    """`serve`: 2 s after serve itself starts; `worker`: 2 s into the local worker's start
    (its engine loading, dequantizing or building kernels)."""
    home = make_home(tmp_path, model_file.parent.parent)
    serve = Serve(home)
    serve.start()
    begun = time.monotonic()
    try:
        if moment == "worker":
            serve.wait_for_log(r"worker for site 'local' starting", timeout=120)
            begun = time.monotonic()
        while time.monotonic() < begun + INTO_THE_START_S:  # the moment the test is about
            time.sleep(0.05)
        log_now = serve.log_text()
        assert "ready:" not in log_now, "the start ended before the signal: nothing tested"
        assert serve.popen is not None
        serve.popen.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        try:
            code = serve.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        took_s = time.monotonic() - sent
        deadline = time.monotonic() + 2.0  # the group's last members leave with serve
        while _group_alive(serve.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = _group_alive(serve.pid)
    finally:
        serve.stop()
    log = serve.log_text()
    assert code is not None and took_s < STOP_WITHIN_S, (took_s, log[-3000:])
    assert not alive, log[-3000:]
    for box_dir in re.findall(r"workspaces in (\S+),", log):
        assert not Path(box_dir).exists(), box_dir
    left = {f for f in _files(home) if re.search(r"\.tmp|\.part|\.lock$", f)}
    assert not left, left


def test_a_first_start_says_what_it_is_doing(tmp_path: Path, model_file: Path) -> None:
    """A start that dequantizes the model (as a first start does: here the warm cache, which
    the test's homes share, is off) says so, and when it is done, before the worker is
    ready."""
    home = make_home(tmp_path, model_file.parent.parent)
    serve = Serve(home, extra_env={"MINIMILL_WARM_CACHE": "0"})
    try:
        serve.start_and_wait(timeout=300)
        log = serve.log_text()
    finally:
        serve.stop()
    said = log.index(f"dequantizing {model_file.name} to float32")
    done = re.search(r"dequantizing \S+ to float32: done in [\d.]+s", log)
    assert done is not None
    assert said < done.start() < log.index("worker for site 'local' ready")
