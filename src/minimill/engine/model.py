"""The decoder of every architecture the engine runs (Llama, Mistral, Qwen2, Qwen3,
Qwen3-MoE, Gemma 3, gpt-oss, DeepSeek-V3) over flattened tokens with a paged KV cache.

Weights arrive in HF naming and are fused at load: q/k/v into one matrix (plus bias for
Qwen2), gate/up into one, so each layer runs four matmuls; everything between them (norms with
the residual add, rotary with the KV write, attention, SiLU * up) is one call each into the
engine's kernels (kernels.py). What newer families add is per layer and optional: q/k norms
(Qwen3, Gemma 3), norms of the attention and MLP outputs (Gemma), sliding-window layers with
their own rotary base (Gemma 3), routed experts in place of the MLP (moe.py), and multi-head
latent attention over a cache of latents in place of q/k/v (mla.py, DeepSeek-V3).

Activations are [num_tokens, hidden] for the whole step (every request's new tokens back to
back); positions and the attention metadata say where each token sits. Arithmetic follows HF
transformers (norms in float32, residuals in the model dtype) so float32 runs match it closely.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minimill.engine.attention import AttentionMetadata, layer_views
from minimill.engine.kernels import TorchKernels
from minimill.engine.kv_int4 import stage_layer_views
from minimill.engine.memory import release_freed_memory
from minimill.engine.mla import MlaWeights, latent_view, load_mla, mla_attention
from minimill.engine.moe import (
    ExpertCombine,
    ExpertWeights,
    GroupedRouting,
    experts_forward,
    load_deepseek_experts,
    load_experts,
    load_gpt_oss_experts,
)
from minimill.engine.rope import RotaryEmbedding
from minimill.engine.window_pool import WindowLayout
from minimill.models.types import ModelConfig, ModelFileError


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    # Matrices are as kernels.prepare_weight left them (e.g. prepacked for oneDNN).
    qkv: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim, hidden]; None for MLA
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [hidden, heads * head_dim] (MLA: heads * v_head_dim)
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [hidden]: the norm before the MLP
    # [2 * intermediate, hidden]; where experts run, None or DeepSeek's shared experts
    gate_up: torch.Tensor | None
    down: torch.Tensor | None  # [hidden, intermediate]
    experts: ExpertWeights | None = None
    q_norm: torch.Tensor | None = None  # [head_dim], Qwen3 / Gemma 3
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # [hidden], Gemma: the attention output's norm
    mlp_out_norm: torch.Tensor | None = None  # [hidden], Gemma: the MLP output's norm
    window: int | None = None  # a sliding-window layer's window
    sinks: torch.Tensor | None = None  # float32 [heads], gpt-oss's attention sinks
    rotary: int = 0  # index into DecoderModel.rotaries
    # Where its KV sits in a pool block: (group of layers, slot in the group) where the
    # model's sliding-window and full layers are grouped (window_pool.py).
    pool_place: tuple[int, int] | None = None
    mla: MlaWeights | None = None  # multi-head latent attention in place of qkv


class DecoderModel:
    """The forward pass; owns the fused weights and the rotary tables."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype, device: torch.device, max_model_len: int,
                 kernels: TorchKernels | None = None, release_weights: bool = False,
                 layers: range | None = None, expert_ids: range | None = None,
                 combine: ExpertCombine | None = None, with_head: bool = True) -> None:
        """`release_weights`: take each weight out of `weights` once used, so that a model
        which barely fits in memory is never held twice (source and fused copies).

        `layers`: a pipeline stage's share (stage_plan.py): only these decoder layers, the
        embedding if they start the model and the final norm and vocabulary projection if
        they end it; None: the whole model.

        `expert_ids`: an expert-parallel rank's share of each MoE layer's routed experts
        (expert_share.py), run through `combine`; None: every expert, here. `with_head`: False
        where another process norms and projects this model's last hidden states (an
        expert-parallel rank after the first)."""
        self.config = config
        self.combine = combine
        if expert_ids is None:
            expert_ids = range(config.num_experts)
        layers = range(config.num_hidden_layers) if layers is None else layers
        self.layer_range = layers
        self.is_first = layers.start == 0
        self.is_last = layers.stop == config.num_hidden_layers and with_head
        self.kernels = kernels or TorchKernels()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        qk_dim = (config.qk_nope_head_dim + config.qk_rope_head_dim if config.is_mla
                  else config.head_dim)
        self.scale = config.attention_scale or qk_dim ** -0.5
        self.grouped = (GroupedRouting(config.n_group, config.topk_group,
                                       config.routed_scaling_factor)
                        if config.expert_style == "deepseek_v3" else None)
        # Gemma multiplies the embeddings by sqrt(hidden), rounded to the model dtype as HF does.
        self.embed_scale = (torch.tensor(config.hidden_size ** 0.5, dtype=dtype).item()
                            if config.scale_embeddings else None)

        def w(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
            tensor = weights.pop(name, None) if release_weights else weights.get(name)
            if tensor is None:
                raise ModelFileError(f"weight {name!r} is missing from the model")
            return tensor.to(device=device, dtype=as_dtype)

        def norm(name: str) -> torch.Tensor:
            # Gemma's norms scale by (1 + weight): folded in once, here.
            return w(name) + 1 if config.gemma_norms else w(name)

        pack = self.kernels.prepare_weight
        pack_expert = self.kernels.prepare_expert_weights
        # A later stage holds neither: empty tensors stand in (never read there).
        none = torch.empty(0, device=device, dtype=dtype)
        self.embed = w("model.embed_tokens.weight") if self.is_first else none
        self.norm = norm("model.norm.weight") if self.is_last else none
        self.logits_width = config.vocab_size
        self.lm_head = none
        if self.is_last:
            if config.tie_word_embeddings or "lm_head.weight" not in weights:
                # Packing may copy the embedding: the lm_head then holds its own layout.
                head = self.embed if self.is_first else w("model.embed_tokens.weight")
            else:
                head = w("lm_head.weight")
            self.logits_width = head.shape[0]
            self.lm_head = pack(head)
        self.layers: list[LayerWeights] = []
        for i in layers:
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            bias = qkv = mla = None
            if config.is_mla:
                mla = load_mla(a, config, w, pack)
            else:
                qkv = pack(torch.cat([w(a + f"{n}_proj.weight") for n in "qkv"]))
            if config.attention_bias and not config.is_mla:
                bias = torch.cat([w(a + f"{n}_proj.bias") for n in "qkv"]).contiguous()
            layer = LayerWeights(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=qkv, qkv_bias=bias, mla=mla,
                o=pack(w(a + "o_proj.weight")),
                o_bias=w(a + "o_proj.bias").contiguous() if config.o_proj_bias else None,
                post_norm=norm(p + ("pre_feedforward_layernorm.weight" if config.gemma_norms
                                    else "post_attention_layernorm.weight")),
                gate_up=None, down=None)
            if config.is_moe(i) and config.expert_style == "gpt_oss":
                layer.experts = load_gpt_oss_experts(m, w, pack, pack_expert)
            elif config.is_moe(i) and config.expert_style == "deepseek_v3":
                layer.experts = load_deepseek_experts(m, expert_ids, w, pack, pack_expert)
                if config.n_shared_experts:
                    shared = m + "shared_experts."
                    layer.gate_up = pack(torch.cat([w(shared + "gate_proj.weight"),
                                                    w(shared + "up_proj.weight")]))
                    layer.down = pack(w(shared + "down_proj.weight"))
            elif config.is_moe(i):
                layer.experts = load_experts(m, expert_ids, w, pack, pack_expert)
            else:
                layer.gate_up = pack(torch.cat([w(m + "gate_proj.weight"),
                                                w(m + "up_proj.weight")]))
                layer.down = pack(w(m + "down_proj.weight"))
            if config.qk_norm:
                # Qwen3's q/k norms are plain RMSNorms; Gemma's, like its others, (1 + w).
                layer.q_norm, layer.k_norm = norm(a + "q_norm.weight"), norm(a + "k_norm.weight")
            if config.gemma_norms:
                layer.attn_out_norm = norm(p + "post_attention_layernorm.weight")
                layer.mlp_out_norm = norm(p + "post_feedforward_layernorm.weight")
            if config.attention_sinks:
                layer.sinks = w(a + "sinks").float().contiguous()
            if config.is_sliding(i):
                layer.window = config.sliding_window
                layer.rotary = 1 if config.sliding_rope_theta is not None else 0
            self.layers.append(layer)
            if release_weights and device.type == "cpu":
                # The layer's weights as loaded are freed now that it holds its own copies,
                # but into malloc's heaps (the engine keeps freed memory: memory.py), and
                # its next copies do not fit in their place: without this a model that fits
                # in memory once peaked at twice its size while it loaded.
                release_freed_memory()
        self.rotaries = [RotaryEmbedding(config, max_model_len, device)]
        if config.sliding_rope_theta is not None:
            local = dataclasses.replace(config, rope_theta=config.sliding_rope_theta,
                                        rope_scaling=None)
            self.rotaries.append(RotaryEmbedding(local, max_model_len, device))

    def place_layers(self, layout: WindowLayout | None) -> None:
        """Read each layer's KV at its place in the pool's layout (None: layer i at i)."""
        for i, layer in enumerate(self.layers):
            layer.pool_place = None if layout is None else layout.places[i]

    def _qk_norm(self, qkv: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """qkv with each head's queries and keys RMS-normed (over head_dim)."""
        assert layer.q_norm is not None and layer.k_norm is not None
        ops, d = self.kernels, self.head_dim
        q_width, k_width = self.num_heads * d, self.num_kv_heads * d
        tokens = qkv.shape[0]
        q = ops.rms_norm(qkv[:, :q_width].reshape(-1, d), layer.q_norm, self.eps)
        k = ops.rms_norm(qkv[:, q_width:q_width + k_width].reshape(-1, d), layer.k_norm,
                         self.eps)
        return torch.cat([q.view(tokens, q_width), k.view(tokens, k_width),
                          qkv[:, q_width + k_width:]], dim=1)

    def _mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        ops = self.kernels
        c = self.config
        routed = None
        if layer.experts is not None:
            swiglu = ((c.swiglu_alpha, c.swiglu_limit) if c.expert_style == "gpt_oss"
                      else None)
            routed = experts_forward(ops, x, layer.experts, c.num_experts_per_tok,
                                     c.norm_topk_prob, swiglu, self.grouped, self.combine)
            if layer.gate_up is None:
                return routed
        assert layer.gate_up is not None and layer.down is not None
        gate_up = ops.linear(x, layer.gate_up)
        act = (ops.gelu_tanh_and_mul(gate_up) if self.config.hidden_act == "gelu_tanh"
               else ops.silu_and_mul(gate_up))
        dense = ops.linear(act, layer.down)
        # DeepSeek's shared experts: added after the routed ones, as HF does.
        return dense if routed is None else routed + dense

    def _attention(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   kv_cache: torch.Tensor, i: int, layer: LayerWeights) -> torch.Tensor:
        """Layer i's attention output before o_proj, [tokens, heads * value width]; writes
        the tokens' KV into the pool."""
        ops = self.kernels
        cos_sin = self.rotaries[layer.rotary].cos_sin
        if layer.mla is not None:
            return mla_attention(ops, x, positions, cos_sin, latent_view(kv_cache, i), meta,
                                 layer.mla, self.config, self.scale)
        assert layer.qkv is not None
        qkv = ops.linear(x, layer.qkv, layer.qkv_bias)
        if layer.q_norm is not None:
            qkv = self._qk_norm(qkv, layer)
        if layer.pool_place is not None:  # its group's block tables (window_pool.py)
            group, i = layer.pool_place
            assert meta.groups is not None
            meta = meta.groups[group]
        k_cache, v_cache = layer_views(kv_cache, i)
        if meta.int4 is not None:
            k_stage, v_stage = stage_layer_views(meta.int4.kv_stage, i)
            q, k_new, v_new = ops.rotary_kv_write_int4(
                qkv, positions, cos_sin, k_cache, v_cache, k_stage, v_stage, meta,
                self.num_heads, self.num_kv_heads)
            return ops.paged_attention_int4(q, k_new, v_new, k_cache, v_cache, k_stage,
                                            v_stage, meta, self.scale)
        q = ops.rotary_kv_write(qkv, positions, cos_sin, k_cache, v_cache,
                                meta.slot_mapping, self.num_heads, self.num_kv_heads,
                                meta.block_size)
        return ops.paged_attention(q, k_cache, v_cache, meta, self.scale, layer.window,
                                   layer.sinks)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor,
                logits_rows: torch.Tensor, hidden_only: bool = False) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; kv_cache: the pool (attention.py's layout);
        returns logits [len(logits_rows), vocab] in the model dtype, or with `hidden_only`
        those rows' final normed hidden states [len(logits_rows), hidden] (what embeddings
        pool; `project` turns them into logits)."""
        hidden = self.embed_tokens(input_ids)
        hidden, residual = self.run_layers(hidden, None, positions, meta, kv_cache)
        return self.head(hidden, residual, logits_rows, hidden_only)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's input: [num_tokens] ids -> [num_tokens, hidden]."""
        hidden = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        return hidden

    def run_layers(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                   positions: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This model's layers (a stage's: kv_cache holds only theirs) over the hidden states
        and residual stream the layers before left ([num_tokens, hidden]; residual None before
        the first layer); returns both as the next layer takes them."""
        ops, eps = self.kernels, self.eps
        for i, layer in enumerate(self.layers):
            if residual is None:
                x, residual = ops.rms_norm(hidden, layer.input_norm, eps), hidden
            else:
                x, residual = ops.add_rms_norm(hidden, residual, layer.input_norm, eps)
            attn = self._attention(x, positions, meta, kv_cache, i, layer)
            hidden = ops.linear(attn, layer.o, layer.o_bias)
            if layer.attn_out_norm is not None:
                hidden = ops.rms_norm(hidden, layer.attn_out_norm, eps)
            x, residual = ops.add_rms_norm(hidden, residual, layer.post_norm, eps)
            hidden = self._mlp(x, layer)
            if layer.mlp_out_norm is not None:
                hidden = ops.rms_norm(hidden, layer.mlp_out_norm, eps)
        return hidden, residual

    def head(self, hidden: torch.Tensor, residual: torch.Tensor | None,
             logits_rows: torch.Tensor, hidden_only: bool = False) -> torch.Tensor:
        """The last stage's end: the final norm of `logits_rows` and their logits (or with
        `hidden_only` the normed rows)."""
        ops, eps = self.kernels, self.eps
        # Only the rows that sample need the final norm and the (large) vocabulary projection
        # (none in a step of prompt chunks that all end before their prompt does).
        if not logits_rows.numel():
            return hidden.new_empty(0, self.logits_width)
        if residual is None:
            last = ops.rms_norm(hidden[logits_rows], self.norm, eps)
        else:
            last = ops.rms_norm(hidden[logits_rows] + residual[logits_rows], self.norm, eps)
        return last if hidden_only else self.project(last)

    def project(self, last: torch.Tensor) -> torch.Tensor:
        """Final normed hidden states [rows, hidden] -> logits [rows, vocab]."""
        return self.kernels.linear(last, self.lm_head)
