// The paged KV cache: its block layout, the fused rotary + KV write, and attention over the
// cache in place (decodes and prompt chunks together, one call per layer).

#include <atomic>

#include "kv_int8.h"
#include "ops.h"
#include "vec.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define MINIMILL_DPBF16 1  // AVX-512 BF16: dot products of bf16 pairs in one instruction
#endif

namespace minimill {

namespace {

// ---------------------------------------------------------------------------------------------
// KV block layout. A block of one layer and one kv head holds block_size tokens. Values of a
// 2-byte dtype are kept in pairs, so that one 32-bit lane holds two of them (what the bf16
// dot-product instructions read):
//   K: [head_dim / P][block_size][P]   a vector of lanes = one dimension pair of many keys
//   V: [block_size / P][head_dim][P]   a vector of lanes = many dimensions of a key pair
// with P = 2 for bfloat16 and P = 1 for float32.
//
// An int8 cache (the `int8_t` cache type below) holds, per block, layer and kv head, the
// values K [head_dim][block_size] and V [block_size][head_dim] as int8, each followed by
// block_size float16 scales and block_size int8 zero points, one of each per token:
// value = scale * (int8 - zero), the range [min(x, 0), max(x, 0)] of the token's head_dim
// values in 255 steps. About half the bytes of bf16; attention dequantizes as it reads.

template <typename T> constexpr int64_t kPack = sizeof(T) == 2 ? 2 : 1;

// Elements of one block of one layer and kv head, values and scales, in units of C.
template <typename C>
inline int64_t block_elems(int64_t block_size, int64_t head_dim) {
  if constexpr (std::is_same_v<C, int8_t>) {
    return block_size * (head_dim + 3);
  } else {
    return block_size * head_dim;
  }
}

inline fVec load_half(const at::Half* p) {
  fVec out;
  at::vec::load_to_float<at::Half>(p, out);
  return out;
}

template <typename T>
inline int64_t k_index(int64_t d, int64_t offset, int64_t block_size) {
  constexpr int64_t P = kPack<T>;
  return ((d / P) * block_size + offset) * P + d % P;
}

template <typename T>
inline int64_t v_index(int64_t offset, int64_t d, int64_t head_dim) {
  constexpr int64_t P = kPack<T>;
  return ((offset / P) * head_dim + d) * P + offset % P;
}

// ---------------------------------------------------------------------------------------------
// Rotary on q and k (HF's rotate_half convention), q written to q_out, k and v written into the
// paged cache at each token's slot. cos_sin: [positions, head_dim] float32, cos then sin halves.

template <typename T, typename C>
void rotary_kv_write_impl(const at::Tensor& qkv, const at::Tensor& positions,
                          const at::Tensor& cos_sin, at::Tensor& q_out, at::Tensor& k_cache,
                          at::Tensor& v_cache, const at::Tensor& slot_mapping,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size) {
  const int64_t tokens = qkv.size(0);
  const int64_t half = head_dim / 2;
  const T* src = qkv.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* cs = cos_sin.data_ptr<float>();
  T* qo = q_out.data_ptr<T>();
  C* kc = k_cache.data_ptr<C>();
  C* vc = v_cache.data_ptr<C>();
  const int64_t src_stride = qkv.stride(0), qo_stride = q_out.stride(0);
  const int64_t kb = k_cache.stride(0), kh = k_cache.stride(1);
  const int64_t vb = v_cache.stride(0), vh = v_cache.stride(1);
  const int64_t row_work = (num_heads + 3 * num_kv_heads) * head_dim;
  const int64_t k_bytes = block_elems<C>(block_size, head_dim) * sizeof(C);
  // One token's V values, and for int8 its block's scales and zero points after them.
  const int64_t v_row_bytes = (std::is_same_v<C, int8_t> ? head_dim : kPack<C> * head_dim) *
                              static_cast<int64_t>(sizeof(C));
  // A token's K values are spread over its block (one per dimension row), and the block was
  // last touched a step ago: without a hint, every write waits for a line from memory.
  auto prefetch_slot = [&](int64_t slot) {
    const int64_t block = slot / block_size, offset = slot % block_size;
    for (int64_t g = 0; g < num_kv_heads; ++g) {
      const char* k = reinterpret_cast<const char*>(kc + block * kb + g * kh);
      for (int64_t off = 0; off < k_bytes; off += 64) __builtin_prefetch(k + off, 1, 3);
      const C* vblock = vc + block * vb + g * vh;
      const char* v = reinterpret_cast<const char*>(
          std::is_same_v<C, int8_t> ? vblock + offset * head_dim
                                    : vblock + v_index<C>(offset, 0, head_dim));
      for (int64_t off = 0; off < v_row_bytes; off += 64) __builtin_prefetch(v + off, 1, 3);
      if constexpr (std::is_same_v<C, int8_t>) {
        __builtin_prefetch(vblock + block_size * head_dim + offset * 2, 1, 3);
        __builtin_prefetch(vblock + block_size * (head_dim + 2) + offset, 1, 3);
      }
    }
  };
  at::parallel_for(0, tokens, grain_rows(row_work), [&](int64_t b, int64_t e) {
    float rotated[kMaxHeadDim];
    alignas(64) C k_rounded[kMaxHeadDim];
    constexpr int64_t kAhead = 2;
    for (int64_t t = b; t < std::min(e, b + kAhead); ++t) prefetch_slot(slots[t]);
    for (int64_t t = b; t < e; ++t) {
      if (t + kAhead < e) prefetch_slot(slots[t + kAhead]);
      const T* row = src + t * src_stride;
      const float* cosv = cs + pos[t] * head_dim;
      const float* sinv = cosv + half;
      auto rotate = [&](const T* x, float* dst) {
        int64_t i = 0;
        for (; i + kVec <= half; i += kVec) {
          const fVec x1 = load_f(x + i), x2 = load_f(x + i + half);
          const fVec c = fVec::loadu(cosv + i), sn = fVec::loadu(sinv + i);
          (x1 * c - x2 * sn).store(dst + i);
          (x2 * c + x1 * sn).store(dst + i + half);
        }
        for (; i < half; ++i) {
          const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
          dst[i] = x1 * cosv[i] - x2 * sinv[i];
          dst[i + half] = x2 * cosv[i] + x1 * sinv[i];
        }
      };
      for (int64_t h = 0; h < num_heads; ++h) {
        T* dst = qo + t * qo_stride + h * head_dim;
        if constexpr (std::is_same_v<T, float>) {
          rotate(row + h * head_dim, dst);
        } else {
          rotate(row + h * head_dim, rotated);
          for (int64_t i = 0; i < head_dim; i += kVec) store_f(dst + i, fVec::loadu(rotated + i));
        }
      }
      const int64_t slot = slots[t];
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int64_t g = 0; g < num_kv_heads; ++g) {
        rotate(row + (num_heads + g) * head_dim, rotated);
        C* kdst = kc + block * kb + g * kh;
        const T* v = row + (num_heads + num_kv_heads + g) * head_dim;
        C* vdst = vc + block * vb + g * vh;
        if constexpr (std::is_same_v<C, int8_t>) {
          at::Half* k_scales = int8_scales(kdst, block_size, head_dim);
          at::Half* v_scales = int8_scales(vdst, block_size, head_dim);
          int8_t* k_zeros = int8_zeros(kdst, block_size, head_dim);
          int8_t* v_zeros = int8_zeros(vdst, block_size, head_dim);
          k_scales[offset] = quantize_i8(rotated, head_dim, kdst + offset, block_size,
                                         k_zeros + offset);
          float vf[kMaxHeadDim];
          for (int64_t d = 0; d < head_dim; ++d) vf[d] = to_f(v[d]);
          v_scales[offset] = quantize_i8(vf, head_dim, vdst + offset * head_dim, 1,
                                         v_zeros + offset);
        } else if constexpr (kPack<C> == 2) {
          // Rounded a vector at a time, then stored a dimension pair (32 bits) at a time.
          for (int64_t d = 0; d < head_dim; d += kVec) {
            store_f(k_rounded + d, fVec::loadu(rotated + d));
          }
          const auto* pairs = reinterpret_cast<const uint32_t*>(k_rounded);
          auto* kpairs = reinterpret_cast<uint32_t*>(kdst);
          for (int64_t dp = 0; dp < head_dim / 2; ++dp) {
            kpairs[dp * block_size + offset] = pairs[dp];
          }
          for (int64_t d = 0; d < head_dim; ++d) vdst[v_index<C>(offset, d, head_dim)] = v[d];
        } else {
          for (int64_t d = 0; d < head_dim; ++d) {
            kdst[k_index<C>(d, offset, block_size)] = from_f<C>(rotated[d]);
          }
          for (int64_t d = 0; d < head_dim; ++d) vdst[v_index<C>(offset, d, head_dim)] = v[d];
        }
      }
    }
  });
}

void check_cache(const at::Tensor& cache, const char* name, int64_t block_size,
                 int64_t head_dim) {
  const int64_t elems = cache.scalar_type() == at::kChar
                            ? block_elems<int8_t>(block_size, head_dim)
                            : block_size * head_dim;
  TORCH_CHECK(cache.dim() == 3 && cache.stride(2) == 1 && cache.size(2) == elems, name,
              " must be [blocks, kv_heads, block elements] with contiguous rows");
}

// Calls fn(T{}, C{}) for the activation dtype of `act` and the cache dtype of `cache`.
template <typename Fn>
void dispatch_kv(const at::Tensor& act, const at::Tensor& cache, const char* op, Fn fn) {
  const auto a = act.scalar_type(), c = cache.scalar_type();
  if (a == at::kFloat && c == at::kFloat) {
    fn(float{}, float{});
  } else if (a == at::kBFloat16 && c == at::kBFloat16) {
    fn(BFloat16{}, BFloat16{});
  } else if (a == at::kFloat && c == at::kChar) {
    fn(float{}, int8_t{});
  } else if (a == at::kBFloat16 && c == at::kChar) {
    fn(BFloat16{}, int8_t{});
  } else {
    TORCH_CHECK(false, op, ": activations float32 or bfloat16, and a cache of the same dtype "
                "or int8; got ", a, " and ", c);
  }
}

}  // namespace

