// minimill's CPU kernels: attention over the paged KV cache in place, the fused rotary + KV
// write, RMSNorm with the residual add, and SiLU * up. Registered as torch.ops.minimill.*.
//
// Vectorised with ATen's at::vec (AVX-512, AVX2 or scalar, picked by the CPU_CAPABILITY_*
// macro the build sets from this machine's flags). Arithmetic is float32 inside; values are
// rounded to the model dtype where HF transformers rounds them, so bf16 runs stay close to it.
//
// KV cache layout, per layer (views of one tensor, so any block stride is accepted):
//   K: [num_blocks, kv_heads, head_dim, block_size]  (transposed: a vector holds many keys)
//   V: [num_blocks, kv_heads, block_size, head_dim]

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#ifdef __linux__
#include <sched.h>
#endif
#include <cmath>
#include <limits>
#include <vector>

namespace minimill {
namespace {

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
inline void store_f(BFloat16* p, const fVec& v) {
  at::vec::convert_from_float<BFloat16>(v, v).store(p, kVec);
}
inline float to_f(float x) { return x; }
inline float to_f(BFloat16 x) { return static_cast<float>(x); }
template <typename T> inline T from_f(float x) { return static_cast<T>(x); }
// The value after a round trip through T (round to nearest even for bf16).
template <typename T> inline float round_to(float x) { return to_f(from_f<T>(x)); }
template <typename T> inline fVec round_to(const fVec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    fVec lo, hi;
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v));
    return lo;
  }
}

// Rows per thread below which a kernel stays on the calling thread: waking the other threads
// and meeting them again costs more than ~64K elements of elementwise work.
inline int64_t grain_rows(int64_t elements_per_row) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, elements_per_row));
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

// ---------------------------------------------------------------------------------------------
// RMSNorm. HF: x -> float -> x * rsqrt(mean(x^2) + eps) -> round to dtype -> * weight (rounded).

template <typename T>
void rms_norm_row(T* out, const T* x, const T* w, int64_t n, float eps) {
  fVec acc(0.f);
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) {
    fVec v = load_f(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float sum = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, acc);
  for (; i < n; ++i) sum += to_f(x[i]) * to_f(x[i]);
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  const fVec vinv(inv);
  i = 0;
  for (; i + kVec <= n; i += kVec) {
    fVec normed = round_to<T>(load_f(x + i) * vinv);
    store_f(out + i, normed * load_f(w + i));
  }
  for (; i < n; ++i) out[i] = from_f<T>(round_to<T>(to_f(x[i]) * inv) * to_f(w[i]));
}

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rms_norm_row<T>(op + r * os, xp + r * xs, wp, n, eps);
  });
}

void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1, "rows must be contiguous");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type(), "bad weight");
  if (x.scalar_type() == at::kFloat) {
    rms_norm_impl<float>(out, x, weight, eps);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rms_norm: float32 or bfloat16 only");
    rms_norm_impl<BFloat16>(out, x, weight, eps);
  }
}

// residual <- x + residual (rounded, as HF adds in the model dtype); x <- rms_norm(residual).
template <typename T>
void add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      T* xr = xp + r * xs;
      T* rr = rp + r * rs;
      int64_t i = 0;
      for (; i + kVec <= n; i += kVec) store_f(rr + i, load_f(xr + i) + load_f(rr + i));
      for (; i < n; ++i) rr[i] = from_f<T>(to_f(xr[i]) + to_f(rr[i]));
      rms_norm_row<T>(xr, rr, wp, n, eps);
    }
  });
}

void add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && residual.stride(1) == 1,
              "rows must be contiguous");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual differ");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type(), "bad weight");
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_impl<float>(x, residual, weight, eps);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "add_rms_norm: float32 or bfloat16 only");
    add_rms_norm_impl<BFloat16>(x, residual, weight, eps);
  }
}

// ---------------------------------------------------------------------------------------------
// SiLU * up. HF: act(gate) rounded to dtype, times up, rounded.

template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), n = out.size(1);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t gs = gate_up.stride(0), os = out.stride(0);
  const fVec one(1.f);
  at::parallel_for(0, rows, grain_rows(4 * n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* g = gp + r * gs;
      const T* u = g + n;
      T* o = op + r * os;
      int64_t i = 0;
      for (; i + kVec <= n; i += kVec) {
        fVec gv = load_f(g + i);
        fVec act = round_to<T>(gv / (one + gv.neg().exp_u20()));
        store_f(o + i, act * load_f(u + i));
      }
      for (; i < n; ++i) {
        float gv = to_f(g[i]);
        o[i] = from_f<T>(round_to<T>(gv / (1.f + std::exp(-gv))) * to_f(u[i]));
      }
    }
  });
}

