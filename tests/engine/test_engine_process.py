"""The engine's step loop in a child process (`ProcessEngine`): the same tokens as the offline
engine, aborts, a dead child fails open streams instead of hanging them, and the child dies
with its parent."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import PROMPTS

from minimill.engine.engine_process import ProcessEngine
from minimill.engine.llm import LLM
from minimill.engine.params import EngineError, FinishReason, SamplingParams, TokenDelta


@pytest.fixture(scope="module")
def child_engine(model_file: Path) -> Iterator[ProcessEngine]:
    engine = ProcessEngine(str(model_file), dtype="float32", num_kv_blocks=512,
                           max_model_len=2048)
    yield engine
    engine.close()


async def collect(engine: ProcessEngine, request_id: str, prompt: str,
                  params: SamplingParams) -> list[TokenDelta]:
    return [d async for d in engine.generate(request_id, prompt, params)]


def _ignores(pid: int, signum: int) -> bool:
    """Whether the process ignores `signum` (its SigIgn mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    raise AssertionError(f"no SigIgn line for pid {pid}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; only its parent has not reaped it yet.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_child_process_streams_what_the_offline_engine_generates(
        child_engine: ProcessEngine, llm: LLM) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, top_logprobs=3)
    offline = llm.generate(PROMPTS, params)

    async def main() -> list[list[TokenDelta]]:
        return await asyncio.gather(*(collect(child_engine, f"p{i}", p, params)
                                      for i, p in enumerate(PROMPTS)))

    for deltas, ref in zip(asyncio.run(main()), offline, strict=True):
        # The engine is batch-invariant: the same tokens and logprobs, however batched.
        assert [t for d in deltas for t in d.new_token_ids] == ref.output_token_ids
        assert ref.logprobs is not None
        assert [lp.top for d in deltas for lp in d.logprobs or []] == \
            [lp.top for lp in ref.logprobs]
        assert "".join(d.new_text for d in deltas) == ref.text
        assert deltas[-1].finish_reason == FinishReason.LENGTH
    assert child_engine.recent_output_tok_s() > 0
    assert child_engine.tokenizer.encode("hello") == llm.tokenizer.encode("hello")


def test_abort_in_the_child_ends_one_stream(child_engine: ProcessEngine) -> None:
    async def main() -> tuple[list[TokenDelta], list[TokenDelta]]:
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        other = asyncio.create_task(collect(child_engine, "bystander", PROMPTS[1], short))
        got: list[TokenDelta] = []
        async for delta in child_engine.generate("victim", PROMPTS[0], long):
            got.append(delta)
            if len(got) == 2:
                child_engine.abort("victim")
        return got, await other

    victim, other = asyncio.run(main())
    assert victim[-1].finish_reason == FinishReason.ABORT
    assert sum(len(d.new_token_ids) for d in victim) < 400
    assert other[-1].finish_reason == FinishReason.LENGTH


def test_a_killed_child_fails_open_streams(model_file: Path) -> None:
    engine = ProcessEngine(str(model_file), dtype="float32", num_kv_blocks=256,
                           max_model_len=1024)
    child = engine._process.pid
    assert child is not None

    async def main() -> BaseException | None:
        long = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
        try:
            async for _ in engine.generate("doomed", PROMPTS[0], long):
                os.kill(child, signal.SIGKILL)
        except EngineError as exc:
            return exc
        return None

    try:
        error = asyncio.run(asyncio.wait_for(main(), 60))
        assert isinstance(error, EngineError) and "died" in str(error)
        with pytest.raises(EngineError):
            asyncio.run(collect(engine, "after", PROMPTS[1], SamplingParams(max_tokens=2)))
    finally:
        engine.close()


def test_the_child_dies_with_its_parent(model_file: Path, tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys, time
        from minimill.engine.engine_process import ProcessEngine
        engine = ProcessEngine({str(model_file)!r}, dtype="float32", num_kv_blocks=64,
                               max_model_len=512)
        print(engine._process.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _alive(child)
        # SIGTERM to the child alone is ignored: the parent decides when it stops. The kernel
        # drops an ignored signal when it is sent, so the child is alive right after.
        assert _ignores(child, signal.SIGTERM)
        os.kill(child, signal.SIGTERM)
        assert _alive(child)
        parent.kill()  # no chance to clean up: the parent-death signal must do it
        parent.wait(10)
        deadline = time.monotonic() + 15
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_the_parent_never_imports_torch(model_file: Path) -> None:
    """Only the child pays for torch's import: a restarted worker starts that much sooner."""
    script = textwrap.dedent(f"""
        import asyncio, sys
        from minimill.engine.params import SamplingParams
        from minimill.fleet.builtin_engine import BuiltinEngineAdapter

        async def main():
            adapter = await BuiltinEngineAdapter.start(
                model={str(model_file)!r}, dtype="float32",
                options={{"num_kv_blocks": 64, "max_model_len": 512}})
            engine = adapter._engine
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            deltas = [d async for d in engine.generate("r", "Hello", params)]
            print(sum(len(d.new_token_ids) for d in deltas), adapter.default_max_tokens,
                  "torch" in sys.modules, flush=True)
            await adapter.close()

        asyncio.run(main())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["4", "512", "False"]
