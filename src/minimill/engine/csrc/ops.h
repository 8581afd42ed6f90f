// The operators minimill registers as torch.ops.minimill.* (registration.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace minimill {

void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);
void add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void silu_and_mul(at::Tensor out, at::Tensor gate_up);
void rotary_kv_write(at::Tensor qkv, at::Tensor positions, at::Tensor cos_sin, at::Tensor q_out,
                     at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
                     int64_t num_heads, int64_t num_kv_heads, int64_t block_size);
void rotary_split(at::Tensor qkv, at::Tensor positions, at::Tensor cos_sin, at::Tensor q_out,
                  at::Tensor k_out, at::Tensor v_out, int64_t num_heads, int64_t num_kv_heads);
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                     at::Tensor block_tables, at::Tensor query_start, at::Tensor seq_lens,
                     double scale, int64_t block_size, std::optional<int64_t> window,
                     const std::optional<at::Tensor>& sinks);
void paged_attention_int4(at::Tensor out, at::Tensor q, at::Tensor k_new, at::Tensor v_new,
                          at::Tensor k_cache, at::Tensor v_cache, at::Tensor k_stage,
                          at::Tensor v_stage, at::Tensor block_tables, at::Tensor stage_slots,
                          at::Tensor query_start, at::Tensor seq_lens, double scale,
                          int64_t block_size);
void kv_int4_write(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                   at::Tensor k_stage, at::Tensor v_stage, at::Tensor stage_tokens,
                   at::Tensor stage_mapping, at::Tensor seal_blocks, at::Tensor seal_stage,
                   at::Tensor seal_tokens, at::Tensor seal_rows, at::Tensor seal_offsets,
                   int64_t block_size);
void sample_tokens(at::Tensor logits, at::Tensor temperature, at::Tensor top_k, at::Tensor top_p,
                   at::Tensor u, at::Tensor adjust_offsets, at::Tensor adjust_ids,
                   at::Tensor adjust_values, at::Tensor mask_index, at::Tensor mask_words,
                   at::Tensor out);
void token_logprobs(at::Tensor logits, at::Tensor tokens, int64_t num_top, at::Tensor chosen,
                    at::Tensor top_ids, at::Tensor top_values);
at::Tensor moe_experts(at::Tensor x, at::Tensor expert_ids, at::Tensor routing,
                       std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down,
                       std::optional<std::vector<at::Tensor>> gate_up_bias,
                       std::optional<std::vector<at::Tensor>> down_bias,
                       std::optional<double> swiglu_alpha, std::optional<double> swiglu_limit,
                       int64_t tile, int64_t max_rows);
bool amx_available();
at::Tensor amx_pack_weight(at::Tensor weight);
at::Tensor amx_linear(at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias);
int64_t panel_width();
at::Tensor panel_pack_weight(at::Tensor weight);
at::Tensor panel_linear(at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias);
void clamped_swiglu(at::Tensor out, at::Tensor gate_up, double alpha, double limit);
std::vector<int64_t> pin_threads(std::vector<int64_t> cpus);

}  // namespace minimill