void rotary_kv_write(at::Tensor qkv, at::Tensor positions, at::Tensor cos_sin, at::Tensor q_out,
                     at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
                     int64_t num_heads, int64_t num_kv_heads, int64_t block_size) {
  check_cpu(qkv, "qkv");
  const int64_t head_dim = cos_sin.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 &&
                  qkv.size(1) >= (num_heads + 2 * num_kv_heads) * head_dim,
              "qkv must be [tokens, (heads + 2 * kv_heads) * head_dim] with contiguous rows");
  TORCH_CHECK(head_dim % kVec == 0 && head_dim <= kMaxHeadDim && block_size % 2 == 0,
              "head_dim must be a multiple of ", kVec, " and at most ", kMaxHeadDim,
              "; block_size even");
  TORCH_CHECK(q_out.dim() == 3 && q_out.stride(2) == 1 && q_out.stride(1) == head_dim,
              "q_out must be [tokens, heads, head_dim] with contiguous rows");
  check_cache(k_cache, "k_cache", block_size, head_dim);
  check_cache(v_cache, "v_cache", block_size, head_dim);
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slot_mapping.is_contiguous(),
              "positions and slot_mapping must be contiguous int64");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous(),
              "cos_sin must be contiguous float32");
  TORCH_CHECK(qkv.scalar_type() == q_out.scalar_type() &&
                  k_cache.scalar_type() == v_cache.scalar_type(), "dtypes differ");
  dispatch_kv(qkv, k_cache, "rotary_kv_write", [&](auto t, auto c) {
    rotary_kv_write_impl<decltype(t), decltype(c)>(qkv, positions, cos_sin, q_out, k_cache,
                                                   v_cache, slot_mapping, num_heads,
                                                   num_kv_heads, head_dim, block_size);
  });
}