void silu_and_mul(at::Tensor out, at::Tensor gate_up) {
  check_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && out.stride(1) == 1 &&
                  gate_up.size(1) == 2 * out.size(1) && gate_up.size(0) == out.size(0),
              "silu_and_mul: out [T, I] and gate_up [T, 2I] with contiguous rows");
  if (gate_up.scalar_type() == at::kFloat) {
    silu_and_mul_impl<float>(out, gate_up);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "silu_and_mul: float32 or bfloat16");
    silu_and_mul_impl<BFloat16>(out, gate_up);
  }
}

// ---------------------------------------------------------------------------------------------
// KV block layout. A block of one layer and one kv head holds block_size tokens. Values of a
// 2-byte dtype are kept in pairs, so that one 32-bit lane holds two of them (what the bf16
// dot-product instructions read):
//   K: [head_dim / P][block_size][P]   a vector of lanes = one dimension pair of many keys
//   V: [block_size / P][head_dim][P]   a vector of lanes = many dimensions of a key pair
// with P = 2 for bfloat16 and P = 1 for float32.

template <typename T> constexpr int64_t kPack = sizeof(T) == 2 ? 2 : 1;

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

template <typename T>
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
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t src_stride = qkv.stride(0), qo_stride = q_out.stride(0);
  const int64_t kb = k_cache.stride(0), kh = k_cache.stride(1);
  const int64_t vb = v_cache.stride(0), vh = v_cache.stride(1);
  const int64_t row_work = (num_heads + 3 * num_kv_heads) * head_dim;
  at::parallel_for(0, tokens, grain_rows(row_work), [&](int64_t b, int64_t e) {
    float rotated[kMaxHeadDim];
    for (int64_t t = b; t < e; ++t) {
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
        T* kdst = kc + block * kb + g * kh;
        for (int64_t d = 0; d < head_dim; ++d) {
          kdst[k_index<T>(d, offset, block_size)] = from_f<T>(rotated[d]);
        }
        const T* v = row + (num_heads + num_kv_heads + g) * head_dim;
        T* vdst = vc + block * vb + g * vh;
        for (int64_t d = 0; d < head_dim; ++d) vdst[v_index<T>(offset, d, head_dim)] = v[d];
      }
    }
  });
}

void check_cache(const at::Tensor& cache, const char* name, int64_t block_size,
                 int64_t head_dim) {
  TORCH_CHECK(cache.dim() == 3 && cache.stride(2) == 1 && cache.size(2) == block_size * head_dim,
              name, " must be [blocks, kv_heads, block_size * head_dim] with contiguous rows");
}

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
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() &&
                  qkv.scalar_type() == q_out.scalar_type(), "dtypes differ");
  if (qkv.scalar_type() == at::kFloat) {
    rotary_kv_write_impl<float>(qkv, positions, cos_sin, q_out, k_cache, v_cache, slot_mapping,
                                num_heads, num_kv_heads, head_dim, block_size);
  } else {
    TORCH_CHECK(qkv.scalar_type() == at::kBFloat16, "rotary_kv_write: float32 or bfloat16");
    rotary_kv_write_impl<BFloat16>(qkv, positions, cos_sin, q_out, k_cache, v_cache,
                                   slot_mapping, num_heads, num_kv_heads, head_dim, block_size);
  }
}

// ---------------------------------------------------------------------------------------------
// Attention over the paged cache, decodes and prompt chunks together, in one call per layer.
//
// Sequence s owns query rows [query_start[s], query_start[s + 1]) and has seq_lens[s] tokens
// of KV (its new tokens included, already written). Query row j of a sequence with q_len rows
// sits at position seq_len - q_len + j and attends to keys 0..position (causal).
//
// Work items are (sequence, tile of up to kRowTile query rows, kv head): the query heads that
// share a kv head are processed together, NQ query vectors at a time, so each K and V block is
// loaded once per NQ queries. Keys are taken kPartKeys at a time: score them all, then one
// online-softmax update (running max and sum) per part. Scores are float32 in every path.

constexpr int64_t kRowTile = 16;    // query rows of one sequence per work item
constexpr int64_t kQGroup = 8;      // query vectors scored together (registers)
constexpr int64_t kPartKeys = 256;  // keys scored before one softmax update (a multiple of bs)

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define MINIMILL_DPBF16 1
#include <immintrin.h>
#endif

template <typename T>
inline void prefetch_block(const T* p, int64_t numel) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < numel * static_cast<int64_t>(sizeof(T)); off += 64) {
    __builtin_prefetch(c + off, 0, 3);
  }
}

// Query vectors of one work item group, ready for the score loop.
struct Queries {
  const float* q;          // [NQ, head_dim], float32, unscaled
  const uint32_t* q_pairs; // [NQ, head_dim / 2] bf16 pairs (dot-product path only)
};

