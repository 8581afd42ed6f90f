"""Scheduling decisions without a model: budgets, chunking, ordering, preemption, stops."""

from __future__ import annotations

from minimill.engine.config import EngineConfig
from minimill.engine.params import SamplingParams
from minimill.engine.scheduler import ModelOutput, Scheduler, SchedulerOutput
from minimill.engine.sequence import RequestStatus, Sequence
from minimill.models.types import ModelConfig

MODEL = ModelConfig(architecture="llama", vocab_size=100, hidden_size=8, intermediate_size=16,
                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=4, rms_norm_eps=1e-5, rope_theta=10000.0,
                    max_position_embeddings=512, tie_word_embeddings=True)


def make_scheduler(**overrides: int | bool) -> Scheduler:
    settings = {"block_size": 4, "num_kv_blocks": 64, "max_num_batched_tokens": 16,
                "max_num_seqs": 8, **overrides}
    return Scheduler(EngineConfig(device="cpu", model_config=MODEL, **settings))  # type: ignore[arg-type]


def add(s: Scheduler, request_id: str, prompt_len: int, max_tokens: int = 4,
        eos: frozenset[int] = frozenset()) -> Sequence:
    seq = Sequence(request_id, list(range(1, prompt_len + 1)),
                   SamplingParams(max_tokens=max_tokens), seed=0, eos_token_ids=eos)
    s.add_request(seq)
    return seq


def run_step(s: Scheduler, token: int = 50) -> SchedulerOutput:
    out = s.schedule()
    sampled = [token for e in out.scheduled if e.sample]
    s.update_from_output(out, ModelOutput(sampled, [None] * len(sampled)))
    return out


def test_budget_chunks_a_long_prompt_and_decodes_come_first() -> None:
    s = make_scheduler()
    long = add(s, "long", 40)
    out = run_step(s)
    assert [(e.seq.request_id, e.num_new_tokens, e.sample) for e in out.scheduled] == [
        ("long", 16, False)]
    short = add(s, "short", 3)
    out = run_step(s)  # the running prompt takes the whole budget: short must wait
    assert [(e.seq.request_id, e.num_new_tokens) for e in out.scheduled] == [("long", 16)]
    out = run_step(s)  # long's last 8 tokens, then short fits in the rest
    assert [(e.seq.request_id, e.num_new_tokens, e.sample) for e in out.scheduled] == [
        ("long", 8, True), ("short", 3, True)]
    assert long.num_computed_tokens == 40 and long.num_output_tokens == 1
    out = run_step(s)  # both decode
    assert [(e.seq.request_id, e.num_new_tokens) for e in out.scheduled] == [
        ("long", 1), ("short", 1)]
    assert short.status == RequestStatus.RUNNING


def test_every_step_respects_the_token_budget_and_all_finish() -> None:
    s = make_scheduler()
    seqs = [add(s, f"r{i}", 5 + 3 * i, max_tokens=6) for i in range(8)]
    for _ in range(200):
        if not s.has_unfinished:
            break
        out = run_step(s)
        assert out.num_batched_tokens == sum(e.num_new_tokens for e in out.scheduled)
        assert out.num_batched_tokens <= 16
        assert len(s.running) <= 8
    assert not s.has_unfinished
    assert all(q.status == RequestStatus.FINISHED_LENGTH and q.num_output_tokens == 6
               for q in seqs)
    assert s.block_manager.num_free_blocks == 64


def test_max_num_seqs_caps_the_running_set() -> None:
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(4):
        add(s, f"r{i}", 3)
    run_step(s)
    assert [q.request_id for q in s.running] == ["r0", "r1"]
    assert len(s.waiting) == 2


def test_short_kv_preempts_the_newest_and_recomputes_it_later() -> None:
    # 6 blocks of 4 tokens; three 7-token prompts growing by 6 tokens cannot all fit.
    s = make_scheduler(num_kv_blocks=6, max_num_batched_tokens=32)
    seqs = [add(s, f"r{i}", 7, max_tokens=6) for i in range(3)]
    preempted: list[str] = []
    for _ in range(100):
        if not s.has_unfinished:
            break
        out = run_step(s)
        preempted += out.preempted
    assert preempted and preempted[0] == "r2"  # the most recently admitted gives way
    assert s.num_preemptions == len(preempted)
    assert all(q.status == RequestStatus.FINISHED_LENGTH and q.num_output_tokens == 6
               for q in seqs)
    assert s.block_manager.num_free_blocks == 6