namespace {

// Rotary on q and k without a cache write (an int4 cache quantizes K and V itself, from
// float32): q rotated into q_out in the activation dtype, k rotated and v as they are into
// k_out and v_out in float32. The same float32 arithmetic as the PyTorch path (TorchKernels.
// _rotate): each product rounded on its own, no fused multiply-add, so both give the same bits.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
void rotary_split_impl(const at::Tensor& qkv, const at::Tensor& positions,
                       const at::Tensor& cos_sin, at::Tensor& q_out, at::Tensor& k_out,
                       at::Tensor& v_out, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim) {
  const int64_t tokens = qkv.size(0), half = head_dim / 2;
  const T* src = qkv.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cs = cos_sin.data_ptr<float>();
  T* qo = q_out.data_ptr<T>();
  float* ko = k_out.data_ptr<float>();
  float* vo = v_out.data_ptr<float>();
  const int64_t src_stride = qkv.stride(0);
  const int64_t kv_row = num_kv_heads * head_dim;
  const int64_t row_work = (num_heads + 2 * num_kv_heads) * head_dim;
  at::parallel_for(0, tokens, grain_rows(row_work), [&](int64_t b, int64_t e) {
    alignas(64) float rotated[kMaxHeadDim];
    for (int64_t t = b; t < e; ++t) {
      const T* row = src + t * src_stride;
      const float* cosv = cs + pos[t] * head_dim;
      const float* sinv = cosv + half;
      auto rotate = [&](const T* x, float* dst) {
        int64_t i = 0;
        for (; i + kVec <= half; i += kVec) {
          const fVec x1 = load_f(x + i), x2 = load_f(x + i + half);
          const fVec c = fVec::loadu(cosv + i), sn = fVec::loadu(sinv + i);
          const fVec a = x1 * c, bb = x2 * sn, cc = x2 * c, d = x1 * sn;
          (a - bb).store(dst + i);
          (cc + d).store(dst + i + half);
        }
        for (; i < half; ++i) {
          const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
          const float a = x1 * cosv[i], bb = x2 * sinv[i], cc = x2 * cosv[i], d = x1 * sinv[i];
          dst[i] = a - bb;
          dst[i + half] = cc + d;
        }
      };
      for (int64_t h = 0; h < num_heads; ++h) {
        rotate(row + h * head_dim, rotated);
        T* dst = qo + (t * num_heads + h) * head_dim;
        for (int64_t i = 0; i < head_dim; i += kVec) store_f(dst + i, fVec::loadu(rotated + i));
      }
      for (int64_t g = 0; g < num_kv_heads; ++g) {
        rotate(row + (num_heads + g) * head_dim, ko + t * kv_row + g * head_dim);
        const T* v = row + (num_heads + num_kv_heads + g) * head_dim;
        float* vdst = vo + t * kv_row + g * head_dim;
        for (int64_t i = 0; i < head_dim; i += kVec) load_f(v + i).store(vdst + i);
      }
    }
  });
}
#pragma GCC pop_options

}  // namespace