// scores[i * kPartKeys + c .. + kVec] = q_i . K[:, c .. c + kVec) of one block (unscaled).
template <typename T, int NQ>
inline void score_block(const Queries& qs, const T* kt, int64_t block_size, int64_t head_dim,
                        float* scores, float* unpack) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t c = 0; c < block_size; c += kVec) {
      fVec s[NQ];
      for (int i = 0; i < NQ; ++i) s[i] = fVec(0.f);
      for (int64_t d = 0; d < head_dim; ++d) {
        const fVec kv = fVec::loadu(kt + d * block_size + c);
        for (int i = 0; i < NQ; ++i) s[i] = at::vec::fmadd(fVec(qs.q[i * head_dim + d]), kv, s[i]);
      }
      for (int i = 0; i < NQ; ++i) s[i].store(scores + i * kPartKeys + c);
    }
  } else {
#ifdef MINIMILL_DPBF16
    // One instruction multiplies a dimension pair of 16 keys by the query's pair and adds both.
    for (int64_t c = 0; c < block_size; c += 16) {
      __m512 s[NQ];
      for (int i = 0; i < NQ; ++i) s[i] = _mm512_setzero_ps();
      for (int64_t dp = 0; dp < head_dim / 2; ++dp) {
        const __m512i kv = _mm512_loadu_si512(kt + (dp * block_size + c) * 2);
        for (int i = 0; i < NQ; ++i) {
          const __m512i qp = _mm512_set1_epi32(static_cast<int>(qs.q_pairs[i * head_dim / 2 + dp]));
          s[i] = _mm512_dpbf16_ps(s[i], (__m512bh)qp, (__m512bh)kv);
        }
      }
      for (int i = 0; i < NQ; ++i) _mm512_storeu_ps(scores + i * kPartKeys + c, s[i]);
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

// acc[i] += sum_j p[i][j] V[j] over the first `keys` keys of one block. p: float32
// [NQ, kPartKeys]; p_pairs: the same rounded to bf16, as pairs (dot-product path only).
template <typename T, int NQ>
inline void accumulate_block(const float* p, const int32_t* p_pairs, const T* vt, int64_t keys,
                             int64_t head_dim, fVec (*acc)[kMaxHeadDim / kVec],
                             float* unpack) {
  const int64_t dvecs = head_dim / kVec;
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
    accumulate_block<float, NQ>(p, nullptr, unpack, keys, head_dim, acc, nullptr);
#endif
  }
}

// Attention of NQ query vectors of one kv head over the keys they may see; out is float32.
template <typename T, int NQ>
void attend_group(const Queries& qs, const int64_t* q_pos, float scale, float* out,
                  const T* k_base, const T* v_base, int64_t k_block_stride,
                  int64_t v_block_stride, const int32_t* block_table, int64_t seq_len,
                  int64_t block_size, int64_t head_dim, float* scores, float* unpack) {
  int64_t max_pos = q_pos[0];
  for (int i = 1; i < NQ; ++i) max_pos = std::max(max_pos, q_pos[i]);
  const int64_t num_keys = std::min<int64_t>(seq_len, max_pos + 1);
  const int64_t dvecs = head_dim / kVec;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float m[NQ], l[NQ];
  fVec acc[NQ][kMaxHeadDim / kVec];
  for (int i = 0; i < NQ; ++i) {
    m[i] = neg_inf;
    l[i] = 0.f;
    for (int64_t v = 0; v < dvecs; ++v) acc[i][v] = fVec(0.f);
  }
  int32_t p_pairs[NQ * kPartKeys / 2];
  const int64_t part_keys = std::max<int64_t>(block_size, kPartKeys / block_size * block_size);
  const fVec vscale(scale);
  for (int64_t part = 0; part < num_keys; part += part_keys) {
    const int64_t part_len = std::min<int64_t>(part_keys, num_keys - part);
    const int64_t part_padded = (part_len + block_size - 1) / block_size * block_size;
    const int32_t* table = block_table + part / block_size;
    for (int64_t b0 = 0, b = 0; b0 < part_padded; b0 += block_size, ++b) {
      score_block<T, NQ>(qs, k_base + table[b] * k_block_stride, block_size, head_dim,
                         scores + b0, unpack);
    }
    // Online softmax update, one per query vector per part.
    for (int i = 0; i < NQ; ++i) {
      float* si = scores + i * kPartKeys;
      // Keys past this query's position (or past the sequence) do not count.
      const int64_t limit = std::min<int64_t>(part_len, q_pos[i] - part + 1);
      if (limit <= 0) {
        for (int64_t j = 0; j < part_padded; ++j) si[j] = 0.f;
        std::memset(p_pairs + i * kPartKeys / 2, 0, part_padded * 2);
        continue;
      }
      const int64_t full = limit / kVec * kVec;
      fVec vmax(neg_inf);
      for (int64_t j = 0; j < full; j += kVec) {
        const fVec sj = fVec::loadu(si + j) * vscale;
        sj.store(si + j);
        vmax = at::vec::maximum(vmax, sj);
      }
      float part_max = at::vec::vec_reduce_all<float>(
          [](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, vmax);
      for (int64_t j = full; j < limit; ++j) {
        si[j] *= scale;
        part_max = std::max(part_max, si[j]);
      }
      const float m_new = std::max(m[i], part_max);
      const float correction = std::exp(m[i] - m_new);
      m[i] = m_new;
      const fVec vm(m_new);
      fVec vsum(0.f);
      for (int64_t j = 0; j < full; j += kVec) {
        const fVec pj = (fVec::loadu(si + j) - vm).exp_u20();
        pj.store(si + j);
        vsum = vsum + pj;
      }
      float sum = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, vsum);
      for (int64_t j = full; j < limit; ++j) {
        si[j] = std::exp(si[j] - m_new);
        sum += si[j];
      }
      for (int64_t j = limit; j < part_padded; ++j) si[j] = 0.f;
#ifdef MINIMILL_DPBF16
      if constexpr (!std::is_same_v<T, float>) {
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
      accumulate_block<T, NQ>(scores + b0, p_pairs + b0 / 2, v_base + table[b] * v_block_stride,
                              std::min<int64_t>(block_size, part_len - b0), head_dim, acc,
                              unpack);
    }
  }
  for (int i = 0; i < NQ; ++i) {
    const fVec inv(l[i] > 0.f ? 1.f / l[i] : 0.f);
    for (int64_t v = 0; v < dvecs; ++v) (acc[i][v] * inv).store(out + i * head_dim + v * kVec);
  }
}

template <typename T>
using AttendFn = void (*)(const Queries&, const int64_t*, float, float*, const T*, const T*,
                          int64_t, int64_t, const int32_t*, int64_t, int64_t, int64_t, float*,
                          float*);

template <typename T>
AttendFn<T> attend_for(int64_t n) {
  switch (n) {
    case 1: return &attend_group<T, 1>;
    case 2: return &attend_group<T, 2>;
    case 3: return &attend_group<T, 3>;
    case 4: return &attend_group<T, 4>;
    case 5: return &attend_group<T, 5>;
    case 6: return &attend_group<T, 6>;
    case 7: return &attend_group<T, 7>;
    default: return &attend_group<T, 8>;
  }
}

struct WorkItem {
  int32_t seq;
  int32_t row_begin;  // within the sequence
  int32_t row_end;
};

template <typename T>
void paged_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                          const at::Tensor& query_start, const at::Tensor& seq_lens,
                          double scale, int64_t block_size) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_seqs = seq_lens.size(0);
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
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
  for (int64_t s = 0; s < num_seqs; ++s) keys += lens[s] * ((qs[s + 1] - qs[s] + kRowTile - 1) / kRowTile);
  // Little work (a few short sequences) stays on this thread.
  const int64_t grain = keys * num_heads * head_dim < (int64_t{1} << 18) ? total : 1;
  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qbuf(max_vectors * head_dim), obuf(max_vectors * head_dim);
    std::vector<uint32_t> qpairs(max_vectors * head_dim / 2);
    std::vector<int64_t> qpos(max_vectors), out_row(max_vectors), out_head(max_vectors);
    std::vector<float> scores(kQGroup * kPartKeys);
    std::vector<float> unpack(std::is_same_v<T, float> ? 0 : block_size * head_dim);
    // The blocks are scattered over the pool: while one item computes, the next item's blocks
    // are on their way to the cache.
    auto prefetch_item = [&](int64_t w) {
      const WorkItem& it = items[w / num_kv_heads];
      const int64_t keys = std::min<int64_t>(lens[it.seq], lens[it.seq] - (qs[it.seq + 1] -
                                             qs[it.seq]) + it.row_end);
      const int32_t* table = tables + it.seq * table_stride;
      // Every kv head's K and V of a block lie next to each other: fetch them together, once
      // per item, so the heads that follow find them in cache.
      for (int64_t b = 0; b * block_size < keys; ++b) {
        prefetch_block(kp + table[b] * kb, num_kv_heads * block_size * head_dim);
        prefetch_block(vp + table[b] * vb, num_kv_heads * block_size * head_dim);
      }
    };
    if (begin < end && begin % num_kv_heads == 0) prefetch_item(begin);
    for (int64_t w = begin; w < end; ++w) {
      if (w + 1 < end && (w + 1) % num_kv_heads == 0) prefetch_item(w + 1);
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
          for (int64_t d = 0; d < head_dim; ++d) qbuf[n * head_dim + d] = to_f(src[d]);
          if constexpr (!std::is_same_v<T, float>) {
            std::memcpy(qpairs.data() + n * head_dim / 2, src, head_dim * sizeof(T));
          }
          qpos[n] = seq_len - q_len + r;
          out_row[n] = row;
          out_head[n] = h;
          ++n;
        }
      }
      for (int64_t first = 0; first < n; first += kQGroup) {
        const int64_t count = std::min<int64_t>(kQGroup, n - first);
        const Queries queries{qbuf.data() + first * head_dim,
                              qpairs.data() + first * head_dim / 2};
        attend_for<T>(count)(queries, qpos.data() + first, static_cast<float>(scale),
                             obuf.data() + first * head_dim, kp + g * kh, vp + g * vh, kb, vb,
                             tables + s * table_stride, seq_len, block_size, head_dim,
                             scores.data(), unpack.data());
      }
      for (int64_t i = 0; i < n; ++i) {
        T* dst = op + out_row[i] * o_stride + out_head[i] * head_dim;
        const float* src = obuf.data() + i * head_dim;
        for (int64_t d = 0; d < head_dim; d += kVec) store_f(dst + d, fVec::loadu(src + d));
      }
    }
  });
}

