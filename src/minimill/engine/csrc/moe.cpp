// Routed experts in one call (moe.py): (token, choice) pairs grouped by expert, one GEMM per
// expert for its gate and up (fused) and one for its down projection on the engine's prepacked
// weights (the AMX tiles' layout where the CPU has them, amx_gemm.cpp; float32 panels where it
// has not, panel_gemm.cpp; else oneDNN's), the
// experts' activation, and each token's weighted sum of its choices in the
// router's order. The GEMM calls follow CpuKernels.linear's rules for the number of rows per
// call (`tile` rows exactly, zero-padded; or 2..max_rows), so each row's numbers do not depend
// on the other rows: a token gets the same bits alone or in any batch.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "ops.h"
#include "vec.h"

namespace minimill {

namespace {

// ---------------------------------------------------------------------------------------------
// GEMMs, as CpuKernels.linear calls them.

at::Tensor gemm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  if (!w.is_mkldnn()) return at::linear(x, w, b);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, c10::string_view,
                                         c10::List<std::optional<at::Scalar>>,
                                         std::optional<c10::string_view>)>();
  return op.call(x, w, b, "none", c10::List<std::optional<at::Scalar>>(), "");
}

// x [rows, in] with rows >= 1 -> [rows, out]. oneDNN's reduction order depends on the row
// count: a single row takes a matrix-vector path (so it goes in doubled) and very tall inputs a
// split one (so they go in max_rows at a time).
at::Tensor gemm_chunked(const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& b, int64_t max_rows) {
  const int64_t rows = x.size(0);
  if (rows == 1) return gemm(x.expand({2, -1}), w, b).narrow(0, 0, 1);
  if (rows <= max_rows) return gemm(x, w, b);
  std::vector<at::Tensor> parts;
  for (int64_t i = 0; i < rows; i += max_rows) {
    parts.push_back(gemm_chunked(x.narrow(0, i, std::min(max_rows, rows - i)), w, b, max_rows));
  }
  return at::cat(parts);
}

// Any row count: float32 panels (panel_gemm.cpp) take it whole, oneDNN's weights by the
// chunked rule above (a weight in each layout, as CpuKernels.prepare_weight left it).
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w,
                       const std::optional<at::Tensor>& b, int64_t max_rows) {
  if (w.dim() == 3) return panel_linear(x, w, b);
  return gemm_chunked(x, w, b, max_rows);
}

// ---------------------------------------------------------------------------------------------
// Activations, row by row: [rows, 2I] (gate, then up) -> [rows, I].

// gpt-oss: gate clamped above at `limit`, up to [-limit, limit], (up + 1) * gate *
// sigmoid(alpha * gate), rounded to the dtype after every step as PyTorch's ops on it would.
template <typename T>
void clamped_swiglu_rows(T* out, int64_t out_stride, const T* gate_up, int64_t in_stride,
                         int64_t rows, int64_t n, float alpha, float limit) {
  auto sigmoid = [](float v) { return 1.f / (1.f + std::exp(-v)); };
  const fVec v_one(1.f), v_alpha(alpha), v_limit(limit), v_neg_limit(-limit);
  at::parallel_for(0, rows, grain_rows(4 * n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* g = gate_up + r * in_stride;
      const T* u = g + n;
      T* o = out + r * out_stride;
      int64_t i = 0;
      for (; i + kVec <= n; i += kVec) {
        const fVec gate = at::vec::minimum(load_f(g + i), v_limit);
        const fVec up = at::vec::clamp(load_f(u + i), v_neg_limit, v_limit);
        const fVec scaled = round_to<T>(gate * v_alpha);
        const fVec sig = round_to<T>(v_one / (v_one + scaled.neg().exp_u20()));
        const fVec glu = round_to<T>(gate * sig);
        store_f(o + i, round_to<T>(up + v_one) * glu);
      }
      for (; i < n; ++i) {
        const float gate = std::min(to_f(g[i]), limit);
        const float up = std::clamp(to_f(u[i]), -limit, limit);
        const float sig = round_to<T>(sigmoid(round_to<T>(gate * alpha)));
        o[i] = from_f<T>(round_to<T>(up + 1.f) * round_to<T>(gate * sig));
      }
    }
  });
}

