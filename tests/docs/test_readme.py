"""Every code block of the README runs, as a user would run it after `make serve`: the Python
quickstarts with the official clients, the shell ones through the `minimill` command, against a
real `minimill serve` and the default model. The only changes are the addresses: the test's
serve is not on port 8000, and a webhook receiver gets a free port instead of 9000."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from readme_blocks import Block, readme_blocks
from serve_process import Serve, Worker, free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = readme_blocks()
RUN = [b for b in BLOCKS if b.not_tested is None and b.file is None]


def test_every_block_runs_or_says_why_not() -> None:
    assert RUN, "no README block to run"
    for block in BLOCKS:
        assert block.lang in ("python", "sh"), f"line {block.line}: a ```{block.lang} block"
        if block.not_tested is not None:
            assert len(block.not_tested.split()) >= 3, f"line {block.line}: say why"
    assert len(README_LINES := (ROOT / "README.md").read_text().splitlines()) <= 300, \
        len(README_LINES)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the blocks run: the repository's examples/ and benchmarks/, and the README's files."""
    path = tmp_path_factory.mktemp("readme")
    for name in ("examples", "benchmarks"):
        (path / name).symlink_to(ROOT / name)
    for block in BLOCKS:
        if block.file is not None:
            (path / block.file).write_text(block.body)
    return path


@pytest.fixture(scope="module")
def env(serve: Serve) -> dict[str, str]:
    """The shell after `make serve`: the two lines it prints pasted, minimill on the PATH."""
    return {**serve.env, "OPENAI_BASE_URL": serve.base_url, "OPENAI_API_KEY": serve.key,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


@pytest.fixture(scope="module")
def runner(serve: Serve) -> Iterator[Worker]:
    """A site that runs agents (the shared serve's local worker runs none)."""
    token = serve.cli("sites", "create", "readme-runner",
                      "--serves", "agents").stdout.strip().split()[-1]
    worker = Worker(serve.home, serve.base_url.removesuffix("/v1"), "readme-runner", token,
                    engine="none", extra_args=("--agents", "2")).start_and_wait()
    try:
        yield worker
    finally:
        worker.stop()


def localized(block: Block, serve: Serve) -> str:
    body = block.body.replace("127.0.0.1:8000", f"127.0.0.1:{serve.port}")
    return re.sub(r"\b9000\b", str(free_port()), body) if "127.0.0.1" in body else body


def _run_background(script: str, ready: str, workdir: Path, env: dict[str, str]) -> str:
    log = workdir / f"background-{time.monotonic_ns()}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=workdir,
                                env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.time() + 300
        while not re.search(ready, log.read_text(errors="replace")):
            assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.time() < deadline, f"no {ready!r} in 300 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    return log.read_text(errors="replace")


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_readme_block(block: Block, serve: Serve, workdir: Path, env: dict[str, str],
                      runner: Worker) -> None:
    script = localized(block, serve)
    if block.ready is not None:
        _run_background(script, block.ready, workdir, env)
        return
    argv = ([sys.executable, "-c", script] if block.lang == "python"
            else ["bash", "-euo", "pipefail", "-c", script])
    done = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"README line {block.line}:\n{done.stdout}\n{done.stderr}"
