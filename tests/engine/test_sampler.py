"""Sampling depends only on (seed, output position, logits), and honours its filters; the
compiled CPU kernel picks exactly what the PyTorch reference picks."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from minimill.engine.kernels import CpuKernels, TorchKernels
from minimill.engine.native import load_cpu_kernels
from minimill.engine.params import InvalidRequestError, SamplingParams
from minimill.engine.sampler import adjustments_for, uniform_for
from minimill.engine.sampler import sample as sample_with

VOCAB = 50
Sample = Callable[..., tuple[list[int], list[Any]]]


def native_kernels() -> CpuKernels:
    state = load_cpu_kernels()
    assert state.available, state.reason
    return CpuKernels()


@pytest.fixture(params=["torch", "native"])
def sample(request: pytest.FixtureRequest) -> Sample:
    kernels = TorchKernels() if request.param == "torch" else native_kernels()

    def run(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
            indices: list[int], counts: list[dict[int, int] | None] | None = None
            ) -> tuple[list[int], list[Any]]:
        return sample_with(logits, params, seeds, indices, kernels, counts)

    return run


def logits_for(seed: int, rows: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 2


def test_uniform_is_a_pure_function_in_unit_interval() -> None:
    values = [uniform_for(s, i) for s in (0, 1, 2**62) for i in range(200)]
    assert values == [uniform_for(s, i) for s in (0, 1, 2**62) for i in range(200)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert len(set(values)) == len(values)
    assert abs(sum(values) / len(values) - 0.5) < 0.05


def test_token_depends_only_on_seed_position_and_logits(sample: Sample) -> None:
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


def test_greedy_picks_argmax_and_ignores_seed(sample: Sample) -> None:
    rows = logits_for(3, 4)
    tokens, _ = sample(rows, [SamplingParams(temperature=0.0)] * 4, [1, 2, 3, 4], [0, 1, 2, 3])
    assert tokens == rows.argmax(-1).tolist()
    top_k_one, _ = sample(rows, [SamplingParams(top_k=1)] * 4, [9] * 4, [5] * 4)
    assert top_k_one == tokens


def test_top_k_and_top_p_never_leave_their_set(sample: Sample) -> None:
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


def test_frequencies_follow_the_distribution(sample: Sample) -> None:
    row = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    n = 4000
    counts = [0] * 4
    for i in range(n):
        counts[sample(row, [SamplingParams()], [5], [i])[0][0]] += 1
    for token, p in enumerate((0.5, 0.3, 0.15, 0.05)):
        sd = math.sqrt(p * (1 - p) / n)
        assert abs(counts[token] / n - p) < 5 * sd


def test_temperature_sharpens(sample: Sample) -> None:
    row = torch.log(torch.tensor([[0.6, 0.4]]))
    cold = sum(sample(row, [SamplingParams(temperature=0.1)], [2], [i])[0][0] == 0
               for i in range(500))
    assert cold > 480  # p(token 0) = 1 / (1 + (0.4 / 0.6) ** 10) = 0.983


def test_logprobs_are_the_model_distribution(sample: Sample) -> None:
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


def test_greedy_is_torch_argmax_including_ties(sample: Sample) -> None:
    g = torch.Generator().manual_seed(0)
    for vocab in (49152, 50001, 5000):
        for dtype in (torch.float32, torch.bfloat16):
            rows = torch.randn(6, vocab, generator=g).to(dtype)
            rows[1, 17] = rows[1, 4000] = rows[1, vocab - 1] = 100.0  # ties: first wins
            rows[2, vocab - 1] = 100.0  # the max in the ragged tail
            rows[3, 0] = 100.0
            tokens, _ = sample(rows, [SamplingParams(temperature=0.0)] * 6, [0] * 6, [0] * 6)
            assert tokens == rows.argmax(-1).tolist()
            assert tokens[1] == 17


def test_penalties_and_logit_bias_do_what_openai_documents(sample: Sample) -> None:
    row = torch.zeros(1, VOCAB)
    row[0, 3] = 5.0
    row[0, 4] = 4.0
    greedy = SamplingParams(temperature=0.0)
    assert sample(row, [greedy], [0], [0])[0] == [3]
    # Token 3 already appeared twice: 5 - 2 * 0.8 = 3.4 < 4.
    params = SamplingParams(temperature=0.0, frequency_penalty=0.8)
    assert sample(row, [params], [0], [2], [{3: 2}])[0] == [4]
    # Presence counts once however often: 5 - 0.9 = 4.1 > 4.
    params = SamplingParams(temperature=0.0, presence_penalty=0.9)
    assert sample(row, [params], [0], [2], [{3: 5}])[0] == [3]
    # logit_bias: -100 bans a token, +100 forces one.
    assert sample(row, [SamplingParams(temperature=0.0, logit_bias=((3, -100.0),))],
                  [0], [0])[0] == [4]
    forced = SamplingParams(temperature=1.0, logit_bias=((7, 100.0),))
    assert {sample(row, [forced], [1], [i])[0][0] for i in range(50)} == {7}
    # Penalties lower logits before sampling: a token repeated often is rarely drawn.
    flat = torch.zeros(1, 4)
    params = SamplingParams(temperature=1.0, frequency_penalty=2.0)
    draws = [sample(flat, [params], [3], [i], [{0: 3}])[0][0] for i in range(400)]
    assert draws.count(0) < 10  # weight e^-6 against 1 + 1 + 1


def test_adjustments_combine_bias_and_penalties() -> None:
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25,
                            logit_bias=((1, 2.0), (9, -1.0)))
    assert adjustments_for(params, {1: 2, 4: 1}) == [(1, 2.0 - 1.0 - 0.25), (4, -0.75),
                                                    (9, -1.0)]
    assert adjustments_for(SamplingParams(), {1: 3}) == []


def test_out_of_range_parameters_are_rejected() -> None:
    for bad in ({"frequency_penalty": 2.5}, {"presence_penalty": -3.0},
                {"logit_bias": ((5, 101.0),)}, {"logit_bias": ((-1, 1.0),)}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)


def test_native_kernel_picks_what_the_reference_picks() -> None:
    """Every parameter kind on realistic widths; float32 and bfloat16 logits."""
    reference, native = TorchKernels(), native_kernels()
    rng = random.Random(1)
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
             SamplingParams(top_k=40), SamplingParams(temperature=0.7, top_p=0.9),
             SamplingParams(temperature=1.2, top_k=100, top_p=0.5, logprobs=True,
                            top_logprobs=5),
             SamplingParams(temperature=0.9, frequency_penalty=0.5, presence_penalty=0.3,
                            logit_bias=((5, 3.0), (7, -100.0)), top_logprobs=2)]
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        for scale in (1.0, 4.0):  # flat and peaked distributions
            logits = (torch.randn(36, 49152, generator=g) * scale).to(dtype)
            params = [kinds[r % len(kinds)] for r in range(36)]
            counts = [{rng.randrange(49152): rng.randrange(1, 4) for _ in range(20)}
                      for _ in range(36)]
            seeds = [rng.randrange(2**62) for _ in range(36)]
            want = sample_with(logits, params, seeds, [5] * 36, reference, counts)
            got = sample_with(logits, params, seeds, [5] * 36, native, counts)
            assert got[0] == want[0]
            for a, b in zip(want[1], got[1], strict=True):
                assert (a is None) == (b is None)
                if a is not None and b is not None:
                    assert math.isclose(a[0], b[0], abs_tol=1e-4)
                    assert [t for t, _ in a[1]] == [t for t, _ in b[1]]


def test_native_kernel_picks_what_the_reference_picks_under_grammar_masks() -> None:
    """Guided rows: sparse masks (gathered: only allowed logits are read) and dense ones
    (masked in place) pick the reference's token, with every parameter kind, adjustments on
    allowed and refused ids, a one-token mask and a mask allowing nothing (not applied)."""
    reference, native = TorchKernels(), native_kernels()
    rng = random.Random(3)
    vocab, rows = 49152, 48
    words = (vocab + 31) // 32
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
             SamplingParams(top_k=5), SamplingParams(temperature=0.7, top_p=0.9),
             SamplingParams(temperature=1.1, top_k=3, top_p=0.8),
             SamplingParams(temperature=0.9, logit_bias=((5, 30.0), (7, -100.0), (40000, 2.0)))]

    def mask(allowed: set[int]) -> torch.Tensor:
        bits = [0] * words
        for t in allowed:
            bits[t // 32] |= 1 << (t % 32)
        return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits],
                            dtype=torch.int32)

    shapes = [set(rng.sample(range(vocab), 40)), {5, 7, 11, 40000}, {12345},
              set(range(vocab)) - set(rng.sample(range(vocab), 400)),
              set(rng.sample(range(vocab), vocab // 3)), set()]
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
        params = [kinds[r % len(kinds)] for r in range(rows)]
        masks: list[torch.Tensor | None] = [
            None if r % 7 == 6 else mask(shapes[(r // len(kinds)) % len(shapes)])
            for r in range(rows)]
        seeds = [rng.randrange(2**62) for _ in range(rows)]
        want, _ = sample_with(logits, params, seeds, [3] * rows, reference, masks=masks)
        got, _ = sample_with(logits, params, seeds, [3] * rows, native, masks=masks)
        assert got == want
        for r, m in enumerate(masks):
            allowed = shapes[(r // len(kinds)) % len(shapes)] if m is not None else set()
            if allowed:
                assert got[r] in allowed