struct Activation {
  bool swiglu;  // else SiLU(gate) * up
  float alpha, limit;

  void operator()(const at::Tensor& out, const at::Tensor& gate_up) const {
    if (!swiglu) {
      silu_and_mul(out, gate_up);
    } else if (gate_up.scalar_type() == at::kFloat) {
      clamped_swiglu_rows<float>(out.data_ptr<float>(), out.stride(0),
                                 gate_up.data_ptr<float>(), gate_up.stride(0), gate_up.size(0),
                                 out.size(1), alpha, limit);
    } else {
      clamped_swiglu_rows<BFloat16>(out.data_ptr<BFloat16>(), out.stride(0),
                                    gate_up.data_ptr<BFloat16>(), gate_up.stride(0),
                                    gate_up.size(0), out.size(1), alpha, limit);
    }
  }
};

// ---------------------------------------------------------------------------------------------
// The experts.

struct Expert {
  at::Tensor gate_up, down;
  std::optional<at::Tensor> gate_up_bias, down_bias;
};

// One expert's rows [n, hidden] -> its outputs, `tile` rows per GEMM call (n a multiple of it;
// the caller zero-pads), or 2..max_rows rows where tile is 0. The padding rows of the
// activation are zeros, as the down projection's own padding would be.
at::Tensor expert_mlp(const at::Tensor& rows, int64_t real_rows, const Expert& e,
                      const Activation& act, int64_t tile, int64_t max_rows) {
  if (e.gate_up.dim() == 4) {  // packed for the AMX tiles (amx_gemm.cpp): rows in 16s
    const at::Tensor gate_up = amx_linear(rows, e.gate_up, e.gate_up_bias);
    at::Tensor a = rows.new_empty({rows.size(0), gate_up.size(1) / 2});
    act(a.narrow(0, 0, real_rows), gate_up.narrow(0, 0, real_rows));
    if (real_rows < rows.size(0)) a.narrow(0, real_rows, rows.size(0) - real_rows).zero_();
    return amx_linear(a, e.down, e.down_bias);
  }
  if (tile == 0 || !e.gate_up.is_mkldnn() || !e.down.is_mkldnn()) {
    const at::Tensor gate_up = linear_rows(rows, e.gate_up, e.gate_up_bias, max_rows);
    at::Tensor a = rows.new_empty({real_rows, gate_up.size(1) / 2});
    act(a, gate_up);
    return linear_rows(a, e.down, e.down_bias, max_rows);
  }
  std::vector<at::Tensor> parts;
  for (int64_t start = 0; start < rows.size(0); start += tile) {
    const int64_t real = std::min(tile, real_rows - start);
    const at::Tensor gate_up = gemm(rows.narrow(0, start, tile), e.gate_up, e.gate_up_bias);
    at::Tensor a = rows.new_empty({tile, gate_up.size(1) / 2});
    act(a.narrow(0, 0, real), gate_up.narrow(0, 0, real));
    if (real < tile) a.narrow(0, real, tile - real).zero_();
    parts.push_back(gemm(a, e.down, e.down_bias));
  }
  return parts.size() == 1 ? parts[0] : at::cat(parts);
}

template <typename T>
void gather_rows(T* rows, const T* x, int64_t x_stride, const std::vector<int64_t>& source,
                 int64_t hidden) {
  at::parallel_for(0, static_cast<int64_t>(source.size()), grain_rows(hidden),
                   [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      T* dst = rows + r * hidden;
      if (source[r] < 0) {
        std::memset(dst, 0, hidden * sizeof(T));
      } else {
        std::memcpy(dst, x + source[r] * x_stride, hidden * sizeof(T));
      }
    }
  });
}

