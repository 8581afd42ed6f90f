"""A big CPU step split across cores (engine/core_split.py) computes what the whole step
computes: the same tokens and logprobs bit for bit, in the step's order; and the KV pool can be
backed with memory at start."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from engine_helpers import PROMPTS

from minimill.engine.attention import allocate_kv_cache
from minimill.engine.core_split import MIN_ROWS_PER_GROUP, core_workers, plan_groups
from minimill.engine.llm import LLM
from minimill.engine.params import SamplingParams
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


@needs_two_cores
@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "int4"])
def test_split_steps_give_the_tokens_and_logprobs_of_whole_steps(
        smol_f32: LoadedModel, kv_dtype: str) -> None:
    split = LLM(smol_f32, dtype="float32", kv_dtype=kv_dtype, num_kv_blocks=512,
                max_model_len=1024)
    whole = LLM(smol_f32, dtype="float32", kv_dtype=kv_dtype, num_kv_blocks=512,
                max_model_len=1024, split_steps=False)
    if split.engine.runner.workers is None:
        pytest.skip(f"no split with kernels {split.engine.runner.kernels.name}")
    tok = split.tokenizer
    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)] + " " + "word " * (i % 23))
               for i in range(80)]
    # Greedy and seeded sampling, logprobs for everything.
    params = [SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.9, seed=i,
                             top_logprobs=3) for i in range(80)]
    got = split.generate(prompts, params, use_tqdm=False)
    want = whole.generate(prompts, params, use_tqdm=False)
    assert split.engine.runner.split_steps > 0
    assert whole.engine.runner.split_steps == 0
    for g, w in zip(got, want, strict=True):
        assert g.output_token_ids == w.output_token_ids
        assert g.logprobs is not None and w.logprobs is not None
        assert [lp.top for lp in g.logprobs] == [lp.top for lp in w.logprobs]


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
