"""Expert parallelism inside one site (engine/expert_parallel.py): real rank processes, each
reading its own experts from a tiny random checkpoint and joined by torch.distributed
(gloo), against the single-process engine on the same weights, in float32."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from stage_kill import kill_stage_mid_batch

from minimill.engine.core import EngineCore
from minimill.engine.engine_process import ProcessEngine
from minimill.engine.expert_parallel import ExpertParallelRunner
from minimill.engine.expert_share import ExpertShare
from minimill.engine.llm import LLM
from minimill.engine.params import (
    EngineDied,
    EngineError,
    InvalidRequestError,
    SamplingParams,
)
from minimill.models.loader import load_model
from minimill.models.types import LoadedModel
from tiny_hf import VOCAB, save_tiny

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SETTINGS = {"dtype": "float32", "num_kv_blocks": 96, "num_threads": 1}
NUM_EXPERTS = 8


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory, smol_f32: LoadedModel) -> Path:
    directory = tmp_path_factory.mktemp("tiny-qwen3-moe")
    save_tiny("qwen3_moe", directory, smol_f32, num_hidden_layers=4)
    return directory


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory: pytest.TempPathFactory, smol_f32: LoadedModel) -> Path:
    directory = tmp_path_factory.mktemp("tiny-deepseek-v3")
    save_tiny("deepseek_v3", directory, smol_f32)
    return directory


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    # Past one KV block (16 tokens), within one, a single token.
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (45, 5, 23, 1, 33)]


def _prefix_and_longer() -> tuple[list[int], list[int]]:
    """A prompt of two KV blocks and more, and that prompt with more after it."""
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(3, VOCAB, (40,), generator=g).tolist()
    return prefix, prefix + torch.randint(3, VOCAB, (9,), generator=g).tolist()


def _reference(directory: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(load_model(str(directory), torch.float32), **SETTINGS)
    return [out.output_token_ids for out in llm.generate(prompts, GREEDY)]


def _run_continuous(core: EngineCore, prompts: list[list[int]]) -> list[list[int]]:
    """The first two prompts; the rest join once the first have tokens (while they run)."""
    tokens: dict[str, list[int]] = {}
    for i in range(2):
        core.add_request(f"r{i}", prompts[i], GREEDY)
    added = False
    while core.has_unfinished or not added:
        for delta in core.step().deltas:
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        if not added and sum(map(len, tokens.values())) >= 4:
            for i in range(2, len(prompts)):
                core.add_request(f"r{i}", prompts[i], GREEDY)
            added = True
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("ranks", [2, 3])
def test_greedy_output_is_the_single_engine_s_and_each_rank_read_its_experts_only(
        tiny_moe: Path, ranks: int) -> None:
    prompts = _prompts()
    prefix, longer = _prefix_and_longer()
    reference = _reference(tiny_moe, [*prompts, prefix, longer])
    everything = load_model(str(tiny_moe), torch.float32).weights
    llm = LLM(str(tiny_moe), expert_parallel=ranks, **SETTINGS)
    try:
        runner = llm.engine.runner
        assert isinstance(runner, ExpertParallelRunner)
        assert all(p.is_alive() for p in runner.processes)
        assert len(runner.ranks) == ranks and len(set(runner.rank_pids)) == ranks - 1
        held = []
        for rank, report in enumerate(runner.ranks):
            share = ExpertShare(rank, ranks, NUM_EXPERTS)
            # Its own contiguous range of experts, read from the checkpoint, and nothing
            # of the others' (rank 0, the engine's process, included); the final norm and
            # the vocabulary projection on rank 0 alone.
            assert report.experts == list(share.local)
            assert report.weight_bytes == sum(t.numel() * t.element_size()
                                              for name, t in everything.items() if share(name))
            held.extend(report.experts)
        assert sorted(held) == list(range(NUM_EXPERTS))
        assert not ExpertShare(1, ranks, NUM_EXPERTS)("lm_head.weight")
        assert runner.ranks[0].kv_bytes == runner.ranks[-1].kv_bytes > 0
        # One batch of every prompt; requests joining a running batch; one sequence alone
        # (fewer than the ranks).
        outs = llm.generate(prompts, GREEDY)
        assert [o.output_token_ids for o in outs] == reference[:5]
        # Five sequences admitted together: dealt over every rank.
        assert all(runner.seq_steps), runner.seq_steps
        assert _run_continuous(llm.engine, prompts) == reference[:5]
        assert llm.generate([prompts[0]], GREEDY)[0].output_token_ids == reference[0]
        # A prefix computed on rank 1 (the second of two sequences admitted together), then
        # a prompt that reuses it there; alone, on rank 0, it reuses none of rank 1's blocks.
        outs = llm.generate([prompts[3], prefix], GREEDY)
        assert outs[1].output_token_ids == reference[5]
        before = list(runner.seq_steps)
        out = llm.generate([prompts[3], longer], GREEDY)[1]
        assert out.num_cached_tokens == 32 and out.output_token_ids == reference[6]
        assert runner.seq_steps[1] > before[1]
        before = list(runner.seq_steps)
        out = llm.generate([longer], GREEDY)[0]
        assert out.num_cached_tokens == 0 and out.output_token_ids == reference[6]
        assert runner.seq_steps[0] > before[0] and runner.seq_steps[1:] == before[1:]
    finally:
        llm.close()
    assert all(p.exitcode == 0 for p in runner.processes)


def test_deepseek_v3_over_two_ranks_is_the_single_engine_s(tiny_deepseek: Path) -> None:
    """Shared experts, grouped routing, a dense first layer, MLA's latent cache."""
    prompts = _prompts()
    reference = _reference(tiny_deepseek, prompts)
    llm = LLM(str(tiny_deepseek), expert_parallel=2, **SETTINGS)
    try:
        assert [o.output_token_ids for o in llm.generate(prompts, GREEDY)] == reference
    finally:
        llm.close()


