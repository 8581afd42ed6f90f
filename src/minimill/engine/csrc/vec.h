// Shared by minimill's CPU kernels: float vectors from ATen's at::vec (AVX-512, AVX2 or
// scalar, picked by the CPU_CAPABILITY_* macro the build sets from this machine's flags),
// loads and stores of float32 and bfloat16, rounding as a dtype would, and thread grains.
// Arithmetic is float32 inside; values are rounded to the model dtype where HF transformers
// rounds them, so bf16 runs stay close to it.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#include <immintrin.h>
#define MINIMILL_NATIVE_BF16 1
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace minimill {

using at::BFloat16;
using fVec = at::vec::Vectorized<float>;
constexpr int kVec = fVec::size();
constexpr int64_t kMaxHeadDim = 256;

inline fVec load_f(const float* p) { return fVec::loadu(p); }
inline fVec load_f(const BFloat16* p) {
  fVec out;
  at::vec::load_to_float<BFloat16>(p, out);
  return out;
}
inline void store_f(float* p, const fVec& v) { v.store(p); }
#ifdef MINIMILL_NATIVE_BF16
// One instruction (round to nearest even) where the chip converts natively; ATen's portable
// conversion is a dozen integer instructions and a masked half-width store.
inline __m256i to_bf16_bits(const fVec& v) { return (__m256i)_mm512_cvtneps_pbh(__m512(v)); }
inline void store_f(BFloat16* p, const fVec& v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(v));
}
#else
inline void store_f(BFloat16* p, const fVec& v) {
  at::vec::convert_from_float<BFloat16>(v, v).store(p, kVec);
}
#endif
inline float to_f(float x) { return x; }
inline float to_f(BFloat16 x) { return static_cast<float>(x); }
template <typename T> inline T from_f(float x) { return static_cast<T>(x); }
// The value after a round trip through T (round to nearest even for bf16).
template <typename T> inline float round_to(float x) { return to_f(from_f<T>(x)); }
template <typename T> inline fVec round_to(const fVec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
#ifdef MINIMILL_NATIVE_BF16
    // The bf16 bits back in the high half of each float lane.
    const __m512i widened = _mm512_cvtepu16_epi32(to_bf16_bits(v));
    return fVec(_mm512_castsi512_ps(_mm512_slli_epi32(widened, 16)));
#else
    fVec lo, hi;
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v));
    return lo;
#endif
  }
}

// Rows per thread below which a kernel stays on the calling thread: waking the other threads
// and meeting them again costs more than ~64K elements of elementwise work.
inline int64_t grain_rows(int64_t elements_per_row) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, elements_per_row));
}

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

}  // namespace minimill