def test_a_long_prompt_waits_until_all_of_it_fits() -> None:
    """A prompt longer than a step's budget is admitted only when the pool holds all of it,
    not just its first chunk: admitted in part, it would preempt itself at its next chunk and
    (without prefix reuse) compute the first one again and again."""
    # 10 blocks of 4 tokens; a 16-token prompt holds 4, and 5 once it decodes.
    s = make_scheduler(num_kv_blocks=10, max_num_batched_tokens=16,
                       enable_prefix_caching=False)
    first = add(s, "first", 16, max_tokens=4)
    run_step(s)
    assert first.num_computed_tokens == 16 and s.block_manager.num_free_blocks == 6
    long = add(s, "long", 28, max_tokens=2)  # 7 blocks: only its first 15-token chunk fits
    for _ in range(2):
        out = run_step(s)
        assert [e.seq.request_id for e in out.scheduled] == ["first"]
        assert long.status == RequestStatus.WAITING and not long.block_table
    run_step(s)  # first finishes and frees its blocks
    assert first.status == RequestStatus.FINISHED_LENGTH
    out = run_step(s)
    assert [(e.seq.request_id, e.num_new_tokens) for e in out.scheduled] == [("long", 16)]
    for _ in range(10):
        if not s.has_unfinished:
            break
        run_step(s)
    assert long.status == RequestStatus.FINISHED_LENGTH and s.num_preemptions == 0


def test_eos_and_abort_free_blocks() -> None:
    s = make_scheduler()
    a = add(s, "a", 5, max_tokens=10, eos=frozenset({7}))
    b = add(s, "b", 5, max_tokens=10)
    run_step(s, token=7)
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert a.status.finish_reason is not None and a.status.finish_reason.value == "stop"
    assert s.abort_request("b") is b
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert s.abort_request("b") is None
    assert not s.has_unfinished and s.block_manager.num_free_blocks == 64


def test_statuses_are_ordered() -> None:
    assert RequestStatus.WAITING < RequestStatus.RUNNING < RequestStatus.PREEMPTED
    assert not RequestStatus.PREEMPTED.is_finished
    assert all(st.is_finished for st in (RequestStatus.FINISHED_STOPPED,
                                         RequestStatus.FINISHED_LENGTH,
                                         RequestStatus.FINISHED_ABORTED))


def test_a_lane_schedules_only_its_own_requests_within_its_share() -> None:
    # Blocks of 8: the prompts (alike) fill none, so none waits to reuse another's.
    s = make_scheduler(max_num_seqs=8, max_num_batched_tokens=16, block_size=8)
    for i in range(10):
        add(s, f"r{i}", 4, max_tokens=8)
    lane0 = s.schedule(0, 2)  # half of each budget: 8 tokens, 4 requests
    assert [e.seq.request_id for e in lane0.scheduled] == ["r0", "r1"]
    assert lane0.num_batched_tokens == 8
    lane1 = s.schedule(1, 2)  # runs while lane 0's step does: takes none of lane 0's
    assert [e.seq.request_id for e in lane1.scheduled] == ["r2", "r3"]
    assert {q.request_id: q.lane for q in s.running} == {"r0": 0, "r1": 0, "r2": 1, "r3": 1}
    for out in (lane0, lane1):
        sampled = [50 for e in out.scheduled if e.sample]
        s.update_from_output(out, ModelOutput(sampled, [None] * len(sampled)))
    # Each lane decodes its own, then admits new ones (the last one's prompt in part).
    lane1 = s.schedule(1, 2)
    assert [e.seq.request_id for e in lane1.scheduled] == ["r2", "r3", "r4", "r5"]
    assert [e.num_new_tokens for e in lane1.scheduled] == [1, 1, 4, 2]
    lane0 = s.schedule(0, 2)  # at most 4 running in a lane
    assert [e.seq.request_id for e in lane0.scheduled] == ["r0", "r1", "r6", "r7"]


def test_a_lane_with_many_more_requests_gives_half_the_difference_away() -> None:
    s = make_scheduler(max_num_seqs=64, max_num_batched_tokens=256, num_kv_blocks=256)
    seqs = [add(s, f"r{i}", 3, max_tokens=50) for i in range(40)]
    run_step(s)  # whole steps: no lanes yet
    assert all(q.lane == -1 for q in seqs)
    for q in seqs[:30]:
        q.lane = 0
    for q in seqs[30:]:
        q.lane = 1
    out = s.schedule(0, 2)  # 30 against 10: the 10 newest of lane 0 move to lane 1
    assert len(out.scheduled) == 20
    assert sum(q.lane == 1 for q in seqs) == 20
    assert [q.lane for q in seqs[20:30]] == [1] * 10