@pytest.fixture
def two_ranks(tiny_moe: Path) -> Iterator[LLM]:
    llm = LLM(str(tiny_moe), expert_parallel=2, **SETTINGS)
    yield llm
    llm.close()


def test_a_rank_killed_mid_generation_ends_the_engine_and_every_rank(two_ranks: LLM) -> None:
    core = two_ranks.engine
    runner = core.runner
    assert isinstance(runner, ExpertParallelRunner)
    error = kill_stage_mid_batch(core, _prompts(), runner.rank_pids[0])
    assert isinstance(error, EngineDied)
    assert "rank 1" in str(error)
    assert all(not p.is_alive() for p in runner.processes)
    with pytest.raises(EngineDied):
        core.step()
    two_ranks.close()  # after a death too


def test_what_expert_parallelism_does_not_run_is_refused_by_name(
        tiny_moe: Path, smol_f32: LoadedModel) -> None:
    with pytest.raises(InvalidRequestError, match=r"expert_parallel.*dense model"):
        LLM(smol_f32, expert_parallel=2, dtype="float32")
    with pytest.raises(InvalidRequestError, match=r"exceeds the model's 8 routed experts"):
        LLM(str(tiny_moe), expert_parallel=9, dtype="float32")
    with pytest.raises(InvalidRequestError, match=r"expert_parallel.*at least 1"):
        LLM(str(tiny_moe), expert_parallel=0, dtype="float32")
    with pytest.raises(InvalidRequestError, match=r"expert_parallel.*pipeline_stages"):
        LLM(str(tiny_moe), expert_parallel=2, pipeline_stages=2, dtype="float32")
    with pytest.raises(InvalidRequestError, match=r"expert_parallel.*kv_dtype int4"):
        LLM(str(tiny_moe), expert_parallel=2, kv_dtype="int4", dtype="float32")


def _spawned_children(pid: int) -> list[int]:
    """Processes `pid` started with spawn (its resource tracker is not one)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return [c for c in children
            if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def test_a_killed_rank_ends_the_engine_process_as_a_site_sees_it(tiny_moe: Path) -> None:
    """The path a site worker takes (fleet/engines.py): the engine process says why it died
    and exits; the worker then hands its leases back and exits with status 3."""
    engine = ProcessEngine(str(tiny_moe), expert_parallel=2, **SETTINGS)
    reasons: list[str] = []
    died = threading.Event()
    engine.on_death(lambda reason: (reasons.append(reason), died.set()))
    child = engine._process.pid
    assert child is not None
    ranks = _spawned_children(child)
    assert len(ranks) == 1

    async def main() -> BaseException | None:
        long = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
        try:
            async for _ in engine.generate("doomed", _prompts()[0], long):
                os.kill(ranks[0], signal.SIGKILL)
        except EngineError as exc:
            return exc
        return None

    try:
        error = asyncio.run(asyncio.wait_for(main(), 120))
        assert isinstance(error, EngineError)
        assert died.wait(60)
        assert "expert-parallel rank 1 ended (exit code -9)" in reasons[0], reasons
        engine._process.join(60)
        assert engine._process.exitcode is not None and engine._process.exitcode != 0
    finally:
        engine.close()


def test_random_weights_are_drawn_alike_on_every_rank(tiny_moe: Path) -> None:
    """Benchmarks' random weights: each rank draws the model from its seed and keeps its
    share, rank 0 too; the same tokens as one engine over the whole model of that seed."""
    from minimill.models.shapes import random_model

    shaped = load_model(str(tiny_moe), torch.float32)
    args = ("tiny (random weights)", shaped.config, torch.float32, shaped.tokenizer, 5)
    prompts = _prompts()
    single = LLM(random_model(*args), **SETTINGS)
    reference = [o.output_token_ids for o in single.generate(prompts, GREEDY)]
    share = random_model(*args, keep=ExpertShare(0, 2, NUM_EXPERTS))
    assert share.weights.keys() < random_model(*args).weights.keys()
    llm = LLM(share, expert_parallel=2, **SETTINGS)
    try:
        runner = llm.engine.runner
        assert isinstance(runner, ExpertParallelRunner)
        assert [r.experts for r in runner.ranks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert [o.output_token_ids for o in llm.generate(prompts, GREEDY)] == reference
    finally:
        llm.close()