void rotary_split(at::Tensor qkv, at::Tensor positions, at::Tensor cos_sin, at::Tensor q_out,
                  at::Tensor k_out, at::Tensor v_out, int64_t num_heads,
                  int64_t num_kv_heads) {
  check_cpu(qkv, "qkv");
  const int64_t head_dim = cos_sin.size(1), tokens = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 &&
                  qkv.size(1) >= (num_heads + 2 * num_kv_heads) * head_dim,
              "qkv must be [tokens, (heads + 2 * kv_heads) * head_dim] with contiguous rows");
  TORCH_CHECK(head_dim % kVec == 0 && head_dim <= kMaxHeadDim,
              "head_dim must be a multiple of ", kVec, " and at most ", kMaxHeadDim);
  TORCH_CHECK(q_out.is_contiguous() && q_out.sizes() == at::IntArrayRef({tokens, num_heads,
                                                                        head_dim}) &&
                  q_out.scalar_type() == qkv.scalar_type(),
              "q_out must be contiguous [tokens, heads, head_dim] in qkv's dtype");
  for (const auto* t : {&k_out, &v_out}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat &&
                    t->sizes() == at::IntArrayRef({tokens, num_kv_heads, head_dim}),
                "k_out and v_out must be contiguous float32 [tokens, kv_heads, head_dim]");
  }
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == tokens,
              "positions must be contiguous int64, one per token");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous(),
              "cos_sin must be contiguous float32");
  if (qkv.scalar_type() == at::kFloat) {
    rotary_split_impl<float>(qkv, positions, cos_sin, q_out, k_out, v_out, num_heads,
                             num_kv_heads, head_dim);
  } else {
    TORCH_CHECK(qkv.scalar_type() == at::kBFloat16, "rotary_split: float32 or bfloat16 qkv");
    rotary_split_impl<BFloat16>(qkv, positions, cos_sin, q_out, k_out, v_out, num_heads,
                                num_kv_heads, head_dim);
  }
}

namespace {

// ---------------------------------------------------------------------------------------------
// Attention over the paged cache, decodes and prompt chunks together, in one call per layer.
//
// Sequence s owns query rows [query_start[s], query_start[s + 1]) and has seq_lens[s] tokens
// of KV (its new tokens included, already written). Query row j of a sequence with q_len rows
// sits at position seq_len - q_len + j and attends to keys 0..position (causal), and in a
// sliding-window layer only to the last `window` of them (keys position - window + 1..position).
//
// Work items are (sequence, tile of up to kRowTile query rows, kv head): the query heads that
// share a kv head are processed together, NQ query vectors at a time, so each K and V block is
// loaded once per NQ queries. Keys are taken kPartKeys at a time: score them all, then one
// online-softmax update (running max and sum) per part. Scores are float32 in every path.

constexpr int64_t kRowTile = 16;    // query rows of one sequence per work item
constexpr int64_t kQGroup = 8;      // query vectors scored together (registers)
constexpr int64_t kPartKeys = 256;  // keys scored before one softmax update (a multiple of bs)
constexpr int64_t kPrefetchBlocks = 3;  // how far ahead block loops fetch


inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 2);
}

// Query vectors of one work item group, ready for the score loop.
struct Queries {
  const float* q;          // [NQ, head_dim], float32, unscaled
  const uint32_t* q_pairs; // [NQ, head_dim / 2] bf16 pairs (dot-product path only)
};

// scores[i * kPartKeys + c .. + kVec] = q_i . K[:, c .. c + kVec) of one block (unscaled).
// Each query keeps two partial sums (even and odd dimensions) so that the multiply-adds of a
// few queries are not one dependency chain each: the loop runs at the units' rate, not at
// their latency.
template <typename T, int NQ>
inline void score_block(const Queries& qs, const T* kt, int64_t block_size, int64_t head_dim,
                        float* scores, float* unpack) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t c = 0; c < block_size; c += kVec) {
      fVec s0[NQ], s1[NQ];
      for (int i = 0; i < NQ; ++i) s0[i] = s1[i] = fVec(0.f);
      for (int64_t d = 0; d < head_dim; d += 2) {
        const fVec k0 = fVec::loadu(kt + d * block_size + c);
        const fVec k1 = fVec::loadu(kt + (d + 1) * block_size + c);
        for (int i = 0; i < NQ; ++i) {
          s0[i] = at::vec::fmadd(fVec(qs.q[i * head_dim + d]), k0, s0[i]);
          s1[i] = at::vec::fmadd(fVec(qs.q[i * head_dim + d + 1]), k1, s1[i]);
        }
      }
      for (int i = 0; i < NQ; ++i) (s0[i] + s1[i]).store(scores + i * kPartKeys + c);
    }
  } else if constexpr (std::is_same_v<T, int8_t>) {
    // Dequantize as read: dot products with (int8 - zero), times each key's scale.
    const at::Half* scales = int8_scales(kt, block_size, head_dim);
    const int8_t* zeros = int8_zeros(kt, block_size, head_dim);
    for (int64_t c = 0; c < block_size; c += kVec) {
      fVec s0[NQ], s1[NQ];
      for (int i = 0; i < NQ; ++i) s0[i] = s1[i] = fVec(0.f);
      const fVec kz = load_i8(zeros + c);
      for (int64_t d = 0; d < head_dim; d += 2) {
        const fVec k0 = load_i8(kt + d * block_size + c) - kz;
        const fVec k1 = load_i8(kt + (d + 1) * block_size + c) - kz;
        for (int i = 0; i < NQ; ++i) {
          s0[i] = at::vec::fmadd(fVec(qs.q[i * head_dim + d]), k0, s0[i]);
          s1[i] = at::vec::fmadd(fVec(qs.q[i * head_dim + d + 1]), k1, s1[i]);
        }
      }
      const fVec ks = load_half(scales + c);
      for (int i = 0; i < NQ; ++i) ((s0[i] + s1[i]) * ks).store(scores + i * kPartKeys + c);
    }
  } else {
#ifdef MINIMILL_DPBF16
    // One instruction multiplies a dimension pair of 16 keys by the query's pair and adds both.
    const int64_t half = head_dim / 2;
    for (int64_t c = 0; c < block_size; c += 16) {
      __m512 s0[NQ], s1[NQ];
      for (int i = 0; i < NQ; ++i) s0[i] = s1[i] = _mm512_setzero_ps();
      for (int64_t dp = 0; dp < half; dp += 2) {
        const __m512i k0 = _mm512_loadu_si512(kt + (dp * block_size + c) * 2);
        const __m512i k1 = _mm512_loadu_si512(kt + ((dp + 1) * block_size + c) * 2);
        for (int i = 0; i < NQ; ++i) {
          const uint32_t* qp = qs.q_pairs + i * half + dp;
          s0[i] = _mm512_dpbf16_ps(s0[i], (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[0])),
                                   (__m512bh)k0);
          s1[i] = _mm512_dpbf16_ps(s1[i], (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[1])),
                                   (__m512bh)k1);
        }
      }
      for (int i = 0; i < NQ; ++i) {
        _mm512_storeu_ps(scores + i * kPartKeys + c, _mm512_add_ps(s0[i], s1[i]));
      }
    }
