// Registers minimill's CPU kernels as torch.ops.minimill.*, and pins the intra-op threads.

#include <ATen/Parallel.h>
#include <torch/library.h>

#ifdef __linux__
#include <sched.h>
#endif

#include "ops.h"

namespace minimill {

// Threads. Each intra-op (OpenMP) worker thread i >= 1 is pinned to cpus[i % n], so the
// engine's threads stay on their cores with their caches warm. Thread 0 is the caller's own
// thread: it is left alone (a pinned caller would pass its one-CPU mask on to every process
// it starts). Returns the CPU each thread ended on (-1: not pinned).

std::vector<int64_t> pin_threads(std::vector<int64_t> cpus) {
  const int threads = at::get_num_threads();
  std::vector<int64_t> pinned(threads, -1);
  if (cpus.empty()) return pinned;
#ifdef __linux__
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const int t = at::get_thread_num();
    if (t == 0 || t >= threads) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    const int64_t cpu = cpus[t % cpus.size()];
    CPU_SET(static_cast<int>(cpu), &set);
    if (sched_setaffinity(0, sizeof(set), &set) == 0) pinned[t] = cpu;
  });
#endif
  return pinned;
}

}  // namespace minimill

TORCH_LIBRARY(minimill, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("clamped_swiglu(Tensor(a!) out, Tensor gate_up, float alpha, float limit) -> ()");
  m.def("moe_experts(Tensor x, Tensor expert_ids, Tensor routing, Tensor[] gate_up, "
        "Tensor[] down, Tensor[]? gate_up_bias, Tensor[]? down_bias, float? swiglu_alpha, "
        "float? swiglu_limit, int tile, int max_rows) -> Tensor");
  m.def("rotary_kv_write(Tensor qkv, Tensor positions, Tensor cos_sin, Tensor(a!) q_out, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, int num_heads, "
        "int num_kv_heads, int block_size) -> ()");
  m.def("rotary_split(Tensor qkv, Tensor positions, Tensor cos_sin, Tensor(a!) q_out, "
        "Tensor(b!) k_out, Tensor(c!) v_out, int num_heads, int num_kv_heads) -> ()");
  m.def("sample_tokens(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, "
        "Tensor u, Tensor adjust_offsets, Tensor adjust_ids, Tensor adjust_values, "
        "Tensor mask_index, Tensor mask_words, Tensor(a!) out) -> ()");
  m.def("token_logprobs(Tensor logits, Tensor tokens, int num_top, Tensor(a!) chosen, "
        "Tensor(b!) top_ids, Tensor(c!) top_values) -> ()");
  m.def("pin_threads(int[] cpus) -> int[]");
  m.def("amx_available() -> bool");
  m.def("amx_pack_weight(Tensor weight) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("panel_width() -> int");
  m.def("panel_pack_weight(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor query_start, Tensor seq_lens, float scale, "
        "int block_size, int? window=None, Tensor? sinks=None) -> ()");
  m.def("paged_attention_int4(Tensor(a!) out, Tensor q, Tensor k_new, Tensor v_new, "
        "Tensor k_cache, Tensor v_cache, "
        "Tensor k_stage, Tensor v_stage, Tensor block_tables, Tensor stage_slots, "
        "Tensor query_start, Tensor seq_lens, float scale, int block_size) -> ()");
  m.def("kv_int4_write(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor(c!) k_stage, Tensor(d!) v_stage, Tensor stage_tokens, Tensor stage_mapping, "
        "Tensor seal_blocks, Tensor seal_stage, Tensor seal_tokens, Tensor seal_rows, "
        "Tensor seal_offsets, int block_size) -> ()");
}

// moe_experts' weights are oneDNN tensors (the MkldnnCPU key), its activations plain CPU ones.
TORCH_LIBRARY_IMPL(minimill, CompositeExplicitAutograd, m) {
  m.impl("pin_threads", &minimill::pin_threads);
  m.impl("amx_available", &minimill::amx_available);
  m.impl("panel_width", &minimill::panel_width);
  m.impl("moe_experts", &minimill::moe_experts);
}

TORCH_LIBRARY_IMPL(minimill, CPU, m) {
  m.impl("rms_norm", &minimill::rms_norm);
  m.impl("add_rms_norm", &minimill::add_rms_norm);
  m.impl("silu_and_mul", &minimill::silu_and_mul);
  m.impl("clamped_swiglu", &minimill::clamped_swiglu);
  m.impl("rotary_kv_write", &minimill::rotary_kv_write);
  m.impl("rotary_split", &minimill::rotary_split);
  m.impl("paged_attention", &minimill::paged_attention);
  m.impl("paged_attention_int4", &minimill::paged_attention_int4);
  m.impl("kv_int4_write", &minimill::kv_int4_write);
  m.impl("sample_tokens", &minimill::sample_tokens);
  m.impl("token_logprobs", &minimill::token_logprobs);
  m.impl("amx_pack_weight", &minimill::amx_pack_weight);
  m.impl("amx_linear", &minimill::amx_linear);
  m.impl("panel_pack_weight", &minimill::panel_pack_weight);
  m.impl("panel_linear", &minimill::panel_linear);
}