void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                     at::Tensor block_tables, at::Tensor query_start, at::Tensor seq_lens,
                     double scale, int64_t block_size) {
  check_cpu(q, "q");
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
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "dtypes differ");
  if (q.scalar_type() == at::kFloat) {
    paged_attention_impl<float>(out, q, k_cache, v_cache, block_tables, query_start, seq_lens,
                                scale, block_size);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "paged_attention: float32 or bfloat16 only");
    paged_attention_impl<BFloat16>(out, q, k_cache, v_cache, block_tables, query_start,
                                   seq_lens, scale, block_size);
  }
}

// ---------------------------------------------------------------------------------------------
// Sampling. Row r's token depends only on its logits, its parameters and u[r] (a uniform drawn
// from (seed, output position) by the caller): additive adjustments (logit_bias, penalties),
// then greedy argmax (temperature 0), or temperature, then top-k / top-p filtering over tokens
// ordered by logit (ties: lower id first), then the inverse CDF at u. Without filters the CDF
// runs in token-id order and nothing is sorted; with them only the candidates are sorted.

constexpr int64_t kChunk = 256;  // tokens per partial sum of the unfiltered CDF walk

struct RowScratch {
  std::vector<float> x;       // adjusted, scaled logits
  std::vector<float> e;       // exp(x - max)
  std::vector<double> chunk;  // per-chunk sums of e
  std::vector<int32_t> idx;   // candidate ids
};