#else
    // No bf16 dot product here: unpack the block to float32 [head_dim, block_size] first.
    for (int64_t d = 0; d < head_dim; ++d) {
      for (int64_t o = 0; o < block_size; ++o) {
        unpack[d * block_size + o] = to_f(kt[k_index<T>(d, o, block_size)]);
      }
    }
    score_block<float, NQ>(qs, unpack, block_size, head_dim, scores, nullptr);
#endif
  }
}

// Vectors of one head_dim row: DV when it is known at compile time (the accumulators then
// live in registers), else enough for any head_dim (they live on the stack).
constexpr int acc_vecs(int DV) { return DV > 0 ? DV : static_cast<int>(kMaxHeadDim / kVec); }

// acc[i] += sum_j p[i][j] V[j] over the first `keys` keys of one block. p: float32
// [NQ, kPartKeys]; p_pairs: the same rounded to bf16, as pairs (dot-product path only).
template <typename T, int NQ, int DV>
inline void accumulate_block(const float* p, const int32_t* p_pairs, const T* vt, int64_t keys,
                             int64_t block_size, int64_t head_dim,
                             fVec (*acc)[acc_vecs(DV)], float* unpack) {
  const int64_t dvecs = DV > 0 ? DV : head_dim / kVec;
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t j = 0; j < keys; ++j) {
      const float* vrow = vt + j * head_dim;
      fVec pj[NQ];
      for (int i = 0; i < NQ; ++i) pj[i] = fVec(p[i * kPartKeys + j]);
      for (int64_t v = 0; v < dvecs; ++v) {
        const fVec vv = fVec::loadu(vrow + v * kVec);
        for (int i = 0; i < NQ; ++i) acc[i][v] = at::vec::fmadd(pj[i], vv, acc[i][v]);
      }
    }
  } else if constexpr (std::is_same_v<T, int8_t>) {
    // Each key's scale folds into its probability, its zero point into its values.
    const at::Half* scales = int8_scales(vt, block_size, head_dim);
    const int8_t* zeros = int8_zeros(vt, block_size, head_dim);
    for (int64_t j = 0; j < keys; ++j) {
      const int8_t* vrow = vt + j * head_dim;
      const float scale = static_cast<float>(scales[j]);
      const fVec vz(static_cast<float>(zeros[j]));
      fVec pj[NQ];
      for (int i = 0; i < NQ; ++i) pj[i] = fVec(p[i * kPartKeys + j] * scale);
      for (int64_t v = 0; v < dvecs; ++v) {
        const fVec vv = load_i8(vrow + v * kVec) - vz;
        for (int i = 0; i < NQ; ++i) acc[i][v] = at::vec::fmadd(pj[i], vv, acc[i][v]);
      }
    }
  } else {
#ifdef MINIMILL_DPBF16
    // Probabilities rounded to bf16 (as flash attention does before its P V matmul), read in
    // pairs: one instruction adds p[j] V[j] + p[j+1] V[j+1] for 16 dimensions.
    const int64_t pairs = (keys + 1) / 2;
    for (int64_t jp = 0; jp < pairs; ++jp) {
      const T* vrow = vt + jp * head_dim * 2;
      __m512i pp[NQ];
      for (int i = 0; i < NQ; ++i) pp[i] = _mm512_set1_epi32(p_pairs[i * kPartKeys / 2 + jp]);
      for (int64_t v = 0; v < dvecs; ++v) {
        const __m512i vv = _mm512_loadu_si512(vrow + v * 32);
        for (int i = 0; i < NQ; ++i) {
          acc[i][v] = fVec(_mm512_dpbf16_ps(__m512(acc[i][v]), (__m512bh)pp[i], (__m512bh)vv));
        }
      }
    }
#else
    for (int64_t j = 0; j < keys; ++j) {
      for (int64_t d = 0; d < head_dim; ++d) {
        unpack[j * head_dim + d] = to_f(vt[v_index<T>(j, d, head_dim)]);
      }
    }
    accumulate_block<float, NQ, DV>(p, nullptr, unpack, keys, block_size, head_dim, acc,
                                    nullptr);
#endif
  }
}

