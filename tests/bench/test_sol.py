"""The speed-of-light yardstick (bench/sol.py) on known rates: lanes' steps, which run side by
side on one core each, are bounded as one machine-wide step of all their rows."""

from __future__ import annotations

import pytest
import torch

from minimill.bench.sol import Yardstick, speed_of_light
from minimill.engine.model import DecoderModel
from minimill.engine.model_runner import StepShape
from minimill.models.shapes import weight_shapes
from minimill.models.types import ModelConfig

MODEL = ModelConfig(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                    max_position_embeddings=512, tie_word_embeddings=True)


@pytest.fixture
def model() -> DecoderModel:
    weights = {name: torch.ones(shape) for name, shape in weight_shapes(MODEL).items()}
    return DecoderModel(MODEL, weights, torch.float32, torch.device("cpu"), 512)


def _stick(bandwidth: float) -> Yardstick:
    # Twice the rows, twice the rate per row: a machine-wide step of 256 rows costs what one
    # of 128 does.
    return Yardstick(layer_s_per_row={128: 2e-6, 256: 1e-6},
                     lm_head_s_per_row={128: 4e-6, 256: 2e-6},
                     layer_flop_s={128: 1e10, 256: 2e10}, bandwidth_bytes_s=bandwidth)


@pytest.mark.parametrize("bandwidth", [1e15, 1e3])  # compute-bound, then memory-bound
def test_two_lanes_steps_are_bounded_as_one_step_of_their_rows(model: DecoderModel,
                                                               bandwidth: float) -> None:
    stick = _stick(bandwidth)
    whole = speed_of_light(model, [StepShape(256, 256, 256, 256 * 40, 256 * 40)], stick)
    half = StepShape(128, 128, 128, 128 * 40, 128 * 40, lanes=2)
    lanes = speed_of_light(model, [half, half], stick)
    assert lanes.seconds == pytest.approx(whole.seconds)
    assert lanes.memory_bound_steps == 2 * whole.memory_bound_steps
    # Counted alone, at the rate of 128 rows and reading every weight each, the same two
    # steps would take longer: the yardstick would flatter the engine.
    alone = speed_of_light(model, [StepShape(128, 128, 128, 128 * 40, 128 * 40)] * 2, stick)
    assert alone.seconds > lanes.seconds


def test_a_second_yardstick_keeps_the_faster_figure_at_every_shape() -> None:
    from minimill.bench.sol import best_of

    slowed = Yardstick(layer_s_per_row={1: 2e-3, 8: 1e-4}, lm_head_s_per_row={1: 5e-4},
                       layer_flop_s={1: 1e9, 8: 2e10}, bandwidth_bytes_s=1e10)
    again = Yardstick(layer_s_per_row={1: 1e-3, 8: 3e-4, 16: 9e-5}, lm_head_s_per_row={1: 6e-4},
                      expert_s_per_row={2: 1e-5}, layer_flop_s={1: 2e9, 8: 1e10},
                      bandwidth_bytes_s=2e10)
    best = best_of(slowed, again)
    assert best.layer_s_per_row == {1: 1e-3, 8: 1e-4, 16: 9e-5}
    assert best.lm_head_s_per_row == {1: 5e-4} and best.expert_s_per_row == {2: 1e-5}
    assert best.layer_flop_s == {1: 2e9, 8: 2e10} and best.bandwidth_bytes_s == 2e10
