// The int8 KV layout, shared by the int8 cache (attention.cpp) and int4's staging of open
// blocks (kv_int4.cpp). Per block, layer and kv head: values K [head_dim][block_size] and
// V [block_size][head_dim] as int8, each followed by block_size float16 scales and block_size
// int8 zero points, one of each per token: value = scale * (int8 - zero).
#pragma once

#include "vec.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace minimill {

// kVec int8 values as floats.
inline fVec load_i8(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return fVec(_mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return fVec(_mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  float tmp[kVec];
  for (int i = 0; i < kVec; ++i) tmp[i] = static_cast<float>(p[i]);
  return fVec::loadu(tmp);
#endif
}

inline at::Half* int8_scales(int8_t* block, int64_t block_size, int64_t head_dim) {
  return reinterpret_cast<at::Half*>(block + block_size * head_dim);
}
inline const at::Half* int8_scales(const int8_t* block, int64_t block_size, int64_t head_dim) {
  return reinterpret_cast<const at::Half*>(block + block_size * head_dim);
}

inline int8_t* int8_zeros(int8_t* block, int64_t block_size, int64_t head_dim) {
  return block + block_size * (head_dim + 2);
}
inline const int8_t* int8_zeros(const int8_t* block, int64_t block_size, int64_t head_dim) {
  return block + block_size * (head_dim + 2);
}

// One token's n values as asymmetric int8 at out[i * out_stride]: writes its zero point,
// returns its scale (float16, and used as rounded, so that dequantizing gives exactly what
// attention reads). The range holds 0, so the zero point fits in int8.
inline at::Half quantize_i8(const float* x, int64_t n, int8_t* out, int64_t out_stride,
                            int8_t* zero_out) {
  float low = 0.f, high = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    low = std::min(low, x[i]);
    high = std::max(high, x[i]);
  }
  const float span = high - low;
  // Rounded up to float16, so that the range fits in 255 steps and nothing is clipped.
  const at::Half scale(span > 0.f ? span / 255.f * (1.f + 1.f / 1024.f) : 1.f);
  const float s = static_cast<float>(scale);
  const float zero = std::max(-128.f, std::min(127.f, std::nearbyint(-low / s) - 128.f));
  for (int64_t i = 0; i < n; ++i) {
    const float q = std::nearbyint(x[i] / s) + zero;
    out[i * out_stride] = static_cast<int8_t>(std::max(-128.f, std::min(127.f, q)));
  }
  *zero_out = static_cast<int8_t>(zero);
  return scale;
}

// The first n tokens of one int8 K block and V block as float32 rows [n][head_dim].
inline void dequantize_int8_rows(const int8_t* kblock, const int8_t* vblock, int64_t n,
                                 int64_t block_size, int64_t head_dim, float* k_rows,
                                 float* v_rows) {
  const at::Half* k_scales = int8_scales(kblock, block_size, head_dim);
  const at::Half* v_scales = int8_scales(vblock, block_size, head_dim);
  const int8_t* k_zeros = int8_zeros(kblock, block_size, head_dim);
  const int8_t* v_zeros = int8_zeros(vblock, block_size, head_dim);
  for (int64_t t = 0; t < n; ++t) {
    const float ks = static_cast<float>(k_scales[t]), kz = k_zeros[t];
    const float vs = static_cast<float>(v_scales[t]), vz = v_zeros[t];
    for (int64_t c = 0; c < head_dim; ++c) {
      k_rows[t * head_dim + c] = (static_cast<float>(kblock[c * block_size + t]) - kz) * ks;
      v_rows[t * head_dim + c] = (static_cast<float>(vblock[t * head_dim + c]) - vz) * vs;
    }
  }
}

}  // namespace minimill