// Attention of NQ query vectors of one kv head over the keys they may see (the last `window`
// up to each one's position); out is float32.
// DV: head_dim / kVec when known at compile time, else 0.
template <typename T, int NQ, int DV>
void attend_group(const Queries& qs, const int64_t* q_pos, float scale, float* out,
                  const T* k_base, const T* v_base, int64_t k_block_stride,
                  int64_t v_block_stride, const int32_t* block_table, int64_t seq_len,
                  int64_t block_size, int64_t head_dim, int64_t window, const float* sinks,
                  float* scores, float* unpack) {
  int64_t max_pos = q_pos[0], min_pos = q_pos[0];
  for (int i = 1; i < NQ; ++i) {
    max_pos = std::max(max_pos, q_pos[i]);
    min_pos = std::min(min_pos, q_pos[i]);
  }
  // Blocks wholly before every query's window are never read.
  const int64_t first_key = std::max<int64_t>(0, min_pos - window + 1) / block_size * block_size;
  const int64_t num_keys = std::min<int64_t>(seq_len, max_pos + 1);
  const int64_t dvecs = DV > 0 ? DV : head_dim / kVec;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float m[NQ], l[NQ];
  fVec acc[NQ][acc_vecs(DV)];
  for (int i = 0; i < NQ; ++i) {
    m[i] = neg_inf;
    l[i] = 0.f;
    for (int64_t v = 0; v < dvecs; ++v) acc[i][v] = fVec(0.f);
  }
  int32_t p_pairs[NQ * kPartKeys / 2];
  const int64_t part_keys = std::max<int64_t>(block_size, kPartKeys / block_size * block_size);
  const fVec vscale(scale);
  // The blocks are scattered over the pool, so the hardware cannot guess the next one: each
  // block loop fetches the block kPrefetchBlocks ahead in the order they are read (this
  // part's K, then its V, then the next part's K).
  const int64_t block_bytes = block_elems<T>(block_size, head_dim) * sizeof(T);
  const int64_t total_blocks = (num_keys + block_size - 1) / block_size;
  auto prefetch_k = [&](int64_t b) {
    if (b < total_blocks) prefetch_bytes(k_base + block_table[b] * k_block_stride, block_bytes);
  };
  for (int64_t part = first_key; part < num_keys; part += part_keys) {
    const int64_t part_len = std::min<int64_t>(part_keys, num_keys - part);
    const int64_t part_padded = (part_len + block_size - 1) / block_size * block_size;
    const int64_t first_block = part / block_size, part_blocks = part_padded / block_size;
    const int32_t* table = block_table + first_block;
    for (int64_t b0 = 0, b = 0; b0 < part_padded; b0 += block_size, ++b) {
      const int64_t ahead = b + kPrefetchBlocks;
      if (ahead < part_blocks) {
        prefetch_bytes(k_base + table[ahead] * k_block_stride, block_bytes);
      } else {
        prefetch_bytes(v_base + table[ahead - part_blocks] * v_block_stride, block_bytes);
      }
      score_block<T, NQ>(qs, k_base + table[b] * k_block_stride, block_size, head_dim,
                         scores + b0, unpack);
    }
    // Online softmax update, one per query vector per part.
    for (int i = 0; i < NQ; ++i) {
      float* si = scores + i * kPartKeys;
      // Keys past this query's position (or past the sequence) do not count.
      const int64_t limit = std::min<int64_t>(part_len, q_pos[i] - part + 1);
      // Keys before this query's window do not count either.
      const int64_t low = std::max<int64_t>(0, q_pos[i] - window + 1 - part);
      if (limit <= low) {
        for (int64_t j = 0; j < part_padded; ++j) si[j] = 0.f;
        std::memset(p_pairs + i * kPartKeys / 2, 0, part_padded * 2);
        continue;
      }
      // Whole vectors up to the limit; lanes past it (keys this query may not see) are
      // -inf for the max and 0 after the exponential.
      for (int64_t j = 0; j < low; ++j) si[j] = neg_inf;  // -inf * scale stays -inf
      const int64_t full = limit / kVec * kVec, rem = limit - full;
      const fVec vninf(neg_inf);
      fVec vmax(neg_inf);
      for (int64_t j = 0; j < full; j += kVec) {
        const fVec sj = fVec::loadu(si + j) * vscale;
        sj.store(si + j);
        vmax = at::vec::maximum(vmax, sj);
      }
      if (rem) {
        const fVec sj = fVec::set(vninf, fVec::loadu(si + full) * vscale, rem);
        sj.store(si + full);
        vmax = at::vec::maximum(vmax, sj);
      }
      const float part_max = at::vec::vec_reduce_all<float>(
          [](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, vmax);
      const float m_new = std::max(m[i], part_max);
      const float correction = std::exp(m[i] - m_new);
      m[i] = m_new;
      const fVec vm(m_new);
      fVec vsum(0.f);
      const int64_t covered = full + (rem ? kVec : 0);
      for (int64_t j = 0; j < covered; j += kVec) {
        // exp(-inf - m) is 0: the masked lanes drop out here.
        const fVec pj = (fVec::loadu(si + j) - vm).exp_u20();
        pj.store(si + j);
        vsum = vsum + pj;
      }
      const float sum = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; },
                                                       vsum);
      for (int64_t j = covered; j < part_padded; ++j) si[j] = 0.f;
#ifdef MINIMILL_DPBF16
      if constexpr (std::is_same_v<T, BFloat16>) {
        auto* dst = reinterpret_cast<__m256bh*>(p_pairs + i * kPartKeys / 2);
        for (int64_t j = 0; j < part_padded; j += 16) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst) + j / 16,
                              (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(si + j)));
        }
      }