template <typename T>
void load_row(const T* src, int64_t vocab, float* dst) {
  int64_t i = 0;
  for (; i + kVec <= vocab; i += kVec) load_f(src + i).store(dst + i);
  for (; i < vocab; ++i) dst[i] = to_f(src[i]);
}

float row_max(const float* x, int64_t n) {
  fVec vmax(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) vmax = at::vec::maximum(vmax, fVec::loadu(x + i));
  float m = at::vec::vec_reduce_all<float>(
      [](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, vmax);
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

constexpr int kFullMask = static_cast<int>((1u << kVec) - 1);

// Lanes of v that are >= t (or == t), as a bit mask.
inline int mask_ge(const fVec& v, const fVec& t) { return ~(v >= t).zero_mask() & kFullMask; }
inline int mask_eq(const fVec& v, const fVec& t) { return ~(v == t).zero_mask() & kFullMask; }

// The first index of the maximum, reading the row in its own dtype.
template <typename T>
int64_t row_argmax(const T* x, int64_t n) {
  fVec vmax(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) vmax = at::vec::maximum(vmax, load_f(x + i));
  float m = at::vec::vec_reduce_all<float>(
      [](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, vmax);
  for (; i < n; ++i) m = std::max(m, to_f(x[i]));
  const fVec vm(m);
  i = 0;
  for (; i + kVec <= n; i += kVec) {
    const int mask = mask_eq(load_f(x + i), vm);
    if (mask) return i + __builtin_ctz(mask);
  }
  for (; i < n; ++i) {
    if (to_f(x[i]) == m) return i;
  }
  return 0;  // every value NaN
}

// e[i] = exp(x[i] - m); returns sum(e) accumulated per chunk of kChunk into `chunk`.
double exp_and_sum(const float* x, float m, int64_t n, float* e, std::vector<double>& chunk) {
  const fVec vm(m);
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  chunk.assign(chunks, 0.0);
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
    fVec acc(0.f);
    int64_t i = lo;
    for (; i + kVec <= hi; i += kVec) {
      const fVec v = (fVec::loadu(x + i) - vm).exp_u20();
      v.store(e + i);
      acc = acc + v;
    }
    float sum = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, acc);
    for (; i < hi; ++i) {
      e[i] = std::exp(x[i] - m);
      sum += e[i];
    }
    chunk[c] = sum;
    total += sum;
  }
  return total;
}

// The token at the inverse CDF of u, walking ids in order (chunk sums first).
int64_t walk_unfiltered(const float* e, const std::vector<double>& chunk, double total,
                        int64_t n, double u) {
  const double target = u * total;
  double cum = 0.0;
  int64_t c = 0;
  const int64_t chunks = static_cast<int64_t>(chunk.size());
  while (c + 1 < chunks && cum + chunk[c] <= target) cum += chunk[c++];
  const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
  int64_t last_nonzero = -1;
  for (int64_t i = lo; i < hi; ++i) {
    if (e[i] > 0.f) last_nonzero = i;
    cum += e[i];
    if (cum > target && e[i] > 0.f) return i;
  }
  if (last_nonzero >= 0) return last_nonzero;  // rounding left the target past the chunk
  for (int64_t i = n - 1; i >= 0; --i) {
    if (e[i] > 0.f) return i;
  }
  return 0;
}

// Candidates ordered by logit, highest first, lower id first among equals.
struct ByLogit {
  const float* x;
  bool operator()(int32_t a, int32_t b) const {
    return x[a] > x[b] || (x[a] == x[b] && a < b);
  }
};

// Floats in an order-preserving integer form, for exact binary searches over values.
inline int32_t order_key(float f) {
  int32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits ^ ((bits >> 31) & 0x7FFFFFFF);
}
inline float from_order_key(int32_t key) {
  const int32_t bits = key ^ ((key >> 31) & 0x7FFFFFFF);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

int64_t count_at_least(const float* x, int64_t n, float v) {
  const fVec vv(v);
  int64_t count = 0, i = 0;
  for (; i + kVec <= n; i += kVec) count += __builtin_popcount(mask_ge(fVec::loadu(x + i), vv));
  for (; i < n; ++i) count += x[i] >= v;
  return count;
}

double mass_at_least(const float* x, const float* e, int64_t n, float v) {
  const fVec vv(v);
  fVec acc(0.f);
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) acc = acc + (fVec::loadu(e + i) & (fVec::loadu(x + i) >= vv));
  double mass = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, acc);
  for (; i < n; ++i) mass += x[i] >= v ? e[i] : 0.f;
  return mass;
}

