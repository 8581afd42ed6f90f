"""Pipeline stages that join from other hosts (engine/stage_hosts.py): a real `minimill stage
--connect` process reaching stage 0's address over TCP, as a stage on a second host does
(here on loopback, the only network this machine has for two hosts), against the
single-process engine; and the link's defences against whoever else reaches the port."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from stage_kill import kill_stage_mid_batch

from minimill.engine import pipeline_link as link
from minimill.engine import stage_hosts
from minimill.engine.llm import LLM
from minimill.engine.params import EngineDied, EngineError, InvalidRequestError, SamplingParams
from minimill.models.loader import load_model
from minimill.models.types import LoadedModel
from tiny_hf import save_tiny

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SETTINGS = {"dtype": "float32", "num_kv_blocks": 96, "num_threads": 1}


@pytest.fixture(scope="module")
def prompts(tiny_llama: LoadedModel) -> list[list[int]]:
    text = ("A stage on another host holds its own layers and their KV, and passes each "
            "microbatch on as soon as its layers have run it.")
    ids = tiny_llama.tokenizer.encode(text, add_special_tokens=True)
    return [ids[:5], ids, ids[:17], ids[:1], ids[3:30]]


@pytest.fixture(scope="module")
def reference(tiny_llama: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(tiny_llama, **SETTINGS)
    return [out.output_token_ids for out in llm.generate(prompts, GREEDY)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_stage(address: str, *extra: str, secret: str | None = None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != stage_hosts.SECRET_ENV}
    if secret is not None:
        env[stage_hosts.SECRET_ENV] = secret
    return subprocess.Popen(
        [sys.executable, "-m", "minimill.cli", "stage", "--connect", address, "--threads", "1",
         *extra], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True)


@contextlib.contextmanager
def stage_process(address: str, *extra: str, secret: str | None = None
                  ) -> Iterator[subprocess.Popen[str]]:
    process = start_stage(address, *extra, secret=secret)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(60)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    return True


def test_a_stage_from_another_host_runs_its_layers_and_waits_for_the_next_stage_0(
        tiny_llama: LoadedModel, prompts: list[list[int]], reference: list[list[int]]) -> None:
    address = f"127.0.0.1:{free_port()}"
    with stage_process(address) as stage:
        llm = LLM(tiny_llama, pipeline_stages=2, stages_listen=address, **SETTINGS)
        try:
            runner = llm.engine.runner
            assert runner.processes == [] and runner.remote is not None
            assert runner.remote.hosts == [socket.gethostname()]
            (session,) = runner.stage_pids
            assert session != stage.pid and pid_alive(session)
            # It reported what it holds: its layers' weights only, and a pool as large.
            assert len(runner.stage_memory) == 2 and all(w > 0 and kv > 0
                                                         for w, kv in runner.stage_memory)
            outs = llm.generate(prompts, GREEDY)
            assert [o.output_token_ids for o in outs] == reference
        finally:
            llm.close()
        # Stage 0 stopped the pipeline: the session ended, `minimill stage` waits on. (The
        # session is the stage's child, not this process's: poll it.)
        for _ in range(600):
            if not pid_alive(session):
                break
            threading.Event().wait(0.1)
        assert not pid_alive(session)
        assert stage.poll() is None
        # A restarted worker's stage 0 at the same address gets the same stage back.
        again = LLM(tiny_llama, pipeline_stages=2, stages_listen=address, **SETTINGS)
        try:
            assert again.engine.runner.stage_pids != [session]
            outs = again.generate(prompts[:2], GREEDY)
            assert [o.output_token_ids for o in outs] == reference[:2]
            second = again.engine.runner.stage_pids[0]
        finally:
            again.close()
        stage.send_signal(signal.SIGTERM)
        assert stage.wait(60) == 128 + signal.SIGTERM
        assert not pid_alive(second)


def test_a_remote_stage_killed_mid_batch_ends_the_engine(
        tiny_llama: LoadedModel, prompts: list[list[int]]) -> None:
    address = f"127.0.0.1:{free_port()}"
    with stage_process(address, "--once") as stage:
        llm = LLM(tiny_llama, pipeline_stages=2, stages_listen=address, **SETTINGS)
        error = kill_stage_mid_batch(llm.engine, prompts, llm.engine.runner.stage_pids[0])
        assert isinstance(error, EngineDied) and "stage 1" in str(error)
        llm.close()
        assert stage.wait(60) != 0  # --once: its only session was killed


def test_a_silent_stage_host_ends_the_engine(
        tiny_llama: LoadedModel, prompts: list[list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A host that vanishes (power, network) closes no connection: only its beat stops.
    monkeypatch.setattr(stage_hosts, "SILENCE_S", 2.0)
    address = f"127.0.0.1:{free_port()}"
    with stage_process(address, "--once"):
        llm = LLM(tiny_llama, pipeline_stages=2, stages_listen=address, **SETTINGS)
        session = llm.engine.runner.stage_pids[0]
        os.kill(session, signal.SIGSTOP)
        try:
            with pytest.raises(EngineDied, match="not been heard from"):
                llm.generate(prompts[:2], GREEDY)
        finally:
            os.kill(session, signal.SIGKILL)
            os.kill(session, signal.SIGCONT)
            llm.close()


def test_a_stage_without_the_site_s_secret_is_refused(
        tiny_llama: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(stage_hosts.SECRET_ENV, "the site's secret")
    address = f"127.0.0.1:{free_port()}"
    with stage_process(address, "--once", secret="a guess"):
        with pytest.raises(EngineError, match="refused: its proof"):
            LLM(tiny_llama, pipeline_stages=2, stages_listen=address, **SETTINGS)
    with stage_process(address, "--once", secret="the site's secret"):
        llm = LLM(tiny_llama, pipeline_stages=2, stages_listen=address, **SETTINGS)
        llm.close()


def test_a_stage_with_another_model_is_refused_by_stage_0(
        tiny_llama: LoadedModel, smol_f32: LoadedModel, tmp_path: Path) -> None:
    other = tmp_path / "other"
    save_tiny("llama", other, smol_f32, num_hidden_layers=4)
    address = f"127.0.0.1:{free_port()}"
    with stage_process(address, "--once", "--model", str(other)):
        with pytest.raises(EngineError, match="is not the model stage 0 runs"):
            LLM(tiny_llama, pipeline_stages=2, stages_listen=address, **SETTINGS)


def test_listening_off_loopback_needs_a_secret(
        tiny_llama: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(stage_hosts.SECRET_ENV, raising=False)
    with pytest.raises(InvalidRequestError, match=stage_hosts.SECRET_ENV):
        LLM(tiny_llama, pipeline_stages=2, stages_listen=f"192.0.2.1:{free_port()}",
            **SETTINGS)
    with pytest.raises(InvalidRequestError, match="not a wildcard"):
        LLM(tiny_llama, pipeline_stages=2, stages_listen=f"0.0.0.0:{free_port()}",
            **SETTINGS)
    with pytest.raises(InvalidRequestError, match="pipeline_stages"):
        LLM(tiny_llama, stages_listen=f"127.0.0.1:{free_port()}", **SETTINGS)
    with pytest.raises(InvalidRequestError, match="HOST:PORT"):
        stage_hosts.parse_address("127.0.0.1")


# The wire's defences, for whoever else reaches a stage's ports.

class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned",))


def test_a_message_that_would_run_code_is_refused() -> None:
    with pytest.raises(link.WireError, match="may not build"):
        link.loads(pickle.dumps(_Boom()))
    with pytest.raises(link.WireError, match="may not build"):
        link.loads(pickle.dumps(torch.zeros(2)))
    with pytest.raises(link.WireError, match="malformed"):
        link.loads(b"\x80\x05garbage")
    # What stages do send crosses.
    assert link.loads(link.dumps((GREEDY, range(2, 5), {1: 2}))) == (GREEDY, range(2, 5),
                                                                      {1: 2})


def test_a_header_announcing_a_huge_message_is_refused_before_allocating() -> None:
    store, port = link.open_store(2)
    outcome: list[BaseException] = []

    def peer() -> None:
        groups = link.join(1, 2, port)
        try:
            link.receive(groups.forward, 0)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    groups = link.join(0, 2, port, store)
    groups.forward.send([torch.tensor([link.STEP, 1 << 62, 0], dtype=torch.int64)], 1, 0).wait()
    thread.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], link.WireError)


def test_stage_0_s_store_listens_on_its_address_only() -> None:
    store, port = link.open_store(2)
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    # 127.0.0.2 is this host too: a store listening on every interface would answer there.
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.2", port), timeout=5).close()
    del store


def test_a_stage_that_never_comes_is_named_with_the_command_to_start_it(
        tiny_llama: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    from minimill.engine import pipeline_runner

    monkeypatch.setattr(pipeline_runner, "_STAGE_START_TIMEOUT_S", 1.0)
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(EngineError, match=f"stage 1 did not join at {address} within 1 s "
                                          rf"\(start `minimill stage --connect {address}`"):
        LLM(tiny_llama, pipeline_stages=2, stages_listen=address, **SETTINGS)


# Expert-parallel ranks join from other hosts the same way.

@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory, smol_f32: LoadedModel) -> LoadedModel:
    directory = tmp_path_factory.mktemp("tiny-qwen3-moe-hosts")
    save_tiny("qwen3_moe", directory, smol_f32, num_hidden_layers=4)
    return load_model(str(directory), torch.float32)


def test_an_expert_parallel_rank_from_another_host_computes_its_experts(
        tiny_moe: LoadedModel, prompts: list[list[int]]) -> None:
    single = LLM(tiny_moe, **SETTINGS)
    expected = [o.output_token_ids for o in single.generate(prompts, GREEDY)]
    address = f"127.0.0.1:{free_port()}"
    with stage_process(address, "--once") as stage:
        llm = LLM(tiny_moe, expert_parallel=2, stages_listen=address, **SETTINGS)
        try:
            runner = llm.engine.runner
            assert runner.processes == [] and runner.remote is not None
            num_experts = tiny_moe.config.num_experts
            # The remote rank read its own half of the routed experts, and only that.
            assert runner.ranks[1].experts == list(range(num_experts // 2, num_experts))
            outs = llm.generate(prompts, GREEDY)
            assert [o.output_token_ids for o in outs] == expected
            assert runner.seq_steps[1] > 0  # the remote rank ran sequences of its own
            error = kill_stage_mid_batch(llm.engine, prompts, runner.rank_pids[0])
            assert isinstance(error, EngineDied) and "expert-parallel rank" in str(error)
        finally:
            llm.close()
        assert stage.wait(60) != 0
