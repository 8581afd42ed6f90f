"""Sampling depends only on (seed, output position, logits), and honours its filters."""

from __future__ import annotations

import math

import torch

from minimill.engine.params import SamplingParams
from minimill.engine.sampler import argmax, sample, uniform_for

VOCAB = 50


def logits_for(seed: int, rows: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 2


def test_uniform_is_a_pure_function_in_unit_interval() -> None:
    values = [uniform_for(s, i) for s in (0, 1, 2**62) for i in range(200)]
    assert values == [uniform_for(s, i) for s in (0, 1, 2**62) for i in range(200)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert len(set(values)) == len(values)
    assert abs(sum(values) / len(values) - 0.5) < 0.05


def test_token_depends_only_on_seed_position_and_logits() -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=8)
    row = logits_for(0)
    alone = [sample(row, [params], [7], [i])[0][0] for i in range(30)]
    # The same row inside batches of other requests, at other row indices.
    for others in (1, 5):
        batch = torch.cat([logits_for(1, others), row, logits_for(2, 3)])
        params_list = [SamplingParams(temperature=0.5)] * others + [params] + [
            SamplingParams(temperature=0.0)] * 3
        for i in range(30):
            tokens, _ = sample(batch, params_list, [1] * others + [7] + [3] * 3,
                               [i] * others + [i] + [i] * 3)
            assert tokens[others] == alone[i]
    other_seed = [sample(row, [params], [8], [i])[0][0] for i in range(30)]
    assert other_seed != alone


def test_greedy_picks_argmax_and_ignores_seed() -> None:
    rows = logits_for(3, 4)
    tokens, _ = sample(rows, [SamplingParams(temperature=0.0)] * 4, [1, 2, 3, 4], [0, 1, 2, 3])
    assert tokens == rows.argmax(-1).tolist()
    top_k_one, _ = sample(rows, [SamplingParams(top_k=1)] * 4, [9] * 4, [5] * 4)
    assert top_k_one == tokens


def test_top_k_and_top_p_never_leave_their_set() -> None:
    row = logits_for(4)
    order = row[0].argsort(descending=True).tolist()
    probs = torch.softmax(row[0].double(), -1)
    nucleus, mass = [], 0.0
    for t in order:  # the smallest set of best tokens reaching mass 0.6
        nucleus.append(t)
        mass += probs[t].item()
        if mass >= 0.6:
            break
    for i in range(300):
        tk = sample(row, [SamplingParams(top_k=3)], [11], [i])[0][0]
        assert tk in order[:3]
        tp = sample(row, [SamplingParams(top_p=0.6)], [11], [i])[0][0]
        assert tp in nucleus


def test_frequencies_follow_the_distribution() -> None:
    row = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    n = 4000
    counts = [0] * 4
    for i in range(n):
        counts[sample(row, [SamplingParams()], [5], [i])[0][0]] += 1
    for token, p in enumerate((0.5, 0.3, 0.15, 0.05)):
        sd = math.sqrt(p * (1 - p) / n)
        assert abs(counts[token] / n - p) < 5 * sd


def test_temperature_sharpens() -> None:
    row = torch.log(torch.tensor([[0.6, 0.4]]))
    cold = sum(sample(row, [SamplingParams(temperature=0.1)], [2], [i])[0][0] == 0
               for i in range(500))
    assert cold > 480  # p(token 0) = 1 / (1 + (0.4 / 0.6) ** 10) = 0.983


def test_logprobs_are_the_model_distribution() -> None:
    rows = logits_for(6, 2)
    params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
              SamplingParams(temperature=0.0)]
    tokens, logprobs = sample(rows, params, [0, 0], [0, 0])
    expected = torch.log_softmax(rows[0], -1)
    assert logprobs[1] is None
    first = logprobs[0]
    assert first is not None
    chosen, top = first
    assert math.isclose(chosen, expected[tokens[0]].item(), rel_tol=1e-5)
    assert [t for t, _ in top] == expected.topk(3).indices.tolist()
    assert top[0][0] == tokens[0]


def test_fast_argmax_is_torch_argmax_including_ties() -> None:
    g = torch.Generator().manual_seed(0)
    for vocab in (49152, 50001, 5000):
        for dtype in (torch.float32, torch.bfloat16):
            rows = torch.randn(6, vocab, generator=g).to(dtype)
            rows[1, 17] = rows[1, 4000] = rows[1, vocab - 1] = 100.0  # ties: first wins
            rows[2, vocab - 1] = 100.0  # the max in the ragged last chunk
            rows[3, 0] = 100.0
            assert argmax(rows).tolist() == rows.argmax(-1).tolist()
            assert argmax(rows)[1] == 17
