// float32 GEMMs of few rows, for the experts of a mixture-of-experts layer on CPUs without AMX
// (moe.cpp): an expert sees a few of a step's tokens (8 to 16 of a lane's 64-128 for top-8 of
// 64), where oneDNN's float32 GEMM ran at a third of the core's FMA rate (25 GFLOP/s on one
// AVX2 core at 8 rows, measured on qwen3-moe-2.9b-a0.7b's experts).
//
// The weight W [N, K] (out = x @ W^T + bias) is packed once into panels of kPanel output
// columns, each panel K-major ([N / kPanel, K, kPanel]): a panel streams from memory in one
// contiguous pass and stays in L2 while every block of up to kRows input rows multiplies it,
// the accumulators of a block (kRows rows x kPanel columns) held in registers.
//
// Each output element is one float32 accumulator that adds x[r][k] * W[n][k] with one fused
// multiply-add per k, k = 0 .. K-1 in order, then the bias: a row's result depends on that row
// alone, whatever the other rows, the row count, the row's block or the thread count, so a
// token gets the same bits alone or in any batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "vec.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace minimill {

namespace {

constexpr int64_t kPanel = 2 * kVec;  // output columns per panel: two vectors
// K steps ahead of the multiply that each load of the panel asks for: the first block reads the
// panel from memory, and one core's loads alone kept ~10 GB/s in flight.
constexpr int64_t kPrefetchK = 32;
constexpr int64_t kRows = 6;          // rows per block: 12 accumulators, 2 weights, 1 input

// The native vector type under fVec: GCC keeps an array of those in registers, where it stored
// an array of fVec (a class) to the stack at every k.
#if defined(CPU_CAPABILITY_AVX512)
using Native = __m512;
inline Native zero() { return _mm512_setzero_ps(); }
inline Native load(const float* p) { return _mm512_loadu_ps(p); }
inline Native broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Native fma(Native a, Native b, Native c) { return _mm512_fmadd_ps(a, b, c); }
inline Native add(Native a, Native b) { return _mm512_add_ps(a, b); }
inline void store(float* p, Native v) { _mm512_storeu_ps(p, v); }
#elif defined(CPU_CAPABILITY_AVX2)
using Native = __m256;
inline Native zero() { return _mm256_setzero_ps(); }
inline Native load(const float* p) { return _mm256_loadu_ps(p); }
inline Native broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Native fma(Native a, Native b, Native c) { return _mm256_fmadd_ps(a, b, c); }
inline Native add(Native a, Native b) { return _mm256_add_ps(a, b); }
inline void store(float* p, Native v) { _mm256_storeu_ps(p, v); }
#else
using Native = fVec;
inline Native zero() { return fVec(0.f); }
inline Native load(const float* p) { return fVec::loadu(p); }
inline Native broadcast(const float* p) { return fVec(*p); }
inline Native fma(Native a, Native b, Native c) { return at::vec::fmadd(a, b, c); }
inline Native add(Native a, Native b) { return a + b; }
inline void store(float* p, Native v) { v.store(p); }
#endif

// out[r][n0 .. n0 + kPanel) for R rows of x, over one panel. The accumulators are named, not
// an array: GCC stored an array of them to the stack at every k.
template <int R>
void panel_block(const float* x, int64_t x_stride, const float* panel, int64_t k,
                 const float* bias, float* out, int64_t out_stride) {
  static_assert(R >= 1 && R <= 6, "panel_block: 1 to 6 rows");
  Native l0 = zero(), h0 = zero(), l1 = zero(), h1 = zero(), l2 = zero(), h2 = zero();
  Native l3 = zero(), h3 = zero(), l4 = zero(), h4 = zero(), l5 = zero(), h5 = zero();
  const float* x0 = x;
  const float* x1 = x0 + x_stride;
  const float* x2 = x1 + x_stride;
  const float* x3 = x2 + x_stride;
  const float* x4 = x3 + x_stride;
  const float* x5 = x4 + x_stride;
#define MINIMILL_PANEL_ROW(n)                                                 \
  if constexpr (R > n) {                                                      \
    const Native xv = broadcast(x##n + i);                                    \
    l##n = fma(xv, w_lo, l##n);                                               \
    h##n = fma(xv, w_hi, h##n);                                               \
  }
  for (int64_t i = 0; i < k; ++i) {
    __builtin_prefetch(panel + (i + kPrefetchK) * kPanel);
    const Native w_lo = load(panel + i * kPanel);
    const Native w_hi = load(panel + i * kPanel + kVec);
    MINIMILL_PANEL_ROW(0)
    MINIMILL_PANEL_ROW(1)
    MINIMILL_PANEL_ROW(2)
    MINIMILL_PANEL_ROW(3)
    MINIMILL_PANEL_ROW(4)
    MINIMILL_PANEL_ROW(5)
  }
#undef MINIMILL_PANEL_ROW
  const Native b_lo = bias != nullptr ? load(bias) : zero();
  const Native b_hi = bias != nullptr ? load(bias + kVec) : zero();
  auto put = [&](int r, Native lo, Native hi) {
    if (bias != nullptr) {
      lo = add(lo, b_lo);
      hi = add(hi, b_hi);
    }
    store(out + r * out_stride, lo);
    store(out + r * out_stride + kVec, hi);
  };
  put(0, l0, h0);
  if constexpr (R > 1) put(1, l1, h1);
  if constexpr (R > 2) put(2, l2, h2);
  if constexpr (R > 3) put(3, l3, h3);
  if constexpr (R > 4) put(4, l4, h4);
  if constexpr (R > 5) put(5, l5, h5);
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*,
                         int64_t);
constexpr BlockFn kBlocks[kRows + 1] = {nullptr,           panel_block<1>, panel_block<2>,
                                        panel_block<3>,    panel_block<4>, panel_block<5>,
                                        panel_block<6>};

void check_packed(const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel &&
                  packed.scalar_type() == at::kFloat && packed.is_contiguous(),
              "panel_linear: the weight must come from panel_pack_weight");
}

}  // namespace

