"""The per-layer operations the model calls, in two interchangeable implementations.

`TorchKernels` is portable PyTorch (any device, any dtype): the reference. `CpuKernels` runs
minimill's compiled CPU kernels (native.py): fused RMSNorm + residual, rotary + KV write into
the paged cache, SiLU * up, attention over the paged cache in place, and a mixture of experts'
layer in one call. Tests hold the fast
path to the reference (float32: logits close, greedy tokens identical).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from minimill.engine.attention import (
    AttentionMetadata,
    paged_attention_reference,
    write_kv_reference,
)
from minimill.engine.experts_reference import grouped_experts
from minimill.engine.kv_int4 import paged_attention_int4_reference, write_kv_int4_reference
from minimill.engine.rope import rotate
from minimill.engine.sampler import (
    Adjustments,
    TokenMasks,
    reference_logprobs,
    reference_sample,
)

log = logging.getLogger(__name__)

KERNEL_CHOICES = ("auto", "native", "torch")


class TorchKernels:
    """Portable PyTorch; arithmetic as HF transformers (norms in float32, rounding to dtype)."""

    name = "torch"

    def prepare_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight [out, in] in the form `linear` reads fastest (done once, at load)."""
        return weight.contiguous()

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual); the inputs may be overwritten."""
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Gemma's gate: GELU with the tanh approximation, times up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def clamped_swiglu(self, gate_up: torch.Tensor, alpha: float, limit: float
                       ) -> torch.Tensor:
        """gpt-oss's experts: gate clamped above at `limit`, up to [-limit, limit], and
        (up + 1) * gate * sigmoid(alpha * gate)."""
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def prepare_expert_weights(self, gate_up: torch.Tensor, down: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """An expert's gate/up [2I, hidden] and down [hidden, I] weights in the form
        `expert_linear` reads fastest."""
        return self.prepare_weight(gate_up), self.prepare_weight(down)

    def expert_linear(self, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        """`linear` for an expert's rows (a few of a step's tokens each)."""
        return self.linear(x, weight, bias)

    def experts(self, x: torch.Tensor, expert_ids: torch.Tensor, routing: torch.Tensor,
                gate_up: Sequence[torch.Tensor], down: Sequence[torch.Tensor],
                gate_up_bias: Sequence[torch.Tensor] | None = None,
                down_bias: Sequence[torch.Tensor] | None = None,
                swiglu: tuple[float, float] | None = None) -> torch.Tensor:
        """Routed experts: x [tokens, hidden], each token's expert ids and routing weights
        [tokens, top_k] -> the weighted sum of its experts' gated MLPs [tokens, hidden].
        gate_up [2I, hidden] and down [hidden, I] per expert, prepared; `swiglu`: gpt-oss's
        (alpha, limit), else the gate is SiLU. Each token adds its choices in router order."""
        def activation(gate_up_rows: torch.Tensor) -> torch.Tensor:
            if swiglu is None:
                return self.silu_and_mul(gate_up_rows)
            return self.clamped_swiglu(gate_up_rows, *swiglu)

        return grouped_experts(x, expert_ids, routing, gate_up, down, gate_up_bias, down_bias,
                               self.expert_linear, activation)

    def rotary_kv_write(self, qkv: torch.Tensor, positions: torch.Tensor,
                        cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, num_heads: int,
                        num_kv_heads: int, block_size: int) -> torch.Tensor:
        """Rotate q and k (in float32, HF's rotate_half), write k and v into the cache;
        returns q [num_tokens, heads, head_dim]."""
        q, k, v = self._rotate(qkv, positions, cos_sin, num_heads, num_kv_heads)
        write_kv_reference(k_cache, v_cache, k, v, slot_mapping, block_size)
        return q

    @staticmethod
    def _rotate(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                num_heads: int, num_kv_heads: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q rotated in the model dtype, k rotated in float32, v), each [tokens, heads, d]."""
        num_tokens = qkv.shape[0]
        head_dim = cos_sin.shape[1]
        qk = qkv[:, :(num_heads + num_kv_heads) * head_dim].view(num_tokens, -1, head_dim)
        rotated = rotate(qk, cos_sin[positions].unsqueeze(1))  # table [tokens, 1, head_dim]
        # k goes to the cache from float32 (a bf16 cache rounds it once, int8 quantizes it).
        q, k = rotated[:, :num_heads].to(qkv.dtype), rotated[:, num_heads:]
        start = (num_heads + num_kv_heads) * head_dim
        v = qkv[:, start:start + num_kv_heads * head_dim].view(num_tokens, num_kv_heads,
                                                               head_dim)
        return q, k, v

    def rotary_kv_write_int4(self, qkv: torch.Tensor, positions: torch.Tensor,
                             cos_sin: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, k_stage: torch.Tensor,
                             v_stage: torch.Tensor, meta: AttentionMetadata, num_heads: int,
                             num_kv_heads: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """rotary_kv_write for an int4 cache (kv_int4.py: sealing and staging); returns q
        and this step's exact K and V (float32 [tokens, kv_heads, d]), which its attention
        reads for these tokens."""
        q, k, v = self._rotate(qkv, positions, cos_sin, num_heads, num_kv_heads)
        k, v = k.contiguous(), v.float().contiguous()
        write_kv_int4_reference(k_cache, v_cache, k_stage, v_stage, k, v, meta)
        return q, k, v

    def paged_attention_int4(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                             k_cache: torch.Tensor, v_cache: torch.Tensor,
                             k_stage: torch.Tensor, v_stage: torch.Tensor,
                             meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention_int4_reference(q, k_new, v_new, k_cache, v_cache, k_stage,
                                              v_stage, meta, scale)

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, window: int | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention over the paged cache; a sliding-window layer's queries see only
        the last `window` positions (their own included); `sinks` (float32 [heads]) add a
        logit per head without a value (gpt-oss)."""
        return paged_attention_reference(q, k_cache, v_cache, meta, scale, window, sinks)

    def init_thread(self) -> None:
        """Make this thread's first parallel call into the kernels (core_split.py)."""

    def pin_threads(self) -> list[int]:
        """Pin the intra-op threads to cores where the kernels know how; returns the CPU of
        each thread (-1: not pinned)."""
        return [-1] * torch.get_num_threads()

    def sample(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor, u: torch.Tensor, adjustments: list[Adjustments],
               masks: TokenMasks | None = None) -> torch.Tensor:
        """One token per row (sampler.py has the semantics); parameters are CPU tensors."""
        return reference_sample(logits, temperature, top_k, top_p, u, adjustments, masks)

    def token_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, num_top: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return reference_logprobs(logits, tokens, num_top)


class CpuKernels(TorchKernels):
    """minimill's compiled CPU kernels (float32 and bfloat16)."""

    name = "native-cpu"

    # The batch size oneDNN lays packed weights out for; it serves every batch size.
    _PACK_FOR_ROWS = 256
    # Most rows per GEMM call (see `linear`).
    _LINEAR_ROWS = 512
    # Rows of every bf16 GEMM call on a CPU with AMX (see `linear`): a decode step's group of
    # sequences (one per core) is about this many rows at a full batch. (64 ran the
    # vocabulary projection at half the speed in the engine; 128 is invariant too.)
    _AMX_ROWS = 128
    # Rows of every bf16 GEMM call of an expert on a CPU with AMX (`expert_linear`): an
    # expert sees a few of a step's tokens (top_k / num_experts of them: 16 of a 128-token
    # step for top-8 of 64), and padding those to _AMX_ROWS multiplied zeros for the most part.
    # Measured on qwen3-moe-2.9b-a0.7b's layer, one thread, 128 and 256 tokens: 32 beat 16
    # (an expert's weights streamed once per call, and 16 splits more experts in two) and 64.
    _EXPERT_ROWS = 32
    # Rows of an AMX tile: experts packed for the tiles take their rows in multiples of it.
    _AMX_TILE_ROWS = 16

    def __init__(self) -> None:
        from minimill.engine.hardware import cpu_info

        self._ops = torch.ops.minimill
        self._mkldnn = torch.backends.mkldnn.is_available()
        # oneDNN packs bf16 weights only where the CPU converts bf16 itself (AVX-512 BW/VL/DQ
        # or AVX-NE-CONVERT): on AVX2 alone the reorder raises, and bf16 GEMMs go unpacked.
        self._mkldnn_bf16 = self._mkldnn and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        self._amx_bf16 = "amx_bf16" in cpu_info().flags
        # The kernels' own AMX GEMM: built where the compiler could target the tiles, and
        # granted by the OS (Linux hands tile state to a process that asks).
        self._amx_tiles = self._amx_bf16 and bool(self._ops.amx_available())
        # Output columns of a float32 weight's panel (csrc/panel_gemm.cpp).
        self._panel_width = int(self._ops.panel_width())
        # float32 weights of the dense layers in panels too, where that was measured faster
        # than oneDNN's GEMM: on AVX2 (a Zen 3 core, SmolLM2's layers at 64-256 rows). Where
        # the CPU has AVX-512, oneDNN's keeps them (not measured there).
        # MINIMILL_PANEL_GEMM=0 keeps every weight in oneDNN's layout, experts included.
        self._panels = os.environ.get("MINIMILL_PANEL_GEMM", "1") != "0"
        self._dense_panels = self._panels and cpu_info().vector_isa == "avx2"

    def init_thread(self) -> None:
        # The kernel library keeps its own once-per-thread set-up of the thread count.
        x = torch.ones(1, 32)
        self._ops.rms_norm(torch.empty_like(x), x, torch.ones(32), 1e-6)

    def pin_threads(self) -> list[int]:
        import os

        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        return list(self._ops.pin_threads(cpus))

    def prepare_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """Prepacked into oneDNN's blocked layout: the GEMM skips re-blocking the weight on
        every call; or, float32 on AVX2, into the panels of csrc/panel_gemm.cpp."""
        if self._dense_panels and self._fits_panels(weight):
            return self._ops.panel_pack_weight(weight.contiguous())
        if not self._mkldnn or (weight.dtype == torch.bfloat16 and not self._mkldnn_bf16):
            return weight.contiguous()
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), self._PACK_FOR_ROWS)

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T (+ bias), batch-invariant: each row's result is the same whatever
        else is in the batch, so a request computes the same numbers alone or in a crowd, in
        a prompt chunk or a decode step (a resumed request continues exactly). oneDNN picks
        its reduction order by the number of rows: a single row takes a matrix-vector path
        and very tall inputs a split one, so rows go in as chunks of 2.._LINEAR_ROWS.

        Where the CPU has AMX, a bf16 GEMM's reduction order changes with the row count
        across the whole range (measured: a row's result at 32 rows differs from the same
        row's at 512, and the vocabulary projection's at 64 from its at 128), but not with the
        row's place in the call, the other rows or the thread count. There every call gets
        exactly _AMX_ROWS rows, the last chunk padded with zeros: some wasted work, against
        AMX's 5-7x over the bf16 vector path."""
        rows = x.shape[0]
        if weight.dim() == 3:  # float32 panels: any row count, each row's result its own
            return self._ops.panel_linear(x if x.stride(1) == 1 else x.contiguous(), weight,
                                          bias)
        if self._amx_bf16 and x.dtype == torch.bfloat16 and weight.is_mkldnn:
            return self._linear_fixed_rows(x, weight, bias, self._AMX_ROWS)
        if rows == 1:
            return self._linear(x.expand(2, -1), weight, bias)[:1]
        if rows <= self._LINEAR_ROWS:
            return self._linear(x, weight, bias)
        return torch.cat([self.linear(x[i:i + self._LINEAR_ROWS], weight, bias)
                          for i in range(0, rows, self._LINEAR_ROWS)])

    def _linear_fixed_rows(self, x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None, tile: int) -> torch.Tensor:
        rows = x.shape[0]
        full = rows - rows % tile
        parts = [self._linear(x[i:i + tile], weight, bias) for i in range(0, full, tile)]
        if full < rows or not rows:  # no rows: one padded tile gives the output's shape
            padded = x.new_zeros(tile, x.shape[1])
            padded[:rows - full] = x[full:]
            parts.append(self._linear(padded, weight, bias)[:rows - full])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def prepare_expert_weights(self, gate_up: torch.Tensor, down: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the CPU has AMX, an expert's bf16 weights are packed into AMX tiles' layout
        (csrc/amx_gemm.cpp): an expert's few rows stream them once per call at the memory's
        speed, where oneDNN's GEMM padded them to _EXPERT_ROWS and ran at a fraction of it
        (one qwen3-moe-2.9b-a0.7b layer's experts at 16 rows each: 16.6 against 28.3 ms).
        Both or neither (the experts' call takes one kind): shapes the tiles do not divide
        keep oneDNN's layout, as for `linear`.

        float32 experts are packed in panels (csrc/panel_gemm.cpp): an expert's 8 to 16 rows
        of a lane's step ran on one AVX2 core at 25 GFLOP/s in oneDNN's GEMM, a third of the
        core's FMA rate; the panels take any row count with no padding, each row's result
        that row's alone."""
        if self._amx_tiles and all(w.dtype == torch.bfloat16 and w.device.type == "cpu"
                                   and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0
                                   for w in (gate_up, down)):
            return (self._ops.amx_pack_weight(gate_up.contiguous()),
                    self._ops.amx_pack_weight(down.contiguous()))
        if self._panels and all(self._fits_panels(w) for w in (gate_up, down)):
            return (self._ops.panel_pack_weight(gate_up.contiguous()),
                    self._ops.panel_pack_weight(down.contiguous()))
        return self.prepare_weight(gate_up), self.prepare_weight(down)

    def _fits_panels(self, weight: torch.Tensor) -> bool:
        return (weight.dtype == torch.float32 and weight.device.type == "cpu"
                and weight.dim() == 2 and weight.shape[0] % self._panel_width == 0)

    def expert_linear(self, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        """`linear`, on the AMX tiles for a weight `prepare_expert_weights` packed for them,
        else with _EXPERT_ROWS rows per call where `linear` would take _AMX_ROWS: batch-
        invariant all the same (a tile's row depends on that row alone; any fixed row count
        is invariant for oneDNN), with less padding."""
        if weight.dim() == 4:
            return self._ops.amx_linear(x if x.stride(1) == 1 else x.contiguous(), weight, bias)
        if self._amx_bf16 and x.dtype == torch.bfloat16 and weight.is_mkldnn:
            return self._linear_fixed_rows(x, weight, bias, self._EXPERT_ROWS)
        return self.linear(x, weight, bias)

    def experts(self, x: torch.Tensor, expert_ids: torch.Tensor, routing: torch.Tensor,
                gate_up: Sequence[torch.Tensor], down: Sequence[torch.Tensor],
                gate_up_bias: Sequence[torch.Tensor] | None = None,
                down_bias: Sequence[torch.Tensor] | None = None,
                swiglu: tuple[float, float] | None = None) -> torch.Tensor:
        """The whole layer in one C++ call (csrc/moe.cpp): the same GEMM calls as
        `expert_linear` makes, so the same bits as TorchKernels.experts on these kernels."""
        if x.dtype not in (torch.float32, torch.bfloat16):
            return super().experts(x, expert_ids, routing, gate_up, down, gate_up_bias,
                                   down_bias, swiglu)
        if gate_up[0].dim() == 4:  # packed for the AMX tiles: rows padded to one tile
            tile = self._AMX_TILE_ROWS
        else:
            tile = self._EXPERT_ROWS if self._amx_bf16 and x.dtype == torch.bfloat16 else 0
        alpha, limit = swiglu if swiglu is not None else (None, None)
        return self._ops.moe_experts(x if x.stride(1) == 1 else x.contiguous(), expert_ids,
                                     routing, list(gate_up), list(down),
                                     None if gate_up_bias is None else list(gate_up_bias),
                                     None if down_bias is None else list(down_bias), alpha,
                                     limit, tile, self._LINEAR_ROWS)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        if not weight.is_mkldnn:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        self._ops.rms_norm(out, x, weight, eps)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        self._ops.add_rms_norm(x, residual, weight, eps)
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        self._ops.silu_and_mul(out, gate_up)
        return out

    def clamped_swiglu(self, gate_up: torch.Tensor, alpha: float, limit: float
                       ) -> torch.Tensor:
        if gate_up.dtype not in (torch.float32, torch.bfloat16):
            return super().clamped_swiglu(gate_up, alpha, limit)
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        self._ops.clamped_swiglu(out, gate_up, alpha, limit)
        return out

    def rotary_kv_write(self, qkv: torch.Tensor, positions: torch.Tensor,
                        cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, num_heads: int,
                        num_kv_heads: int, block_size: int) -> torch.Tensor:
        q = qkv.new_empty(qkv.shape[0], num_heads, cos_sin.shape[1])
        self._ops.rotary_kv_write(qkv, positions, cos_sin, q, k_cache, v_cache, slot_mapping,
                                  num_heads, num_kv_heads, block_size)
        return q

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, window: int | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        self._ops.paged_attention(out, q, k_cache, v_cache, meta.block_tables,
                                  meta.query_start, meta.seq_lens, scale, meta.block_size,
                                  window, sinks)
        return out

    def rotary_kv_write_int4(self, qkv: torch.Tensor, positions: torch.Tensor,
                             cos_sin: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, k_stage: torch.Tensor,
                             v_stage: torch.Tensor, meta: AttentionMetadata, num_heads: int,
                             num_kv_heads: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotary, sealing and staging in C++; returns q and this step's exact K and V, as
        TorchKernels does (the same bits: rotary_split does the reference's float32 math)."""
        step = meta.int4
        assert step is not None
        tokens, head_dim = qkv.shape[0], cos_sin.shape[1]
        q = qkv.new_empty(tokens, num_heads, head_dim)
        k = torch.empty(tokens, num_kv_heads, head_dim)
        v = torch.empty(tokens, num_kv_heads, head_dim)
        self._ops.rotary_split(qkv, positions, cos_sin, q, k, v, num_heads, num_kv_heads)
        self._ops.kv_int4_write(k, v, k_cache, v_cache,
                                k_stage, v_stage, step.stage_tokens, step.stage_mapping,
                                step.seal_blocks, step.seal_stage, step.seal_tokens,
                                step.seal_rows, step.seal_offsets, meta.block_size)
        return q, k, v

    def paged_attention_int4(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                             k_cache: torch.Tensor, v_cache: torch.Tensor,
                             k_stage: torch.Tensor, v_stage: torch.Tensor,
                             meta: AttentionMetadata, scale: float) -> torch.Tensor:
        assert meta.int4 is not None
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        self._ops.paged_attention_int4(out, q, k_new, v_new, k_cache, v_cache, k_stage, v_stage,
                                       meta.block_tables, meta.int4.stage_slots,
                                       meta.query_start, meta.seq_lens, scale, meta.block_size)
        return out

    def sample(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor, u: torch.Tensor, adjustments: list[Adjustments],
               masks: TokenMasks | None = None) -> torch.Tensor:
        if logits.dtype not in (torch.float32, torch.bfloat16):
            return super().sample(logits, temperature, top_k, top_p, u, adjustments, masks)
        offsets = [0]
        ids: list[int] = []
        values: list[float] = []
        for adjust in adjustments:
            ids.extend(t for t, _ in adjust)
            values.extend(v for _, v in adjust)
            offsets.append(len(ids))
        out = torch.empty(logits.shape[0], dtype=torch.long)
        if masks is None:
            masks = TokenMasks(torch.full((logits.shape[0],), -1, dtype=torch.long),
                               torch.empty(0, 0, dtype=torch.int32))
        self._ops.sample_tokens(logits.contiguous(), temperature, top_k, top_p, u,
                                torch.tensor(offsets, dtype=torch.long),
                                torch.tensor(ids, dtype=torch.long),
                                torch.tensor(values, dtype=torch.float32),
                                masks.index, masks.words.contiguous(), out)
        return out

    def token_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, num_top: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if logits.dtype not in (torch.float32, torch.bfloat16):
            return super().token_logprobs(logits, tokens, num_top)
        rows = logits.shape[0]
        chosen = torch.empty(rows, dtype=torch.float32)
        top_ids = torch.empty(rows, num_top, dtype=torch.long)
        top_values = torch.empty(rows, num_top, dtype=torch.float32)
        self._ops.token_logprobs(logits.contiguous(), tokens.contiguous(), num_top, chosen,
                                 top_ids, top_values)
        return chosen, top_ids, top_values


def select_kernels(choice: str, device: torch.device, dtype: torch.dtype, block_size: int,
                   head_dim: int | None) -> tuple[TorchKernels, str]:
    """The kernels for this engine and why: `auto` takes the compiled CPU kernels where they
    apply and build, `native` insists on them, `torch` is the portable path. `head_dim`: the
    kv heads' width that paged attention reads (None: the model's attention never calls it,
    as MLA's does not)."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {choice!r}")
    if choice == "torch":
        return TorchKernels(), "asked for the portable PyTorch path"
    why_not = None
    if device.type != "cpu":
        why_not = f"no compiled kernels for {device.type}"
    elif dtype not in (torch.float32, torch.bfloat16):
        why_not = f"the CPU kernels support float32 and bfloat16, not {dtype}"
    elif block_size % 16 or (head_dim is not None and (head_dim % 32 or head_dim > 256)):
        why_not = (f"the CPU kernels need block_size a multiple of 16 and head_dim a multiple "
                   f"of 32 up to 256, not {block_size} and {head_dim}")
    else:
        from minimill.engine.native import load_cpu_kernels

        state = load_cpu_kernels()
        if state.available:
            return CpuKernels(), state.reason
        why_not = state.reason
    if choice == "native":
        raise ValueError(f"kernels='native' cannot be used: {why_not}")
    return TorchKernels(), why_not
