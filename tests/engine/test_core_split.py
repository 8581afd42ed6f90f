"""A big CPU step split across cores (engine/core_split.py), and lanes that each step their own
requests on their own core (engine/core.py), compute what the whole step computes: the same
tokens and logprobs bit for bit; and the KV pool can be backed with memory at start."""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import threading
import time
import weakref

import pytest
import torch
from engine_helpers import PROMPTS

from minimill.engine.attention import allocate_kv_cache
from minimill.engine.core_split import MIN_ROWS_PER_GROUP, core_workers, plan_groups
from minimill.engine.llm import LLM
from minimill.engine.params import FinishReason, RequestOutput, SamplingParams
from minimill.models.types import LoadedModel

needs_two_cores = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="a split needs two cores")


def test_plan_balances_sequences_longest_first() -> None:
    costs = [10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0]
    groups = plan_groups(costs, [40] * 8, 2)
    assert groups is not None
    assert sorted(i for g in groups for i in g) == list(range(8))
    loads = [sum(costs[i] for i in g) for g in groups]
    assert abs(loads[0] - loads[1]) <= 2.0
    assert all(g == sorted(g) for g in groups)  # each group keeps the step's order


def test_plan_keeps_small_or_lopsided_steps_whole() -> None:
    # Too few rows for each core to be compute-bound.
    assert plan_groups([1.0] * 10, [1] * 10, 2) is None
    # One long prompt chunk next to a few decodes cannot be shared.
    assert plan_groups([2048.0, 1.0, 1.0], [2048, 1, 1], 2) is None
    # Fewer sequences than cores.
    assert plan_groups([500.0], [500], 2) is None
    rows = [MIN_ROWS_PER_GROUP] * 2
    assert plan_groups([1.0, 1.0], rows, 2) == [[0], [1]]


@needs_two_cores
def test_workers_run_one_thread_each_and_raise_what_failed() -> None:
    from minimill.engine.kernels import CpuKernels
    from minimill.engine.native import load_cpu_kernels

    if not load_cpu_kernels().available:
        pytest.skip("no compiler for the CPU kernels")
    kernels = CpuKernels()
    workers = core_workers(sorted(os.sched_getaffinity(0))[:2], False, kernels.init_thread)
    main_threads = torch.get_num_threads()

    def after_a_kernel() -> tuple[int, int]:
        kernels.silu_and_mul(torch.ones(64, 64))  # a kernel's first call keeps the count
        return torch.get_num_threads(), threading.get_ident()

    (n0, t0), (n1, t1) = workers.map([after_a_kernel, after_a_kernel])
    assert (n0, n1) == (1, 1)
    assert t0 != t1
    assert torch.get_num_threads() == main_threads

    def fails() -> int:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        workers.map([after_a_kernel, fails])
    assert workers.map([lambda: 7, lambda: 8]) == [7, 8]


def test_an_idle_core_holds_nothing_of_its_last_job() -> None:
    """The cores' threads live as long as the process; a job's closure holds its engine's
    runner. Held after the job, an engine dropped after its last split step kept its weights
    and KV pool (a float32 mixture of experts beside vLLM was killed for its memory)."""
    workers = core_workers(sorted(os.sched_getaffinity(0))[:2], False, lambda: None)

    class Engine:
        pass

    engine = Engine()
    alive = weakref.ref(engine)
    answered = threading.Event()

    def step(engine: Engine = engine) -> int:
        return id(engine)

    workers.submit(0, step, lambda ok, value: answered.set())
    assert answered.wait(30)
    del engine, step
    deadline = time.monotonic() + 30
    while alive() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)  # the core lets go of the job just after it answers
    assert alive() is None


def _mixed_requests(llm: LLM, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    tok = llm.tokenizer
    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)] + " " + "word " * (i % 23))
               for i in range(n)]
    # Greedy and seeded sampling, logprobs for everything.
    params = [SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.9, seed=i,
                             top_logprobs=3) for i in range(n)]
    return prompts, params