// The largest value v in [lo, hi] with pred(v) true, where pred(lo) is true and pred is
// monotone (true up to some value, false above). Exact: it searches the floats themselves.
template <typename Pred>
float largest_true(float lo, float hi, Pred pred) {
  if (pred(hi)) return hi;
  int64_t a = order_key(lo), b = order_key(hi);  // pred(a) true, pred(b) false
  while (b - a > 1) {
    const auto mid = static_cast<int32_t>(a + (b - a) / 2);
    if (pred(from_order_key(mid))) {
      a = mid;
    } else {
      b = mid;
    }
  }
  return from_order_key(static_cast<int32_t>(a));
}

// A filtered set: every token with x > threshold, and the first `ties` tokens (in id order)
// with x == threshold. That is a prefix of the tokens ordered by logit, lower id first among
// equals, found without sorting the vocabulary.
struct KeptSet {
  float threshold;
  int64_t ties;
};

inline bool is_kept(const KeptSet& k, float xi, int64_t& ties_seen) {
  if (xi > k.threshold) return true;
  if (xi == k.threshold && ties_seen < k.ties) {
    ++ties_seen;
    return true;
  }
  return false;
}

// The k best tokens (1 <= k <= n); lo and hi bound the values.
KeptSet top_k_set(const float* x, int64_t n, int64_t k, float lo, float hi) {
  const float t = largest_true(lo, hi, [&](float v) { return count_at_least(x, n, v) >= k; });
  int64_t above = 0;
  for (int64_t i = 0; i < n; ++i) above += x[i] > t;
  return {t, k - above};
}

// The smallest prefix holding `need` of the mass e (the best token always stays).
KeptSet top_p_set(const float* x, const float* e, int64_t n, double need, float lo, float hi) {
  const float t = largest_true(lo, hi,
                               [&](float v) { return mass_at_least(x, e, n, v) >= need; });
  double mass = 0.0;
  for (int64_t i = 0; i < n; ++i) mass += x[i] > t ? e[i] : 0.f;
  int64_t ties = 0;
  for (int64_t i = 0; i < n && (ties == 0 || mass < need); ++i) {
    if (x[i] == t) {
      ++ties;
      mass += e[i];
    }
  }
  return {t, ties};
}

// Ids of a kept set, ordered by logit (lower id first among equals).
void kept_ids(const float* x, int64_t n, const KeptSet& k, std::vector<int32_t>& idx) {
  idx.clear();
  int64_t ties_seen = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (is_kept(k, x[i], ties_seen)) idx.push_back(static_cast<int32_t>(i));
  }
  std::sort(idx.begin(), idx.end(), ByLogit{x});
}

// Inverse CDF at u over a kept set, walking ids in order.
int64_t walk_kept(const float* x, const float* e, int64_t n, const KeptSet& k, double u) {
  double total = 0.0;
  int64_t ties_seen = 0, last = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (is_kept(k, x[i], ties_seen)) {
      total += e[i];
      if (e[i] > 0.f) last = i;
    }
  }
  const double target = u * total;
  double cum = 0.0;
  ties_seen = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (is_kept(k, x[i], ties_seen)) {
      cum += e[i];
      if (cum > target && e[i] > 0.f) return i;
    }
  }
  return last >= 0 ? last : 0;
}