// v, stored: the compiler cannot fuse the product that made it into the next addition (an FMA
// rounds once where the reference rounds the product and then the sum).
template <typename V>
inline V materialized(V v) {
  asm volatile("" : : "r"(&v) : "memory");
  return v;
}

// out[t] = sum over j of round(y[t, j] * weight[t, j]), added in j's order and rounded to T
// after every step, as the reference adds its per-choice tensors.
template <typename T>
void weighted_sum(T* out, const std::vector<const T*>& y, const float* weights, int64_t tokens,
                  int64_t top_k, int64_t hidden) {
  at::parallel_for(0, tokens, grain_rows(top_k * hidden), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      T* o = out + t * hidden;
      const T* const* ys = y.data() + t * top_k;
      const float* w = weights + t * top_k;
      int64_t i = 0;
      for (; i + kVec <= hidden; i += kVec) {
        fVec acc = round_to<T>(load_f(ys[0] + i) * fVec(w[0]));
        for (int64_t j = 1; j < top_k; ++j) {
          const fVec term = materialized(round_to<T>(load_f(ys[j] + i) * fVec(w[j])));
          acc = round_to<T>(acc + term);
        }
        store_f(o + i, acc);
      }
      for (; i < hidden; ++i) {
        float acc = round_to<T>(to_f(ys[0][i]) * w[0]);
        for (int64_t j = 1; j < top_k; ++j) {
          const float term = materialized(round_to<T>(to_f(ys[j][i]) * w[j]));
          acc = round_to<T>(acc + term);
        }
        o[i] = from_f<T>(acc);
      }
    }
  });
}

template <typename T>
at::Tensor experts_impl(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& routing,
                        const std::vector<Expert>& experts, const Activation& act, int64_t tile,
                        int64_t max_rows) {
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = ids.size(1);
  const int64_t num_experts = static_cast<int64_t>(experts.size());
  const int64_t pairs = tokens * top_k;
  const int64_t* id = ids.data_ptr<int64_t>();
  // Pairs grouped by expert, each expert's in token order; each group padded to the tile.
  std::vector<int64_t> count(num_experts, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < num_experts, "moe_experts: expert id ", id[p],
                " out of range for ", num_experts, " experts");
    ++count[id[p]];
  }
  std::vector<int64_t> begin(num_experts + 1, 0);
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t padded = tile > 0 ? (count[e] + tile - 1) / tile * tile : count[e];
    begin[e + 1] = begin[e] + padded;
  }
  std::vector<int64_t> source(begin[num_experts], -1);  // row -> token (-1: padding)
  std::vector<int64_t> row_of(pairs);
  std::vector<int64_t> next(begin.begin(), begin.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) {
    row_of[p] = next[id[p]]++;
    source[row_of[p]] = p / top_k;
  }
  at::Tensor rows = x.new_empty({begin[num_experts], hidden});
  gather_rows<T>(rows.data_ptr<T>(), x.data_ptr<T>(), x.stride(0), source, hidden);

  std::vector<at::Tensor> outputs(num_experts);
  for (int64_t e = 0; e < num_experts; ++e) {
    if (count[e] == 0) continue;
    outputs[e] = expert_mlp(rows.narrow(0, begin[e], begin[e + 1] - begin[e]), count[e],
                            experts[e], act, tile, max_rows)
                     .contiguous();
    TORCH_CHECK(outputs[e].size(1) == hidden && outputs[e].scalar_type() == x.scalar_type(),
                "moe_experts: expert ", e, "'s down projection gives ", outputs[e].sizes(),
                " rows of ", outputs[e].scalar_type());
  }
  std::vector<const T*> y(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    const at::Tensor& o = outputs[id[p]];
    y[p] = o.data_ptr<T>() + (row_of[p] - begin[id[p]]) * o.stride(0);
  }
  const at::Tensor w = routing.to(at::kFloat).contiguous();
  at::Tensor out = x.new_empty({tokens, hidden});
  weighted_sum<T>(out.data_ptr<T>(), y, w.data_ptr<float>(), tokens, top_k, hidden);
  return out;
}

}  // namespace

