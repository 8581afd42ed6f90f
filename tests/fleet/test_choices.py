"""A lease's OpenAI body becomes per-choice jobs with OpenAI's defaults and reproducible seeds."""

from __future__ import annotations

from typing import Any

import pytest

from minimill.fleet.choices import BodyError, choice_jobs, derive_seed
from minimill.transport.protocol import Checkpoint, ChoiceProgress, Lease


def make_lease(body: dict[str, Any], kind: str = "chat", seed: int = 1234,
               checkpoint: Checkpoint | None = None) -> Lease:
    return Lease(request_id="req_1", lease_id="l_1", epoch=3, expires_at=0.0,
                 kind=kind,  # type: ignore[arg-type]
                 model="smollm2-135m", body=body, seed=seed, checkpoint=checkpoint)


CHAT = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}]}


def test_openai_defaults_apply_when_the_body_sets_nothing() -> None:
    [job] = choice_jobs(make_lease(CHAT), default_max_tokens=2048)
    assert job.params.temperature == 1.0
    assert job.params.top_p == 1.0
    assert job.params.max_tokens == 2048
    assert job.max_tokens_from_body is False
    assert job.params.seed == 1234  # the lease's seed, since the body has none
    assert job.engine_request_id == "req_1:3:0"


def test_body_parameters_reach_the_sampling_params() -> None:
    body = {**CHAT, "temperature": 0, "top_p": 0.5, "max_completion_tokens": 7, "seed": 9,
            "stop": "\n", "logprobs": True, "top_logprobs": 3}
    [job] = choice_jobs(make_lease(body), default_max_tokens=2048)
    p = job.params
    assert (p.temperature, p.top_p, p.max_tokens, p.seed) == (0.0, 0.5, 7, 9)
    assert p.stop == ("\n",)
    assert p.logprobs and p.top_logprobs == 3
    assert job.max_tokens_from_body


def test_n_choices_get_distinct_reproducible_seeds() -> None:
    jobs = choice_jobs(make_lease({**CHAT, "n": 3, "seed": 42}), default_max_tokens=16)
    seeds = [j.params.seed for j in jobs]
    assert [j.index for j in jobs] == [0, 1, 2]
    assert seeds[0] == 42 and len(set(seeds)) == 3
    assert seeds == [derive_seed(42, i) for i in range(3)]


def test_completion_prompts_and_logprobs_int() -> None:
    body = {"model": "m", "prompt": ["a", "b"], "n": 2, "logprobs": 2, "max_tokens": 4}
    jobs = choice_jobs(make_lease(body, kind="completion"), default_max_tokens=16)
    assert [(j.index, j.prompt) for j in jobs] == [(0, "a"), (1, "a"), (2, "b"), (3, "b")]
    assert all(j.params.logprobs and j.params.top_logprobs == 2 for j in jobs)
    [tok_job] = choice_jobs(make_lease({"prompt": [1, 2, 3]}, kind="completion"), 16)
    assert tok_job.prompt == [1, 2, 3]


def test_checkpoint_is_handed_to_the_matching_choice() -> None:
    checkpoint = Checkpoint(choices=[ChoiceProgress(index=1, token_ids=[5, 6], text="xy")],
                            num_prompt_tokens=10)
    jobs = choice_jobs(make_lease({**CHAT, "n": 2}, checkpoint=checkpoint), 16)
    assert jobs[0].resume is None
    assert jobs[1].resume is not None and jobs[1].resume.token_ids == [5, 6]


@pytest.mark.parametrize(("body", "param"), [
    ({**CHAT, "max_tokens": "ten"}, "max_tokens"),
    ({**CHAT, "temperature": -1}, None),
    ({**CHAT, "stop": 5}, "stop"),
    ({**CHAT, "n": 0}, "n"),
    ({"model": "m", "messages": []}, "messages"),
])
def test_unusable_bodies_raise_a_typed_error(body: dict[str, Any], param: str | None) -> None:
    with pytest.raises(BodyError) as info:
        choice_jobs(make_lease(body), default_max_tokens=16)
    assert info.value.param == param