def _assert_same(got: list[RequestOutput], want: list[RequestOutput]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.output_token_ids == w.output_token_ids
        assert g.logprobs is not None and w.logprobs is not None
        assert [lp.top for lp in g.logprobs] == [lp.top for lp in w.logprobs]


@needs_two_cores
@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "int4"])
def test_split_steps_and_lanes_give_the_tokens_and_logprobs_of_whole_steps(
        smol_f32: LoadedModel, kv_dtype: str) -> None:
    # int4 reads a step's own tokens at full precision and earlier ones through the cache, so
    # its numbers depend on where a prompt's chunks end and on whether a prefix was found
    # cached; lanes (each with half the step's token budget) admit and cut prompts
    # differently from whole steps. For int4 every prompt is one chunk and nothing is reused.
    int4 = {"enable_prefix_caching": False, "max_num_batched_tokens": 8192}
    make = functools.partial(LLM, smol_f32, dtype="float32", kv_dtype=kv_dtype,
                             num_kv_blocks=512, max_model_len=1024,
                             **(int4 if kv_dtype == "int4" else {}))
    whole = make(split_steps=False)
    split = make(lanes=False)
    if split.engine.runner.workers is None:
        pytest.skip(f"no split with kernels {split.engine.runner.kernels.name}")
    prompts, params = _mixed_requests(whole, 80)  # 80: enough for lanes on two cores
    want = whole.generate(prompts, params)
    _assert_same(split.generate(prompts, params), want)
    split.close()
    lanes = make()
    _assert_same(lanes.generate(prompts, params), want)
    assert split.engine.runner.split_steps > 0 and split.engine.runner.lane_steps == 0
    assert whole.engine.runner.split_steps == 0 and whole.engine.runner.lane_steps == 0
    assert lanes.engine.runner.lane_steps > 0


@needs_two_cores
def test_lanes_preempt_and_recompute_their_own_requests(smol_f32: LoadedModel) -> None:
    # A pool too small for all: lanes preempt their newest requests and recompute them later,
    # with the tokens a roomy engine gives.
    tight = LLM(smol_f32, dtype="float32", num_kv_blocks=100, max_model_len=512)
    if tight.engine.runner.workers is None:
        pytest.skip(f"no lanes with kernels {tight.engine.runner.kernels.name}")
    roomy = LLM(smol_f32, dtype="float32", num_kv_blocks=512, max_model_len=512,
                split_steps=False)
    prompts, params = _mixed_requests(roomy, 72)
    params = [dataclasses.replace(p, max_tokens=24) for p in params]
    want = roomy.generate(prompts, params)
    got = tight.generate(prompts, params)
    _assert_same(got, want)
    assert tight.engine.runner.lane_steps > 0
    assert tight.engine.scheduler.num_preemptions > 0
    bm = tight.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every block came back


@needs_two_cores
def test_abort_during_a_lane_step_frees_the_request_when_the_step_ends(
        smol_f32: LoadedModel) -> None:
    llm = LLM(smol_f32, dtype="float32", num_kv_blocks=512, max_model_len=512)
    core = llm.engine
    if core.runner.workers is None:
        pytest.skip(f"no lanes with kernels {core.runner.kernels.name}")
    prompts, params = _mixed_requests(llm, 72)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(f"r{i}", prompt, p)
    # Whole steps until enough requests run, then lanes: after a step both are running again.
    later: list[str] = []
    for _ in range(10):
        later += [d.request_id for d in core.step().deltas]
        if core._in_flight:
            break
    running = [e.seq.request_id for out in core._in_flight.values() for e in out.scheduled]
    assert running
    victim = running[0]
    delta = core.abort_request(victim)
    assert delta is not None and delta.finish_reason == FinishReason.ABORT
    assert victim in core.scheduler.requests  # its lane's step still writes its KV
    later = [r for r in later if r != victim]
    while core.has_unfinished:
        later += [d.request_id for d in core.step().deltas]
    assert victim not in later and victim not in core.scheduler.requests
    assert len(set(later)) == 71
    bm = core.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_prefault_backs_the_pool_at_start() -> None:
    # 64 MiB: [blocks, layers, 2, kv heads, 16 * 64] float32.
    shape = dict(num_blocks=128, num_layers=8, num_kv_heads=2, block_size=16, head_dim=64,
                 dtype=torch.float32, device=torch.device("cpu"))
    before = _rss_kib()
    lazy = allocate_kv_cache(**shape)  # type: ignore[arg-type]
    grew_lazy = _rss_kib() - before
    before = _rss_kib()
    backed = allocate_kv_cache(**shape, prefault=True)  # type: ignore[arg-type]
    grew_backed = _rss_kib() - before
    size_kib = backed.numel() * 4 // 1024
    assert grew_lazy < size_kib // 4
    assert grew_backed >= size_kib * 9 // 10
    assert not backed.any() and not lazy.any()  # zeroed either way