at::Tensor moe_experts(at::Tensor x, at::Tensor expert_ids, at::Tensor routing,
                       std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down,
                       std::optional<std::vector<at::Tensor>> gate_up_bias,
                       std::optional<std::vector<at::Tensor>> down_bias,
                       std::optional<double> swiglu_alpha, std::optional<double> swiglu_limit,
                       int64_t tile, int64_t max_rows) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "moe_experts: x [tokens, hidden], rows contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "moe_experts: float32 or bfloat16 only");
  TORCH_CHECK(expert_ids.dim() == 2 && expert_ids.size(0) == x.size(0) &&
                  expert_ids.scalar_type() == at::kLong && routing.sizes() == expert_ids.sizes(),
              "moe_experts: expert_ids (int64) and routing [tokens, top_k]");
  TORCH_CHECK(gate_up.size() == down.size() && !gate_up.empty(),
              "moe_experts: as many gate_up as down weights");
  TORCH_CHECK(swiglu_alpha.has_value() == swiglu_limit.has_value(),
              "moe_experts: swiglu_alpha and swiglu_limit go together");
  TORCH_CHECK(tile >= 0 && max_rows >= 2, "moe_experts: tile >= 0 and max_rows >= 2");
  std::vector<Expert> experts(gate_up.size());
  for (size_t e = 0; e < gate_up.size(); ++e) {
    experts[e].gate_up = gate_up[e];
    experts[e].down = down[e];
    if (gate_up_bias) experts[e].gate_up_bias = gate_up_bias->at(e);
    if (down_bias) experts[e].down_bias = down_bias->at(e);
  }
  TORCH_CHECK(!gate_up_bias || gate_up_bias->size() == gate_up.size(), "moe_experts: biases");
  TORCH_CHECK(!down_bias || down_bias->size() == down.size(), "moe_experts: biases");
  const Activation act{swiglu_alpha.has_value(),
                       static_cast<float>(swiglu_alpha.value_or(0.0)),
                       static_cast<float>(swiglu_limit.value_or(0.0))};
  const at::Tensor ids = expert_ids.contiguous();
  // Weights that are not oneDNN's (no oneDNN in this build) take the chunked rule, as
  // CpuKernels.linear gives them; those packed for the AMX tiles are all packed alike.
  // Float32 ones packed in panels (panel_gemm.cpp) take any row count, as plain ones do.
  const bool tiles = gate_up[0].dim() == 4;
  for (size_t e = 0; e < gate_up.size(); ++e) {
    TORCH_CHECK((gate_up[e].dim() == 4) == tiles && (down[e].dim() == 4) == tiles,
                "moe_experts: every expert's weights packed alike");
    TORCH_CHECK((gate_up[e].dim() != 3 && down[e].dim() != 3) || x.scalar_type() == at::kFloat,
                "moe_experts: weights in float32 panels take float32 rows");
  }
  if (tiles) {
    TORCH_CHECK(tile == 16, "moe_experts: weights packed for the AMX tiles take tile=16");
  } else if (!gate_up[0].is_mkldnn()) {
    tile = 0;
  }
  if (x.size(0) == 0) return x.new_empty({0, x.size(1)});
  if (x.scalar_type() == at::kFloat) {
    return experts_impl<float>(x, ids, routing, experts, act, tile, max_rows);
  }
  return experts_impl<BFloat16>(x, ids, routing, experts, act, tile, max_rows);
}

void clamped_swiglu(at::Tensor out, at::Tensor gate_up, double alpha, double limit) {
  check_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && out.stride(1) == 1 &&
                  gate_up.size(1) == 2 * out.size(1) && gate_up.size(0) == out.size(0) &&
                  out.scalar_type() == gate_up.scalar_type(),
              "clamped_swiglu: out [T, I] and gate_up [T, 2I] with contiguous rows");
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16,
              "clamped_swiglu: float32 or bfloat16 only");
  Activation{true, static_cast<float>(alpha), static_cast<float>(limit)}(out, gate_up);
}

}  // namespace minimill