int64_t sample_filtered(RowScratch& s, int64_t vocab, int64_t top_k, float top_p, double u) {
  const float* x = s.x.data();
  const float m = row_max(x, vocab);
  s.e.resize(vocab);
  float* e = s.e.data();
  const double z_all = exp_and_sum(x, m, vocab, e, s.chunk);
  float lo = m;
  for (int64_t i = 0; i < vocab; ++i) lo = std::min(lo, x[i]);
  if (top_k <= 0 || top_k >= vocab) {
    // top_p alone: the kept set is walked in id order, nothing is sorted.
    const KeptSet k = top_p_set(x, e, vocab, static_cast<double>(top_p) * z_all, lo, m);
    return walk_kept(x, e, vocab, k, u);
  }
  const KeptSet best_k = top_k_set(x, vocab, top_k, lo, m);
  if (top_p >= 1.f) return walk_kept(x, e, vocab, best_k, u);
  // Both: the top_p prefix of the top_k tokens (few: sorting them is cheap).
  auto& idx = s.idx;
  kept_ids(x, vocab, best_k, idx);
  double z = 0.0;
  for (int32_t t : idx) z += e[t];
  const double need = static_cast<double>(top_p) * z;
  double mass = 0.0;
  size_t keep = idx.size();
  for (size_t j = 0; j < idx.size(); ++j) {
    if (j > 0 && mass >= need) {
      keep = j;
      break;
    }
    mass += e[idx[j]];
  }
  idx.resize(keep);
  std::sort(idx.begin(), idx.end());  // walked in id order, as everywhere
  double total = 0.0;
  for (int32_t t : idx) total += e[t];
  const double target = u * total;
  double cum = 0.0;
  for (int32_t t : idx) {
    cum += e[t];
    if (cum > target && e[t] > 0.f) return t;
  }
  return idx.back();
}

template <typename T>
void sample_tokens_impl(const at::Tensor& logits, const float* temperature, const int64_t* top_k,
                        const float* top_p, const double* u, const int64_t* adj_off,
                        const int64_t* adj_ids, const float* adj_vals, int64_t* out) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const T* lp = logits.data_ptr<T>();
  const int64_t stride = logits.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    RowScratch s;
    s.x.resize(vocab);
    for (int64_t r = b; r < e; ++r) {
      const bool greedy = temperature[r] == 0.f || top_k[r] == 1;
      if (greedy && adj_off[r] == adj_off[r + 1]) {
        out[r] = row_argmax(lp + r * stride, vocab);
        continue;
      }
      float* x = s.x.data();
      load_row(lp + r * stride, vocab, x);
      for (int64_t a = adj_off[r]; a < adj_off[r + 1]; ++a) {
        if (adj_ids[a] >= 0 && adj_ids[a] < vocab) x[adj_ids[a]] += adj_vals[a];
      }
      if (greedy) {
        out[r] = row_argmax(x, vocab);
        continue;
      }
      const fVec vt(temperature[r]);
      int64_t i = 0;
      for (; i + kVec <= vocab; i += kVec) (fVec::loadu(x + i) / vt).store(x + i);
      for (; i < vocab; ++i) x[i] /= temperature[r];
      if (top_k[r] <= 0 && top_p[r] >= 1.f) {
        s.e.resize(vocab);
        const float m = row_max(x, vocab);
        const double total = exp_and_sum(x, m, vocab, s.e.data(), s.chunk);
        out[r] = walk_unfiltered(s.e.data(), s.chunk, total, vocab, u[r]);
      } else {
        out[r] = sample_filtered(s, vocab, top_k[r], top_p[r], u[r]);
      }
    }
  });
}

void sample_tokens(at::Tensor logits, at::Tensor temperature, at::Tensor top_k, at::Tensor top_p,
                   at::Tensor u, at::Tensor adjust_offsets, at::Tensor adjust_ids,
                   at::Tensor adjust_values, at::Tensor out) {
  check_cpu(logits, "logits");
  const int64_t rows = logits.size(0);
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [rows, vocab]");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && top_p.scalar_type() == at::kFloat &&
                  top_k.scalar_type() == at::kLong && u.scalar_type() == at::kDouble &&
                  out.scalar_type() == at::kLong, "sample_tokens: parameter dtypes");
  TORCH_CHECK(temperature.numel() == rows && top_k.numel() == rows && top_p.numel() == rows &&
                  u.numel() == rows && out.numel() == rows &&
                  adjust_offsets.numel() == rows + 1, "sample_tokens: one parameter per row");
  TORCH_CHECK(adjust_offsets.scalar_type() == at::kLong && adjust_ids.scalar_type() == at::kLong
                  && adjust_values.scalar_type() == at::kFloat &&
                  adjust_ids.numel() == adjust_values.numel(), "sample_tokens: adjustments");
  for (const at::Tensor* t : {&temperature, &top_k, &top_p, &u, &adjust_offsets, &adjust_ids,
                              &adjust_values, &out}) {
    TORCH_CHECK(t->is_contiguous(), "sample_tokens: parameters must be contiguous");
  }
  auto run = [&](auto tag) {
    using T = decltype(tag);
    sample_tokens_impl<T>(logits, temperature.data_ptr<float>(), top_k.data_ptr<int64_t>(),
                          top_p.data_ptr<float>(), u.data_ptr<double>(),
                          adjust_offsets.data_ptr<int64_t>(), adjust_ids.data_ptr<int64_t>(),
                          adjust_values.data_ptr<float>(), out.data_ptr<int64_t>());
  };
  if (logits.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kBFloat16, "sample_tokens: float32 or bfloat16");
    run(BFloat16{});
  }
}

