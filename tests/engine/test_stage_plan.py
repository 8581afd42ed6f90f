"""The cut of a model's layers into pipeline stages (engine/stage_plan.py)."""

from __future__ import annotations

import pytest

from minimill.engine.stage_plan import head_cost, layer_costs, plan_stages
from minimill.models.types import LoadedModel


def test_equal_layers_split_evenly_and_cover_the_model_in_order() -> None:
    plan = plan_stages([1.0] * 12, 3)
    assert plan.layers == (range(0, 4), range(4, 8), range(8, 12))
    assert plan.costs == (4.0, 4.0, 4.0)
    assert plan.imbalance() == pytest.approx(1.0)


def test_the_last_stage_s_head_takes_layers_off_it() -> None:
    plan = plan_stages([1.0] * 10, 2, last_extra=4.0)
    # 10 layers + a head worth 4: 7 and 3 + 4.
    assert plan.layers == (range(0, 7), range(7, 10))
    assert plan.costs == (7.0, 7.0)


def test_a_costly_layer_gets_a_stage_to_itself() -> None:
    plan = plan_stages([1.0, 1.0, 6.0, 1.0, 1.0], 3)
    assert plan.layers == (range(0, 2), range(2, 3), range(3, 5))
    assert max(plan.costs) == 6.0


def test_every_stage_gets_a_layer_and_too_many_stages_are_refused() -> None:
    plan = plan_stages([5.0, 1.0, 1.0], 3)
    assert [len(r) for r in plan.layers] == [1, 1, 1]
    with pytest.raises(ValueError, match="at least 4 decoder layers"):
        plan_stages([1.0] * 3, 4)


def test_smollm2_s_layers_cost_alike_and_its_head_several_of_them(
        smol_f32: LoadedModel) -> None:
    mc = smol_f32.config
    costs = layer_costs(mc, smol_f32.weights)
    assert len(costs) == mc.num_hidden_layers
    assert max(costs) == min(costs) > 3e6  # ~3.5M parameters per layer, plus attention
    head = head_cost(mc)
    assert head > 5 * costs[0]  # a 49k vocabulary over a 576-wide model
    plan = plan_stages(costs, 2, head)
    # The last stage carries the head: it holds fewer layers.
    assert len(plan.layers[0]) > len(plan.layers[1])
    assert plan.imbalance() < 1.05
