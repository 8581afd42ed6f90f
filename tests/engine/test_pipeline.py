"""Pipeline stages inside one site (engine/pipeline_runner.py): real stage processes joined
by torch.distributed (gloo), against the single-process engine on the same weights."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from stage_kill import kill_stage_mid_batch

from minimill.engine.core import EngineCore
from minimill.engine.llm import LLM
from minimill.engine.params import EngineDied, InvalidRequestError, SamplingParams
from minimill.models.grammar import GuidedDecoding
from minimill.models.types import LoadedModel

# Long enough that requests are still running when the test adds more, or kills a stage.
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SETTINGS = {"dtype": "float32", "num_kv_blocks": 96, "num_threads": 1}


@pytest.fixture(scope="module")
def prompts(tiny_llama: LoadedModel) -> list[list[int]]:
    text = ("Pipelines keep every stage busy while the others work on earlier microbatches "
            "of the same running batch, one step behind another.")
    ids = tiny_llama.tokenizer.encode(text, add_special_tokens=True)
    # Different lengths: a chunk of one block, several blocks, a single token.
    return [ids[:5], ids, ids[:17], ids[:1], ids[3:30], ids[:9]]


@pytest.fixture(scope="module")
def reference(tiny_llama: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(tiny_llama, **SETTINGS)
    return [out.output_token_ids for out in llm.generate(prompts, GREEDY)]


def _run_continuous(core: EngineCore, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Half the prompts first; the rest join once the first have tokens (while they run)."""
    tokens: dict[str, list[int]] = {}
    half = len(prompts) // 2
    for i in range(half):
        core.add_request(f"r{i}", prompts[i], GREEDY)
    added = False
    while core.has_unfinished or not added:
        for delta in core.step().deltas:
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        if not added and sum(map(len, tokens.values())) >= 4:
            for i in range(half, len(prompts)):
                core.add_request(f"r{i}", prompts[i], GREEDY)
            added = True
    return tokens


@pytest.mark.parametrize("stages", [2, 3])
def test_greedy_output_is_the_single_engine_s_with_requests_joining_mid_run(
        tiny_llama: LoadedModel, prompts: list[list[int]], reference: list[list[int]],
        stages: int) -> None:
    llm = LLM(tiny_llama, pipeline_stages=stages, **SETTINGS)
    try:
        runner = llm.engine.runner
        assert runner.pipelined and runner.num_lanes == stages
        # Every layer in one stage, in order (the last has fewer: it also projects onto the
        # tokenizer's 49k vocabulary, most of this tiny model's work).
        layers = [i for r in runner.plan.layers for i in r]
        assert layers == list(range(6)) and all(runner.plan.layers)
        assert all(p.is_alive() for p in runner.processes)
        tokens = _run_continuous(llm.engine, prompts)
        assert [tokens[f"r{i}"] for i in range(len(prompts))] == reference
        # Whole batches through LLM.generate too.
        outs = llm.generate(prompts, GREEDY)
        assert [o.output_token_ids for o in outs] == reference
        # Microbatches overlapped: several were in flight, every stage ran every one.
        stats = runner.stage_stats()
        assert [s["stage"] for s in stats] == list(range(stages))
        assert len({s["steps"] for s in stats}) == 1
        assert stats[0]["steps"] >= 2 * GREEDY.max_tokens
    finally:
        llm.close()
    assert all(p.exitcode == 0 for p in runner.processes)


def test_smollm2_greedy_over_two_stages_is_the_single_engine_s(smol_f32: LoadedModel) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):",
               "Once upon a time, in a land far away, there lived a"]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    single = LLM(smol_f32, **SETTINGS)
    expected = [o.output_token_ids for o in single.generate(prompts, params)]
    llm = LLM(smol_f32, pipeline_stages=2, **SETTINGS)
    try:
        assert [o.output_token_ids for o in llm.generate(prompts, params)] == expected
    finally:
        llm.close()


@pytest.fixture
def two_stages(tiny_llama: LoadedModel) -> Iterator[LLM]:
    llm = LLM(tiny_llama, pipeline_stages=2, **SETTINGS)
    yield llm
    llm.close()


def test_a_stage_killed_mid_batch_stops_the_engine_and_every_stage(
        two_stages: LLM, prompts: list[list[int]]) -> None:
    core, runner = two_stages.engine, two_stages.engine.runner
    error = kill_stage_mid_batch(core, prompts, runner.stage_pids[0])
    assert isinstance(error, EngineDied)
    assert "stage 1" in str(error)
    assert all(not p.is_alive() for p in runner.processes)
    with pytest.raises(EngineDied):
        core.step()
    two_stages.close()  # after a death too


def test_what_stages_do_not_run_yet_is_refused_by_name(
        tiny_llama: LoadedModel, two_stages: LLM, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="KV tiers"):
        LLM(tiny_llama, pipeline_stages=2, dtype="float32", kv_flash_dir=str(tmp_path),
            kv_flash_bytes=1 << 20)
    with pytest.raises(InvalidRequestError, match="exceeds the model's 6 decoder layers"):
        LLM(tiny_llama, pipeline_stages=7, dtype="float32")



def test_guided_output_over_stages_is_the_single_engine_s(
        tiny_llama: LoadedModel, two_stages: LLM) -> None:
    # The grammar's bitmasks are filled by stage 0 and applied where the last stage samples.
    schema = ('{"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, '
              '"rank": {"type": "integer"}}, "required": ["city", "rank"], '
              '"additionalProperties": false}')
    params = SamplingParams(max_tokens=40, temperature=0.0,
                            guided=GuidedDecoding(json_schema=schema))
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["A city as JSON:", "Another one:", "Tell me more"]
    mixed = [params, params, free]
    single = LLM(tiny_llama, **SETTINGS)
    expected = [o.output_token_ids for o in single.generate(prompts, mixed)]
    outs = two_stages.generate(prompts, mixed)
    assert [o.output_token_ids for o in outs] == expected
    for out in outs[:2]:
        assert set(json.loads(out.text)) == {"city", "rank"}


def test_embeddings_over_stages_are_the_single_engine_s(
        tiny_llama: LoadedModel, two_stages: LLM) -> None:
    # Pooled on the last stage, beside requests that sample in the same steps.
    texts = ["tidal energy", "a much longer sentence about the rivers of a country", "x"]
    single = LLM(tiny_llama, **SETTINGS)
    expected = single.embed(texts)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    sampled = single.generate(texts, greedy)
    mixed = two_stages.generate(texts * 2, [SamplingParams(embed=True)] * 3 + [greedy] * 3)
    assert [o.embedding for o in mixed[:3]] == expected
    assert [o.output_token_ids for o in mixed[3:]] == [o.output_token_ids for o in sampled]
    assert two_stages.embed(texts) == expected


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quantized_kv_over_stages_is_the_single_engine_s(
        tiny_llama: LoadedModel, prompts: list[list[int]], kv_dtype: str) -> None:
    # int4 also stages each open block (kv_int4.py): the units go with the step.
    single = LLM(tiny_llama, kv_dtype=kv_dtype, **SETTINGS)
    expected = [o.output_token_ids for o in single.generate(prompts, GREEDY)]
    llm = LLM(tiny_llama, pipeline_stages=2, kv_dtype=kv_dtype, **SETTINGS)
    try:
        assert [o.output_token_ids for o in llm.generate(prompts, GREEDY)] == expected
    finally:
        llm.close()