#endif
      l[i] = l[i] * correction + sum;
      if (correction != 1.f) {
        const fVec vc(correction);
        for (int64_t v = 0; v < dvecs; ++v) acc[i][v] = acc[i][v] * vc;
      }
    }
    for (int64_t b0 = 0, b = 0; b0 < part_len; b0 += block_size, ++b) {
      const int64_t ahead = b + kPrefetchBlocks;
      if (ahead < part_blocks) {
        prefetch_bytes(v_base + table[ahead] * v_block_stride, block_bytes);
      } else {
        prefetch_k(first_block + ahead);  // the next part's
      }
      accumulate_block<T, NQ, DV>(scores + b0, p_pairs + b0 / 2, v_base + table[b] * v_block_stride,
                              std::min<int64_t>(block_size, part_len - b0), block_size,
                                  head_dim, acc, unpack);
    }
  }
  for (int i = 0; i < NQ; ++i) {
    // An attention sink (gpt-oss) is one more logit per head with no value: it only adds
    // exp(sink) to the softmax's denominator.
    const float denom = sinks ? l[i] + std::exp(sinks[i] - m[i]) : l[i];
    const fVec inv(denom > 0.f ? 1.f / denom : 0.f);
    for (int64_t v = 0; v < dvecs; ++v) (acc[i][v] * inv).store(out + i * head_dim + v * kVec);
  }
}

template <typename T>
using AttendFn = void (*)(const Queries&, const int64_t*, float, float*, const T*, const T*,
                          int64_t, int64_t, const int32_t*, int64_t, int64_t, int64_t, int64_t,
                          const float*, float*, float*);

template <typename T, int DV>
AttendFn<T> attend_for_dv(int64_t n) {
  switch (n) {
    case 1: return &attend_group<T, 1, DV>;
    case 2: return &attend_group<T, 2, DV>;
    case 3: return &attend_group<T, 3, DV>;
    case 4: return &attend_group<T, 4, DV>;
    case 5: return &attend_group<T, 5, DV>;
    case 6: return &attend_group<T, 6, DV>;
    case 7: return &attend_group<T, 7, DV>;
    default: return &attend_group<T, 8, DV>;
  }
}

// The kernel for n query vectors: with the accumulators in registers for the common head
// sizes (when n * head_dim / kVec of them fit), else the general one.
template <typename T>
AttendFn<T> attend_for(int64_t n, int64_t head_dim) {
  const int64_t dv = head_dim / kVec;
  if (dv == 4 && n <= 4) return attend_for_dv<T, 4>(n);
  if (dv == 8 && n <= 3) return attend_for_dv<T, 8>(n);
  return attend_for_dv<T, 0>(n);
}

// Whether the score loop reads float32 queries (every path but bf16 dot products).
template <typename C>
#ifdef MINIMILL_DPBF16
constexpr bool kFloatQueries = !std::is_same_v<C, BFloat16>;
#else
constexpr bool kFloatQueries = true;
#endif

struct WorkItem {
  int32_t seq;
  int32_t row_begin;  // within the sequence
  int32_t row_end;
};

