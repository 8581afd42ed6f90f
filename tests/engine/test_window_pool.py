"""Sliding-window layers keep only the blocks their window reaches (window_pool.py): the tiny
Gemma 3 and gpt-oss checkpoints (window 8, one full layer between two sliding ones) generate
the same tokens with and without it, hold a bounded number of window blocks however long a
sequence grows, reuse a cached prefix's window blocks, and a named shape fits several times
the sequences of one pool over every layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minimill.bench.kv_capacity import capacity
from minimill.engine.block_manager import BlockManager
from minimill.engine.config import EngineConfig
from minimill.engine.llm import LLM
from minimill.engine.params import SamplingParams
from minimill.engine.sequence import Sequence
from minimill.engine.window_pool import WindowLayout, chunk_bound, first_live_block
from minimill.models.loader import load_model
from minimill.models.shapes import NAMED_SHAPES
from minimill.models.types import LoadedModel
from tiny_hf import VOCAB, WINDOW, save_tiny

BS = 16


@pytest.fixture(scope="module", params=["gemma3", "gpt_oss"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         smol_f32: LoadedModel) -> Path:
    directory = tmp_path_factory.mktemp(f"window-{request.param}")
    save_tiny(request.param, directory, smol_f32)
    return directory


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def _llm(directory: Path, **overrides: object) -> LLM:
    return LLM(load_model(str(directory), torch.float32), dtype="float32", num_kv_blocks=96,
               kernels="native", **overrides)


def test_layouts_of_the_named_shapes() -> None:
    gemma = WindowLayout.of(NAMED_SHAPES["gemma3-1b"])
    assert gemma is not None  # 22 sliding layers and 4 full: 6 groups of 4 beside the full
    assert (gemma.group_layers, gemma.window_groups, gemma.window) == (4, 6, 512)
    assert sorted(gemma.places) == sorted(set(gemma.places))  # no two layers share a place
    oss = WindowLayout.of(NAMED_SHAPES["gpt-oss-20b"])
    assert oss is not None and (oss.group_layers, oss.window_groups) == (12, 1)
    assert WindowLayout.of(NAMED_SHAPES["qwen3-0.6b"]) is None


def test_long_generation_holds_a_bounded_window_and_matches_one_pool(tiny: Path) -> None:
    prompt = _prompt(5, 45)
    params = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True, top_logprobs=3)
    windowed = _llm(tiny)
    assert windowed.engine.runner.window_layout is not None
    core = windowed.engine
    core.add_request("long", prompt, params)
    bm = core.scheduler.block_manager
    assert bm.window is not None
    most_held = 0
    while core.has_unfinished:
        core.step()
        for seq in core.scheduler.running:
            most_held = max(most_held, bm.window.held(seq))
            first = first_live_block(seq.num_computed_tokens, WINDOW, BS)
            assert all(b is None for b in seq.window_table[:first])
    # 195 tokens of context, 13 blocks for the full layer; decoding holds at most 2 window
    # blocks (a window of 8 spans the block boundary), the prompt's chunk a few more.
    assert 0 < most_held <= -(-(WINDOW - 1 + len(prompt)) // BS) + 2
    assert bm.num_free_blocks == bm.num_blocks  # everything back when it finished

    out = windowed.generate([prompt], params)[0]
    one_pool = _llm(tiny, window_pool=False)
    assert one_pool.engine.runner.window_layout is None
    ref = one_pool.generate([prompt], params)[0]
    assert out.output_token_ids == ref.output_token_ids
    assert out.logprobs is not None and ref.logprobs is not None
    assert [lp.logprob for lp in out.logprobs] == [lp.logprob for lp in ref.logprobs]


def test_a_batch_with_long_and_short_sequences_matches_one_pool(tiny: Path) -> None:
    prompts = [_prompt(7, 60), _prompt(8, 5), _prompt(9, 33)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    windowed = [o.output_token_ids for o in _llm(tiny).generate(prompts, params)]
    one_pool = [o.output_token_ids for o in _llm(tiny, window_pool=False).generate(
        prompts, params)]
    assert windowed == one_pool


def test_the_next_turn_reuses_the_window_blocks_of_the_last(tiny: Path) -> None:
    llm = _llm(tiny)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    turn1 = _prompt(21, 50)
    first = llm.generate([turn1], params)[0]
    turn2 = [*turn1, *first.output_token_ids, *_prompt(22, 20)]
    second = llm.generate([turn2], params)[0]
    # 62 tokens computed in turn 1: 3 full blocks cached, the window blocks too.
    assert second.num_cached_tokens == 3 * BS
    cold = _llm(tiny, enable_prefix_caching=False).generate([turn2], params)[0]
    assert second.output_token_ids == cold.output_token_ids


def test_a_prefix_is_reused_only_as_far_as_its_window_blocks_are_cached() -> None:
    layout = WindowLayout(group_layers=1, window_groups=2, window=20, places=((0, 0),) * 3)
    bm = BlockManager(40, BS, window=layout, max_chunk=64)
    assert bm.window is not None
    tokens = list(range(100, 180))  # 5 full blocks
    seq = Sequence("a", tokens, SamplingParams(), 0, frozenset())
    assert bm.allocate_slots(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(seq)
    # The window (20 tokens) still reaches blocks 3 and 4 only: blocks 0..2 went back.
    assert [wb is None for wb in seq.window_table] == [True, True, True, False, False]
    bm.free(seq)

    again = Sequence("b", [*tokens, 7], SamplingParams(), 0, frozenset())
    assert len(bm.find_prefix(again).block_ids) == 5
    # Window blocks are cached when full, before the window passes them: a shorter prefix
    # (its next query at 48 reads blocks 1 and 2) finds them too.
    shorter = Sequence("c", [*tokens[:48], 7], SamplingParams(), 0, frozenset())
    assert len(bm.find_prefix(shorter).block_ids) == 3
    # Once a pool block of window block 1 is handed out again, the prefixes whose next
    # query reads block 1 are cut to what their window finds: 1 block (its query at 16
    # reads block 0 only); the longer one still finds blocks 3 and 4.
    hashes = bm._prefix_hashes(bm.find_prefix(again))
    window_block_1 = bm.window._cached[hashes[1]][0]
    bm.window.forget(window_block_1[1])
    assert len(bm.find_prefix(shorter).block_ids) == 1
    assert len(bm.find_prefix(again).block_ids) == 5


def test_a_long_prompt_is_admitted_within_the_chunk_bound() -> None:
    layout = WindowLayout(group_layers=1, window_groups=2, window=20, places=((0, 0),) * 3)
    bound = chunk_bound(20, 32, BS)
    # Room for the prompt's full blocks and the window blocks of one chunk, not of the whole
    # prompt: computed chunk by chunk, it gives window blocks back as it goes.
    bm = BlockManager(20 + 2 * bound, BS, window=layout, max_chunk=32)
    seq = Sequence("long", list(range(320)), SamplingParams(), 0, frozenset())
    assert bm.can_allocate(seq, 320)
    for _ in range(10):
        assert bm.allocate_slots(seq, 32)
        seq.num_computed_tokens += 32
        bm.cache_full_blocks(seq)
    assert bm.window is not None and bm.window.held(seq) <= bound


def test_a_named_shape_fits_several_times_the_sequences_of_one_pool() -> None:
    report = capacity(NAMED_SHAPES["gemma3-1b"], "bfloat16", ("int8",), 2 << 30, 32768)
    for kv_dtype in ("bfloat16", "int8"):
        row = report["kv"][kv_dtype]
        assert row["sequences_at_budget"] >= 4 * row["one_pool_sequences_at_budget"] > 0
    # A pool of 512 MiB: one group of every layer holds one 20k-token sequence; grouped, one
    # of the model's whole 32k context fits beside the window blocks of a prompt's chunk.
    config = EngineConfig(dtype="bfloat16", device="cpu", kv_cache_memory_bytes=512 << 20,
                          model_config=NAMED_SHAPES["gemma3-1b"])
    one_pool = EngineConfig(dtype="bfloat16", device="cpu", kv_cache_memory_bytes=512 << 20,
                            window_pool=False, model_config=NAMED_SHAPES["gemma3-1b"])
    assert one_pool.max_model_len == 1260 * BS
    assert config.max_model_len == NAMED_SHAPES["gemma3-1b"].max_position_embeddings


def test_int4_kv_is_refused_for_sliding_layers_by_name() -> None:
    from minimill.engine.params import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="int4 does not support sliding-window"):
        EngineConfig(dtype="bfloat16", device="cpu", kv_dtype="int4",
                     model_config=NAMED_SHAPES["gpt-oss-20b"])
