"""DeepSeek-V3's grouped sigmoid routing against transformers' router."""

from __future__ import annotations

import torch


def test_routing_matches_transformers_router() -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from minimill.engine.moe import GroupedRouting, route_grouped

    config = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4,
                              n_group=4, topk_group=2, routed_scaling_factor=2.5,
                              norm_topk_prob=True)
    torch.manual_seed(0)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.3)
    x = torch.randn(64, 32)
    _, ref_weights, ref_experts = router(x)
    experts, weights = route_grouped(x, router.weight.detach(), router.e_score_correction_bias,
                                     4, True, GroupedRouting(4, 2, 2.5))
    ours, ref = experts.sort(dim=-1), ref_experts.sort(dim=-1)
    assert torch.equal(ours.values, ref.values)
    torch.testing.assert_close(weights.gather(1, ours.indices),
                               ref_weights.gather(1, ref.indices))