template <typename T, typename C>
void paged_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                          const at::Tensor& query_start, const at::Tensor& seq_lens,
                          double scale, int64_t block_size, int64_t window,
                          const float* head_sinks) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_seqs = seq_lens.size(0);
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  T* op = out.data_ptr<T>();
  const int64_t q_stride = q.stride(0), o_stride = out.stride(0);
  const int64_t kb = k_cache.stride(0), kh = k_cache.stride(1);
  const int64_t vb = v_cache.stride(0), vh = v_cache.stride(1);

  std::vector<WorkItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int32_t q_len = qs[s + 1] - qs[s];
    for (int32_t r = 0; r < q_len; r += kRowTile) {
      items.push_back({static_cast<int32_t>(s), r, std::min<int32_t>(q_len, r + kRowTile)});
    }
  }
  const int64_t max_vectors = kRowTile * group;
  const int64_t total = static_cast<int64_t>(items.size()) * num_kv_heads;
  int64_t keys = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    keys += lens[s] * ((qs[s + 1] - qs[s] + kRowTile - 1) / kRowTile);
  }
  // Little work (a few short sequences) stays on this thread.
  const int64_t grain = keys * num_heads * head_dim < (int64_t{1} << 18) ? total : 1;
  // Items differ in length (sequences of any length): threads take small runs of items from
  // a shared counter, so that none waits at the end for another's long tail.
  const int64_t threads = grain >= total ? 1 : std::min<int64_t>(at::get_num_threads(), total);
  const int64_t run = std::max<int64_t>(1, total / (threads * 16));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> qbuf(max_vectors * head_dim), obuf(max_vectors * head_dim);
    std::vector<uint32_t> qpairs(max_vectors * head_dim / 2);
    std::vector<int64_t> qpos(max_vectors), out_row(max_vectors), out_head(max_vectors);
    std::vector<float> qsink(head_sinks ? max_vectors : 0);
    std::vector<float> scores(kQGroup * kPartKeys);
    std::vector<float> unpack(std::is_same_v<C, BFloat16> ? block_size * head_dim : 0);
    // The blocks are scattered over the pool: while one item computes, the first blocks of
    // the next are on their way to the cache (attend_group fetches the rest as it goes).
    const int64_t block_bytes = block_elems<C>(block_size, head_dim) * sizeof(C);
    auto prefetch_item = [&](int64_t w) {
      const WorkItem& it = items[w / num_kv_heads];
      const int64_t g = w % num_kv_heads;
      const int32_t* table = tables + it.seq * table_stride;
      for (int64_t b = 0; b < kPrefetchBlocks && b * block_size < lens[it.seq]; ++b) {
        prefetch_bytes(kp + table[b] * kb + g * kh, block_bytes);
      }
    };
    for (int64_t begin = next.fetch_add(run); begin < total; begin = next.fetch_add(run)) {
      const int64_t end = std::min<int64_t>(total, begin + run);
      prefetch_item(begin);
      for (int64_t w = begin; w < end; ++w) {
        if (w + 1 < end) prefetch_item(w + 1);
        const WorkItem& it = items[w / num_kv_heads];
        const int64_t g = w % num_kv_heads;
        const int64_t s = it.seq;
        const int64_t q_len = qs[s + 1] - qs[s];
        const int64_t seq_len = lens[s];
        int64_t n = 0;
        for (int64_t r = it.row_begin; r < it.row_end; ++r) {
          const int64_t row = qs[s] + r;
          for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            const T* src = qp + row * q_stride + h * head_dim;
            if constexpr (kFloatQueries<C>) {
              for (int64_t d = 0; d < head_dim; ++d) qbuf[n * head_dim + d] = to_f(src[d]);
            }
            if constexpr (std::is_same_v<C, BFloat16>) {
              std::memcpy(qpairs.data() + n * head_dim / 2, src, head_dim * sizeof(T));
            }
            qpos[n] = seq_len - q_len + r;
            out_row[n] = row;
            out_head[n] = h;
            if (head_sinks) qsink[n] = head_sinks[h];
            ++n;
          }
        }
        for (int64_t first = 0; first < n; first += kQGroup) {
          const int64_t count = std::min<int64_t>(kQGroup, n - first);
          const Queries queries{qbuf.data() + first * head_dim,
                                qpairs.data() + first * head_dim / 2};
          attend_for<C>(count, head_dim)(queries, qpos.data() + first, static_cast<float>(scale),
                               obuf.data() + first * head_dim, kp + g * kh, vp + g * vh, kb, vb,
                               tables + s * table_stride, seq_len, block_size, head_dim,
                               window, head_sinks ? qsink.data() + first : nullptr,
                               scores.data(), unpack.data());
        }
        for (int64_t i = 0; i < n; ++i) {
          T* dst = op + out_row[i] * o_stride + out_head[i] * head_dim;
          const float* src = obuf.data() + i * head_dim;
          for (int64_t d = 0; d < head_dim; d += kVec) store_f(dst + d, fVec::loadu(src + d));
        }
      }
    }
  });
}

}  // namespace

void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                     at::Tensor block_tables, at::Tensor query_start, at::Tensor seq_lens,
                     double scale, int64_t block_size, std::optional<int64_t> window,
                     const std::optional<at::Tensor>& sinks) {
  check_cpu(q, "q");
  TORCH_CHECK(!window || *window > 0, "window must be positive");
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                         sinks->dim() == 1 && sinks->size(0) == q.size(1)),
              "sinks must be contiguous float32 [heads]");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be [tokens, heads, head_dim] with contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(1) == q.size(1) * q.size(2),
              "out must be [tokens, heads * head_dim]");
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(head_dim % kVec == 0 && head_dim % 32 == 0 && head_dim <= kMaxHeadDim,
              "head_dim must be a multiple of 32 and at most ", kMaxHeadDim);
  TORCH_CHECK(block_size % 16 == 0 && block_size % kVec == 0,
              "block_size must be a multiple of 16");
  check_cache(k_cache, "k_cache", block_size, head_dim);
  check_cache(v_cache, "v_cache", block_size, head_dim);
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1,
              "block_tables must be int32 with contiguous rows");
  TORCH_CHECK(query_start.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start.is_contiguous() && seq_lens.is_contiguous() &&
                  query_start.size(0) == seq_lens.size(0) + 1,
              "query_start [seqs + 1] and seq_lens [seqs] must be contiguous int32");
  TORCH_CHECK(q.scalar_type() == out.scalar_type() &&
                  k_cache.scalar_type() == v_cache.scalar_type(), "dtypes differ");
  dispatch_kv(q, k_cache, "paged_attention", [&](auto t, auto c) {
    paged_attention_impl<decltype(t), decltype(c)>(out, q, k_cache, v_cache, block_tables,
                                                   query_start, seq_lens, scale, block_size,
                                                   window.value_or(std::numeric_limits<int64_t>::max() / 2),
                                                   sinks ? sinks->data_ptr<float>() : nullptr);
  });
}


}  // namespace minimill