int64_t panel_width() { return kPanel; }

at::Tensor panel_pack_weight(at::Tensor weight) {
  check_cpu(weight, "weight");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "panel_pack_weight: a float32 [out, in] weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kPanel == 0, "panel_pack_weight: out (", n, ") must be a multiple of ",
              kPanel);
  // [N, K] -> [N / P, P, K] -> [N / P, K, P]
  return weight.reshape({n / kPanel, kPanel, k}).transpose(1, 2).contiguous();
}

at::Tensor panel_linear(at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias) {
  check_cpu(x, "x");
  check_packed(packed);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "panel_linear: x float32 [rows, in] with contiguous rows");
  const int64_t panels = packed.size(0), k = packed.size(1), n = panels * kPanel;
  TORCH_CHECK(x.size(0) == 0 || x.size(1) == k, "panel_linear: x has ", x.size(1),
              " columns, the weight ", k);
  at::Tensor b;
  if (bias) {
    TORCH_CHECK(bias->numel() == n, "panel_linear: bias of ", n, " values");
    b = bias->to(at::kFloat).contiguous();
  }
  const int64_t rows = x.size(0);
  at::Tensor out = x.new_empty({rows, n});
  if (rows == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  // Panels split between threads; each thread takes every row block over its panels, so a
  // panel is read from memory once per call.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, rows * k));
  at::parallel_for(0, panels, grain, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const float* panel = wp + p * k * kPanel;
      const float* panel_bias = bp ? bp + p * kPanel : nullptr;
      // Blocks of near-equal size (8 rows: 4 and 4, not 6 and 2): a block of few rows has
      // too few accumulators to hide the FMAs' latency.
      const int64_t blocks = (rows + kRows - 1) / kRows;
      for (int64_t j = 0, r = 0; j < blocks; ++j) {
        const int64_t block = (rows - r) / (blocks - j);
        kBlocks[block](xp + r * x_stride, x_stride, panel, k, panel_bias,
                       op + r * n + p * kPanel, n);
        r += block;
      }
    }
  });
  return out;
}

}  // namespace minimill