// Log-probabilities under the model's own distribution (no temperature or filters): of the
// chosen token, and the num_top best tokens (ties: lower id first).
template <typename T>
void token_logprobs_impl(const at::Tensor& logits, const int64_t* tokens, int64_t num_top,
                         float* chosen, int64_t* top_ids, float* top_vals) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const T* lp = logits.data_ptr<T>();
  const int64_t stride = logits.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    RowScratch s;
    s.x.resize(vocab);
    s.e.resize(vocab);
    for (int64_t r = b; r < e; ++r) {
      float* x = s.x.data();
      load_row(lp + r * stride, vocab, x);
      const float m = row_max(x, vocab);
      const double z = exp_and_sum(x, m, vocab, s.e.data(), s.chunk);
      const double log_z = static_cast<double>(m) + std::log(z);
      chosen[r] = static_cast<float>(x[tokens[r]] - log_z);
      if (num_top > 0) {
        auto& idx = s.idx;
        const int64_t k = std::min(num_top, vocab);
        float lo = m;
        for (int64_t i = 0; i < vocab; ++i) lo = std::min(lo, x[i]);
        kept_ids(x, vocab, top_k_set(x, vocab, k, lo, m), idx);
        for (int64_t j = 0; j < k; ++j) {
          top_ids[r * num_top + j] = idx[j];
          top_vals[r * num_top + j] = static_cast<float>(x[idx[j]] - log_z);
        }
      }
    }
  });
}

void token_logprobs(at::Tensor logits, at::Tensor tokens, int64_t num_top, at::Tensor chosen,
                    at::Tensor top_ids, at::Tensor top_values) {
  check_cpu(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [rows, vocab]");
  const int64_t rows = logits.size(0);
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.numel() == rows &&
                  tokens.is_contiguous(), "tokens must be [rows] int64");
  TORCH_CHECK(chosen.scalar_type() == at::kFloat && chosen.numel() == rows &&
                  chosen.is_contiguous(), "chosen must be [rows] float32");
  TORCH_CHECK(top_ids.scalar_type() == at::kLong && top_values.scalar_type() == at::kFloat &&
                  top_ids.numel() == rows * num_top && top_values.numel() == rows * num_top &&
                  top_ids.is_contiguous() && top_values.is_contiguous(),
              "top_ids [rows, num_top] int64 and top_values float32");
  if (logits.scalar_type() == at::kFloat) {
    token_logprobs_impl<float>(logits, tokens.data_ptr<int64_t>(), num_top,
                               chosen.data_ptr<float>(), top_ids.data_ptr<int64_t>(),
                               top_values.data_ptr<float>());
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kBFloat16, "token_logprobs: float32 or bfloat16");
    token_logprobs_impl<BFloat16>(logits, tokens.data_ptr<int64_t>(), num_top,
                                  chosen.data_ptr<float>(), top_ids.data_ptr<int64_t>(),
                                  top_values.data_ptr<float>());
  }
}

// ---------------------------------------------------------------------------------------------
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

}  // namespace
}  // namespace minimill

TORCH_LIBRARY(minimill, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("rotary_kv_write(Tensor qkv, Tensor positions, Tensor cos_sin, Tensor(a!) q_out, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, int num_heads, "
        "int num_kv_heads, int block_size) -> ()");
  m.def("sample_tokens(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, "
        "Tensor u, Tensor adjust_offsets, Tensor adjust_ids, Tensor adjust_values, "
        "Tensor(a!) out) -> ()");
  m.def("token_logprobs(Tensor logits, Tensor tokens, int num_top, Tensor(a!) chosen, "
        "Tensor(b!) top_ids, Tensor(c!) top_values) -> ()");
  m.def("pin_threads(int[] cpus) -> int[]");
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor query_start, Tensor seq_lens, float scale, "
        "int block_size) -> ()");
}

TORCH_LIBRARY_IMPL(minimill, CompositeExplicitAutograd, m) {
  m.impl("pin_threads", &minimill::pin_threads);
}

TORCH_LIBRARY_IMPL(minimill, CPU, m) {
  m.impl("rms_norm", &minimill::rms_norm);
  m.impl("add_rms_norm", &minimill::add_rms_norm);
  m.impl("silu_and_mul", &minimill::silu_and_mul);
  m.impl("rotary_kv_write", &minimill::rotary_kv_write);
  m.impl("paged_attention", &minimill::paged_attention);
  m.impl("sample_tokens", &minimill::sample_tokens);
  m.impl("token_logprobs", &minimill::token_logprobs);
}
