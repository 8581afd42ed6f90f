// Attention over an int4 KV cache (attention.py has the layout and the reference path).
//
// Sealed blocks hold 4-bit codes with float16 ranges, K per channel over the block's tokens
// and V per token; each sequence's open last block is read from its staging units (slices of
// pool blocks in the int8 layout of attention.cpp, `unit` tokens each; kv_int4.py).
// Codes are dequantized as they are read, never into a copy of the cache: a work item (up to
// 16 query rows of one sequence and one kv head) dequantizes one block at a time into a float
// tile of block_size x head_dim that stays in L1, and every row and query head of the group
// scores and accumulates from it, with an online softmax. The step's own tokens are read from
// their exact K and V (k_new, v_new), not from the cache they were just quantized into: a
// prompt chunk attends to itself at full precision, as the most recent tokens should be.

#include <array>

#include "kv_int8.h"
#include "ops.h"
#include "vec.h"

namespace minimill {
namespace {

constexpr int64_t kMaxGroupHeads = 16;

// A staging view [blocks, S, kv_heads, unit elements] (K's; V's is alike): unit u is slice
// u % S of block u / S.
struct StageLayout {
  int64_t block_stride, part_stride, parts, head_stride;

  explicit StageLayout(const at::Tensor& stage)
      : block_stride(stage.stride(0)), part_stride(stage.stride(1)), parts(stage.size(1)),
        head_stride(stage.stride(2)) {}

  // Where kv head h of unit u starts.
  int64_t offset(int64_t u, int64_t h) const {
    return (u / parts) * block_stride + (u % parts) * part_stride + h * head_stride;
  }
};

inline float half_at(const uint8_t* p, int64_t i) {
  return static_cast<float>(reinterpret_cast<const at::Half*>(p)[i]);
}

struct Int4Args {
  const float* k_new;  // [tokens, kv_heads, d]: this step's K and V, exact
  const float* v_new;
  const uint8_t* k_cache;
  const uint8_t* v_cache;
  const int8_t* k_stage;
  const int8_t* v_stage;
  int64_t cache_block_stride, cache_head_stride;
  StageLayout stage;
  int64_t block_size, head_dim, group_heads;
  int64_t unit;  // tokens per staging unit (kv_int4.INT4_STAGE_UNIT)
};

// kVec packed bytes as 2 * kVec values in order (each byte's low nibble, then its high one).
inline void load_nibbles(const uint8_t* p, fVec& first, fVec& second) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const fVec lo(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15))));
  const fVec hi(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const fVec lo(_mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15))));
  const fVec hi(_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)));
#else
  float l[kVec], h[kVec];
  for (int i = 0; i < kVec; ++i) {
    l[i] = static_cast<float>(p[i] & 15);
    h[i] = static_cast<float>(p[i] >> 4);
  }
  const fVec lo = fVec::loadu(l), hi = fVec::loadu(h);
#endif
  std::tie(first, second) = at::vec::interleave2(lo, hi);
}

// n codes (two per byte, low nibble first) as low + scale * code, into dst[0, n).
inline void dequantize_codes(const uint8_t* codes, int64_t n, float scale, float low,
                             float* dst) {
  int64_t i = 0;
  const fVec vs(scale), vl(low);
  for (; i + 2 * kVec <= n; i += 2 * kVec) {
    fVec a, b;
    load_nibbles(codes + i / 2, a, b);
    at::vec::fmadd(a, vs, vl).store(dst + i);
    at::vec::fmadd(b, vs, vl).store(dst + i + kVec);
  }
  for (; i < n; ++i) {
    const uint8_t byte = codes[i / 2];
    dst[i] = low + scale * static_cast<float>(i % 2 ? byte >> 4 : byte & 15);
  }
}

// One sealed block of one kv head, dequantized into float tiles that stay in L1 and are
// shared by every query row and head of the work item: K transposed, kt[c * stride + t] (the
// block's K codes are per channel already, and scores then run along the tokens, a vector of
// keys at a time), and V by token, vt[t * d + c].
void dequantize_block(const Int4Args& a, const uint8_t* kblock, const uint8_t* vblock, int64_t n,
                      float* kt, int64_t stride, float* vt) {
  const int64_t bs = a.block_size, d = a.head_dim;
  const uint8_t* kmeta = kblock + bs * d / 2;
  for (int64_t c = 0; c < d; ++c) {
    dequantize_codes(kblock + c * (bs / 2), n, half_at(kmeta, c), half_at(kmeta, d + c),
                     kt + c * stride);
  }
  const uint8_t* vmeta = vblock + bs * d / 2;
  for (int64_t t = 0; t < n; ++t) {
    dequantize_codes(vblock + t * (d / 2), d, half_at(vmeta, t), half_at(vmeta, bs + t),
                     vt + t * d);
  }
}

// The first n tokens of an open block of kv head kh, from its staging units in order (int8:
// K [d][unit], V [unit][d], then a float16 scale and an int8 zero point per token), into the
// tiles of dequantize_block. K's codes are first gathered unit by unit into one int8 tile
// (kcodes, [d][stride]) with their tokens' zero points and scales (kzero, kscale), then
// dequantized a vector of tokens at a time; V's rows a vector of channels at a time.
void dequantize_staged(const Int4Args& a, const int32_t* units, int64_t kh, int64_t n, float* kt,
                       int64_t stride, float* vt, int8_t* kcodes, float* kzero, float* kscale) {
  const int64_t u = a.unit, d = a.head_dim;
  const int64_t num_units = (n + u - 1) / u;
  for (int64_t i = 0; i < num_units; ++i) {
    TORCH_CHECK(units[i] >= 0, "paged_attention_int4: an open block without its staging units");
    const int64_t off = a.stage.offset(units[i], kh);
    const int8_t* kunit = a.k_stage + off;
    const int8_t* vunit = a.v_stage + off;
    const at::Half* k_scales = int8_scales(kunit, u, d);
    const at::Half* v_scales = int8_scales(vunit, u, d);
    const int8_t* k_zeros = int8_zeros(kunit, u, d);
    const int8_t* v_zeros = int8_zeros(vunit, u, d);
    for (int64_t t = 0; t < u; ++t) {
      kscale[i * u + t] = static_cast<float>(k_scales[t]);
      kzero[i * u + t] = static_cast<float>(k_zeros[t]);
    }
    if (u == 4) {  // kv_int4.INT4_STAGE_UNIT: a fixed-size copy compiles to one move
      for (int64_t c = 0; c < d; ++c) std::memcpy(kcodes + c * stride + i * 4, kunit + c * 4, 4);
    } else {
      for (int64_t c = 0; c < d; ++c) std::memcpy(kcodes + c * stride + i * u, kunit + c * u, u);
    }
    for (int64_t t = 0; t < std::min(u, n - i * u); ++t) {
      const float vs = static_cast<float>(v_scales[t]), vz = v_zeros[t];
      const int8_t* src = vunit + t * d;
      float* vrow = vt + (i * u + t) * d;
      int64_t c = 0;
      for (; c + kVec <= d; c += kVec) ((load_i8(src + c) - fVec(vz)) * fVec(vs)).store(vrow + c);
      for (; c < d; ++c) vrow[c] = (static_cast<float>(src[c]) - vz) * vs;
    }
  }
  // Whole units: tokens of the last unit past n are dequantized too, into lanes never read.
  const int64_t tokens = num_units * u;
  for (int64_t c = 0; c < d; ++c) {
    const int8_t* codes = kcodes + c * stride;
    float* dst = kt + c * stride;
    int64_t t = 0;
    for (; t + kVec <= tokens; t += kVec) {
      ((load_i8(codes + t) - fVec::loadu(kzero + t)) * fVec::loadu(kscale + t)).store(dst + t);
    }
    for (; t < tokens; ++t) dst[t] = (static_cast<float>(codes[t]) - kzero[t]) * kscale[t];
  }
}

// Vectors of keys (scores) or channels (V) one pass keeps in registers per query vector: with
// up to 4 query vectors, 4 x 4 accumulators fit AVX-512's 32 registers beside the loads; AVX2
// has 16.
constexpr int kPassVecs = kVec == 16 ? 4 : 2;

// scores[i][t0 + j * kVec ..] for TV vectors of keys from t0: NQ * TV independent chains of
// multiply-adds (the units' rate, not one chain's latency); each score is still one chain over
// the channels in order.
template <int NQ, int TV>
inline void score_vectors(const float* const* qs, const float* kt, int64_t t0, int64_t stride,
                          int64_t d, float* const* scores) {
  fVec acc[NQ][TV];
  for (int i = 0; i < NQ; ++i) {
    for (int j = 0; j < TV; ++j) acc[i][j] = fVec(0.f);
  }
  for (int64_t c = 0; c < d; ++c) {
    fVec keys[TV];
    for (int j = 0; j < TV; ++j) keys[j] = fVec::loadu(kt + c * stride + t0 + j * kVec);
    for (int i = 0; i < NQ; ++i) {
      const fVec qc(qs[i][c]);
      for (int j = 0; j < TV; ++j) acc[i][j] = at::vec::fmadd(qc, keys[j], acc[i][j]);
    }
  }
  for (int i = 0; i < NQ; ++i) {
    for (int j = 0; j < TV; ++j) acc[i][j].store(scores[i] + t0 + j * kVec);
  }
}

// scores[q][t] = query q . key t for t in [0, n) rounded up to whole vectors (a tile row holds
// `stride` >= that many keys; scores past n come from whatever the tile holds and are never
// read), NQ query vectors at a time so that each load of keys serves all of them.
template <int NQ>
inline void score_tile(const float* const* qs, const float* kt, int64_t n, int64_t stride,
                       int64_t d, float* const* scores) {
  int64_t t0 = 0;
  for (; t0 + kPassVecs * kVec <= n; t0 += kPassVecs * kVec) {
    score_vectors<NQ, kPassVecs>(qs, kt, t0, stride, d, scores);
  }
  switch ((n - t0 + kVec - 1) / kVec) {  // up to kPassVecs: n need not be whole vectors
    case 4: score_vectors<NQ, 4>(qs, kt, t0, stride, d, scores); break;
    case 3: score_vectors<NQ, 3>(qs, kt, t0, stride, d, scores); break;
    case 2: score_vectors<NQ, 2>(qs, kt, t0, stride, d, scores); break;
    case 1: score_vectors<NQ, 1>(qs, kt, t0, stride, d, scores); break;
    default: break;
  }
}

// acc[i][c0 + j * kVec ..] = acc[i][..] * correction[i] + sum over t < n of p[i][t] V[t][..],
// for CV vectors of channels from c0 and NQ query vectors that see the same n keys: each V load
// serves all of them, and NQ * CV chains run side by side (each still over t in order).
template <int NQ, int CV>
inline void accumulate_vectors(const float* const* ps, const float* correction,
                               float* const* accs, const float* vt, int64_t n, int64_t d,
                               int64_t c0) {
  fVec sum[NQ][CV];
  for (int i = 0; i < NQ; ++i) {
    const fVec vc(correction[i]);
    for (int j = 0; j < CV; ++j) sum[i][j] = fVec::loadu(accs[i] + c0 + j * kVec) * vc;
  }
  for (int64_t t = 0; t < n; ++t) {
    fVec v[CV];
    for (int j = 0; j < CV; ++j) v[j] = fVec::loadu(vt + t * d + c0 + j * kVec);
    for (int i = 0; i < NQ; ++i) {
      const fVec pt(ps[i][t]);
      for (int j = 0; j < CV; ++j) sum[i][j] = at::vec::fmadd(pt, v[j], sum[i][j]);
    }
  }
  for (int i = 0; i < NQ; ++i) {
    for (int j = 0; j < CV; ++j) sum[i][j].store(accs[i] + c0 + j * kVec);
  }
}

// accumulate_vectors over all of head_dim (a multiple of kVec).
template <int NQ>
inline void accumulate_tile(const float* const* ps, const float* correction, float* const* accs,
                            const float* vt, int64_t n, int64_t d) {
  int64_t c0 = 0;
  for (; c0 + kPassVecs * kVec <= d; c0 += kPassVecs * kVec) {
    accumulate_vectors<NQ, kPassVecs>(ps, correction, accs, vt, n, d, c0);
  }
  switch ((d - c0) / kVec) {
    case 3: accumulate_vectors<NQ, 3>(ps, correction, accs, vt, n, d, c0); break;
    case 2: accumulate_vectors<NQ, 2>(ps, correction, accs, vt, n, d, c0); break;
    case 1: accumulate_vectors<NQ, 1>(ps, correction, accs, vt, n, d, c0); break;
    default: break;
  }
}

// Query rows per work item: each block is dequantized once for this many rows.
constexpr int64_t kRowsPerItem = 16;

template <typename T>
void attention_int4_impl(at::Tensor& out, const at::Tensor& q, const Int4Args& args,
                         const at::Tensor& block_tables, const at::Tensor& stage_slots,
                         const at::Tensor& query_start, const at::Tensor& seq_lens,
                         float scale) {
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t num_heads = q.size(1), d = args.head_dim, bs = args.block_size;
  const int64_t gh = args.group_heads, kv_heads = num_heads / gh;
  const int64_t width = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* slots = stage_slots.data_ptr<int32_t>();
  const int64_t units_per_group = stage_slots.size(1);
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1), out_row = out.stride(0);
  // Work items: (sequence, run of up to kRowsPerItem query rows, kv head).
  std::vector<std::array<int64_t, 3>> items;  // sequence, first row, end row
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t r = starts[s]; r < starts[s + 1]; r += kRowsPerItem) {
      items.push_back({s, r, std::min<int64_t>(r + kRowsPerItem, starts[s + 1])});
    }
  }
  const int64_t num_items = static_cast<int64_t>(items.size()) * kv_heads;
  // A tile row (K's keys, one channel; a query's scores): whole vectors.
  const int64_t stride = (bs + kVec - 1) / kVec * kVec;
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(kRowsPerItem * gh * d), acc(kRowsPerItem * gh * d);
    // Zeroed once: lanes past a block's last key are read (and ignored) by whole vectors.
    std::vector<float> kt(d * stride, 0.f), vt(bs * d), p(kRowsPerItem * gh * stride, 0.f);
    std::vector<float> m(kRowsPerItem * gh), l(kRowsPerItem * gh), correction(kRowsPerItem * gh);
    // Staged K codes gathered from their units, and their tokens' zero points and scales.
    std::vector<int8_t> kcodes(d * stride, 0);
    std::vector<float> kzero(stride, 0.f), kscale(stride, 0.f);
    for (int64_t item = begin; item < end; ++item) {
      const auto& [s, r0, r1] = items[item / kv_heads];
      const int64_t kh = item % kv_heads;
      const int64_t seq_len = lens[s], q_len = starts[s + 1] - starts[s];
      const int64_t first_pos = seq_len - q_len - starts[s];  // + row = position
      const int64_t rows = r1 - r0;
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t h = 0; h < gh; ++h) {
          const T* src = qp + (r0 + i) * q_row + (kh * gh + h) * q_head;
          float* dst = qs.data() + (i * gh + h) * d;
          for (int64_t c = 0; c < d; ++c) dst[c] = to_f(src[c]) * scale;
        }
      }
      std::fill(acc.begin(), acc.begin() + rows * gh * d, 0.f);
      std::fill(m.begin(), m.begin() + rows * gh, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + rows * gh, 0.f);
      const int64_t last_pos = first_pos + r1 - 1;
      const int64_t new_from = seq_len - q_len;  // positions from here on are this step's
      for (int64_t b = 0; b * bs <= last_pos; ++b) {
        const int64_t n = std::min(bs, last_pos + 1 - b * bs);
        const int64_t exact_from = std::max<int64_t>(0, new_from - b * bs);  // tile row
        if (exact_from == 0) {
          // Every row read here is this step's: nothing to dequantize.
        } else if ((b + 1) * bs <= seq_len) {
          const int64_t off = tables[s * width + b] * args.cache_block_stride +
                              kh * args.cache_head_stride;
          dequantize_block(args, args.k_cache + off, args.v_cache + off, n, kt.data(), stride,
                           vt.data());
        } else {
          dequantize_staged(args, slots + s * units_per_group, kh, std::min(n, exact_from),
                            kt.data(), stride, vt.data(), kcodes.data(), kzero.data(),
                            kscale.data());
        }
        for (int64_t t = exact_from; t < n; ++t) {
          const int64_t at = (starts[s] + b * bs + t - new_from) * kv_heads * d + kh * d;
          for (int64_t c = 0; c < d; ++c) kt[c * stride + t] = args.k_new[at + c];
          std::memcpy(vt.data() + t * d, args.v_new + at, d * sizeof(float));
        }
        // Scores of every row and head of the item that sees this block, up to 4 query
        // vectors per pass over the keys.
        std::array<const float*, 4> qv{};
        std::array<float*, 4> pv{};
        int nq = 0;
        int64_t pass_n = 0;
        auto flush = [&]() {
          switch (nq) {
            case 1: score_tile<1>(qv.data(), kt.data(), pass_n, stride, d, pv.data()); break;
            case 2: score_tile<2>(qv.data(), kt.data(), pass_n, stride, d, pv.data()); break;
            case 3: score_tile<3>(qv.data(), kt.data(), pass_n, stride, d, pv.data()); break;
            case 4: score_tile<4>(qv.data(), kt.data(), pass_n, stride, d, pv.data()); break;
            default: break;
          }
          nq = 0;
          pass_n = 0;
        };
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t ni = std::min(n, first_pos + r0 + i + 1 - b * bs);  // causal
          if (ni <= 0) continue;
          for (int64_t h = 0; h < gh; ++h) {
            qv[nq] = qs.data() + (i * gh + h) * d;
            pv[nq] = p.data() + (i * gh + h) * stride;
            pass_n = std::max(pass_n, ni);
            if (++nq == 4) flush();
          }
        }
        flush();
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t ni = std::min(n, first_pos + r0 + i + 1 - b * bs);  // causal
          if (ni <= 0) continue;
          for (int64_t h = 0; h < gh; ++h) {
            const int64_t rh = i * gh + h;
            float* pr = p.data() + rh * stride;
            // The running maximum, a vector at a time (a scalar loop kept it in memory).
            fVec vmax(m[rh]);
            int64_t t = 0;
            for (; t + kVec <= ni; t += kVec) vmax = at::vec::maximum(vmax, fVec::loadu(pr + t));
            float mx = at::vec::vec_reduce_all<float>(
                [](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, vmax);
            for (; t < ni; ++t) mx = std::max(mx, pr[t]);
            // Online softmax: rescale what was accumulated when the running maximum grows.
            correction[rh] = std::exp(m[rh] - mx);
            const fVec vmx(mx);
            for (t = 0; t < ni; t += kVec) (fVec::loadu(pr + t) - vmx).exp().store(pr + t);
            float sum = 0.f;
            for (t = 0; t < ni; ++t) sum += pr[t];
            l[rh] = l[rh] * correction[rh] + sum;
            m[rh] = mx;
          }
          // The row's query heads see the same keys: their V sums go up to 4 at a time.
          for (int64_t h0 = 0; h0 < gh; h0 += 4) {
            const int nq = static_cast<int>(std::min<int64_t>(4, gh - h0));
            const int64_t rh0 = i * gh + h0;
            if (d % kVec != 0) {
              for (int64_t rh = rh0; rh < rh0 + nq; ++rh) {
                float* a = acc.data() + rh * d;
                const float* pr = p.data() + rh * stride;
                for (int64_t c = 0; c < d; ++c) a[c] *= correction[rh];
                for (int64_t t = 0; t < ni; ++t) {
                  const float w = pr[t];
                  const float* vrow = vt.data() + t * d;
                  for (int64_t c = 0; c < d; ++c) a[c] += w * vrow[c];
                }
              }
              continue;
            }
            std::array<const float*, 4> probs{};
            std::array<float*, 4> sums{};
            for (int k = 0; k < nq; ++k) {
              probs[k] = p.data() + (rh0 + k) * stride;
              sums[k] = acc.data() + (rh0 + k) * d;
            }
            const float* corr = correction.data() + rh0;
            const float* v = vt.data();
            switch (nq) {
              case 1: accumulate_tile<1>(probs.data(), corr, sums.data(), v, ni, d); break;
              case 2: accumulate_tile<2>(probs.data(), corr, sums.data(), v, ni, d); break;
              case 3: accumulate_tile<3>(probs.data(), corr, sums.data(), v, ni, d); break;
              default: accumulate_tile<4>(probs.data(), corr, sums.data(), v, ni, d); break;
            }
          }
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t h = 0; h < gh; ++h) {
          const int64_t rh = i * gh + h;
          T* dst = op + (r0 + i) * out_row + (kh * gh + h) * d;
          const float inv = 1.f / l[rh];
          for (int64_t c = 0; c < d; ++c) dst[c] = from_f<T>(acc[rh * d + c] * inv);
        }
      }
    }
  });
}

void check_view(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t elems) {
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.size(2) == elems &&
                  t.scalar_type() == dtype && t.device().is_cpu(),
              "int4 KV: ", name, " must be a CPU ", dtype,
              " [blocks, kv_heads, ", elems, "] view with contiguous rows");
}

// A staging view: int8 [blocks, S, kv_heads, unit * (d + 3)], K and V alike.
void check_stage_views(const at::Tensor& k, const at::Tensor& v, int64_t unit, int64_t d,
                       int64_t heads) {
  for (const auto* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 4 && t->stride(3) == 1 && t->size(3) == unit * (d + 3) &&
                    t->size(2) == heads && t->scalar_type() == at::kChar && t->device().is_cpu(),
                "int4 KV: staging must be CPU int8 [blocks, S, kv_heads, ", unit * (d + 3),
                "] views with contiguous rows");
  }
  TORCH_CHECK(k.strides() == v.strides() && k.sizes() == v.sizes(),
              "int4 KV: K and V staging views alike");
}

// Quantizers, as kv_int4.py's quantize_int4 and attention.py's quantize_int8 (float16 ranges rounded so
// that the range still fits, codes rounded half to even like torch.round).
inline float half_round(float x) { return static_cast<float>(at::Half(x)); }

// n values rh stride `stride` -> 4-bit codes (one per value) and the float16 scale and low.
void quantize4(const float* x, int64_t n, int64_t stride, uint8_t* codes, at::Half* scale_out,
               at::Half* low_out) {
  float lo = x[0], hi = x[0];
  for (int64_t i = 1; i < n; ++i) {
    lo = std::min(lo, x[i * stride]);
    hi = std::max(hi, x[i * stride]);
  }
  const float low = half_round(lo);
  const float span = hi - low;
  const float scale = span > 0.f ? half_round(span / 15.f * (1.f + 1.f / 1024.f)) : 1.f;
  for (int64_t i = 0; i < n; ++i) {
    const float q = std::nearbyint((x[i * stride] - low) / scale);
    codes[i] = static_cast<uint8_t>(std::max(0.f, std::min(15.f, q)));
  }
  *scale_out = at::Half(scale);
  *low_out = at::Half(low);
}

}  // namespace

void paged_attention_int4(at::Tensor out, at::Tensor q, at::Tensor k_new, at::Tensor v_new,
                          at::Tensor k_cache, at::Tensor v_cache, at::Tensor k_stage,
                          at::Tensor v_stage, at::Tensor block_tables, at::Tensor stage_slots,
                          at::Tensor query_start, at::Tensor seq_lens, double scale,
                          int64_t block_size) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_attention_int4: q [tokens, heads, d]");
  const int64_t head_dim = q.size(2), kv_heads = k_cache.size(1);
  for (const auto* t : {&k_new, &v_new}) {
    TORCH_CHECK(t->dim() == 3 && t->is_contiguous() && t->scalar_type() == at::kFloat &&
                    t->size(0) == q.size(0) && t->size(1) == kv_heads &&
                    t->size(2) == head_dim && t->device().is_cpu(),
                "paged_attention_int4: k_new and v_new contiguous float32 [tokens, kv_heads, d]");
  }
  TORCH_CHECK(block_size % 2 == 0 && head_dim % 2 == 0 && q.size(1) % kv_heads == 0 &&
                  q.size(1) / kv_heads <= kMaxGroupHeads,
              "paged_attention_int4: even block_size and head_dim, rh most ", kMaxGroupHeads,
              " query heads per kv head");
  const int64_t elems = block_size * head_dim / 2 + 4 * std::max(block_size, head_dim);
  check_view(k_cache, "k_cache", at::kByte, elems);
  check_view(v_cache, "v_cache", at::kByte, elems);
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "paged_attention_int4: K and V views");
  TORCH_CHECK(stage_slots.dim() == 2 && stage_slots.size(0) == seq_lens.size(0) &&
                  stage_slots.size(1) > 0 && block_size % stage_slots.size(1) == 0,
              "paged_attention_int4: stage_slots [num_seqs, units per block]");
  const int64_t unit = block_size / stage_slots.size(1);
  check_stage_views(k_stage, v_stage, unit, head_dim, kv_heads);
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == q.size(0) &&
                  out.size(1) == q.size(1) * head_dim && out.scalar_type() == q.scalar_type(),
              "paged_attention_int4: out [tokens, heads * d] in q's dtype");
  for (const auto* t : {&block_tables, &stage_slots, &query_start, &seq_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device().is_cpu(),
                "paged_attention_int4: metadata must be contiguous int32 CPU tensors");
  }
  Int4Args args{k_new.data_ptr<float>(),     v_new.data_ptr<float>(),
                k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<uint8_t>(),
                k_stage.data_ptr<int8_t>(),  v_stage.data_ptr<int8_t>(),
                k_cache.stride(0),          k_cache.stride(1),
                StageLayout(k_stage),
                block_size,                 head_dim,
                q.size(1) / kv_heads,       unit};
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    attention_int4_impl<float>(out, q, args, block_tables, stage_slots, query_start, seq_lens, s);
  } else if (q.scalar_type() == at::kBFloat16) {
    attention_int4_impl<BFloat16>(out, q, args, block_tables, stage_slots, query_start,
                                  seq_lens, s);
  } else {
    TORCH_CHECK(false, "paged_attention_int4: float32 or bfloat16 queries, got ",
                q.scalar_type());
  }
}

}  // namespace minimill

namespace minimill {

// kv_int4.py's write_kv_int4_reference: blocks that fill this step are sealed from their
// staged tokens and the new ones (K per channel, V per token); every other new token is
// quantized to int8 into its sequence's staging units (`unit` tokens each). Sealing
// runs first and completes before staging starts, as a sequence's next open block reuses the
// units just read.
void kv_int4_write(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                   at::Tensor k_stage, at::Tensor v_stage, at::Tensor stage_tokens,
                   at::Tensor stage_mapping, at::Tensor seal_blocks, at::Tensor seal_stage,
                   at::Tensor seal_tokens, at::Tensor seal_rows, at::Tensor seal_offsets,
                   int64_t block_size) {
  TORCH_CHECK(k.dim() == 3 && k.is_contiguous() && v.is_contiguous() &&
                  k.sizes() == v.sizes() && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat,
              "kv_int4_write: k and v contiguous float32 [tokens, kv_heads, d]");
  const int64_t heads = k.size(1), d = k.size(2), bs = block_size;
  TORCH_CHECK(seal_stage.dim() == 2 && seal_stage.size(0) == seal_blocks.size(0) &&
                  seal_stage.size(1) > 0 && bs % seal_stage.size(1) == 0,
              "kv_int4_write: seal_stage [sealed blocks, units per block]");
  const int64_t elems = bs * d / 2 + 4 * std::max(bs, d), per_group = seal_stage.size(1);
  const int64_t unit = bs / per_group;
  check_view(k_cache, "k_cache", at::kByte, elems);
  check_view(v_cache, "v_cache", at::kByte, elems);
  check_stage_views(k_stage, v_stage, unit, d, heads);
  TORCH_CHECK(k_cache.strides() == v_cache.strides() && k_cache.size(1) == heads &&
                  bs % 2 == 0 && d % 2 == 0,
              "kv_int4_write: K and V views alike, kv_heads as k, even sizes");
  for (const auto* t : {&stage_tokens, &stage_mapping, &seal_blocks, &seal_stage, &seal_tokens,
                        &seal_rows, &seal_offsets}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(),
                "kv_int4_write: indices must be contiguous int64 CPU tensors");
  }
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  uint8_t* kc = k_cache.data_ptr<uint8_t>();
  uint8_t* vc = v_cache.data_ptr<uint8_t>();
  int8_t* ks = k_stage.data_ptr<int8_t>();
  int8_t* vs = v_stage.data_ptr<int8_t>();
  const int64_t cb = k_cache.stride(0), ch = k_cache.stride(1);
  const StageLayout stage(k_stage);
  const int64_t tok = heads * d;  // stride of a token in k and v

  const int64_t num_seals = seal_blocks.size(0);
  if (num_seals > 0) {
    const int64_t* blocks = seal_blocks.data_ptr<int64_t>();
    const int64_t* slots = seal_stage.data_ptr<int64_t>();
    const int64_t* tokens = seal_tokens.data_ptr<int64_t>();
    const int64_t* rows = seal_rows.data_ptr<int64_t>();
    const int64_t* offsets = seal_offsets.data_ptr<int64_t>();
    // Each sealed block's new tokens: rows are in order, so one range per block.
    std::vector<int64_t> first(num_seals + 1, seal_tokens.size(0));
    for (int64_t i = seal_tokens.size(0) - 1; i >= 0; --i) first[rows[i]] = i;
    for (int64_t m = num_seals - 1; m >= 0; --m) first[m] = std::min(first[m], first[m + 1]);
    at::parallel_for(0, num_seals * heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> xk(bs * d), xv(bs * d);
      std::vector<uint8_t> codes(bs * d);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t m = item / heads, h = item % heads;
        // Staged tokens, dequantized from every unit (int8: K [d][unit], V [unit][d], then
        // scales and zeros); the tokens this step writes replace what a unit held before.
        for (int64_t i = 0; i < per_group; ++i) {
          const int64_t at = stage.offset(slots[per_group * m + i], h);
          dequantize_int8_rows(ks + at, vs + at, unit, unit, d, xk.data() + i * unit * d,
                               xv.data() + i * unit * d);
        }
        for (int64_t i = first[m]; i < first[m + 1]; ++i) {
          std::memcpy(&xk[offsets[i] * d], kp + tokens[i] * tok + h * d, d * sizeof(float));
          std::memcpy(&xv[offsets[i] * d], vp + tokens[i] * tok + h * d, d * sizeof(float));
        }
        uint8_t* kdst = kc + blocks[m] * cb + h * ch;
        uint8_t* vdst = vc + blocks[m] * cb + h * ch;
        auto* kmeta = reinterpret_cast<at::Half*>(kdst + bs * d / 2);
        auto* vmeta = reinterpret_cast<at::Half*>(vdst + bs * d / 2);
        // K: per channel over the block's tokens; codes [d][bs] packed by token pairs.
        for (int64_t c = 0; c < d; ++c) {
          quantize4(xk.data() + c, bs, d, codes.data() + c * bs, kmeta + c, kmeta + d + c);
        }
        for (int64_t c = 0; c < d; ++c) {
          for (int64_t j = 0; j < bs / 2; ++j) {
            kdst[c * (bs / 2) + j] = codes[c * bs + 2 * j] | (codes[c * bs + 2 * j + 1] << 4);
          }
        }
        // V: per token; codes [bs][d] packed by channel pairs.
        for (int64_t t = 0; t < bs; ++t) {
          quantize4(xv.data() + t * d, d, 1, codes.data() + t * d, vmeta + t, vmeta + bs + t);
          for (int64_t j = 0; j < d / 2; ++j) {
            vdst[t * (d / 2) + j] = codes[t * d + 2 * j] | (codes[t * d + 2 * j + 1] << 4);
          }
        }
      }
    });
  }

  const int64_t num_staged = stage_tokens.size(0);
  if (num_staged > 0) {
    const int64_t* tokens = stage_tokens.data_ptr<int64_t>();
    const int64_t* mapping = stage_mapping.data_ptr<int64_t>();
    at::parallel_for(0, num_staged * heads, grain_rows(2 * d), [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t i = item / heads, h = item % heads;
        const int64_t slot = mapping[i] / unit, offset = mapping[i] % unit;
        const int64_t at = stage.offset(slot, h);
        int8_t* kst = ks + at;
        int8_t* vst = vs + at;
        int8_scales(kst, unit, d)[offset] = quantize_i8(
            kp + tokens[i] * tok + h * d, d, kst + offset, unit,
            int8_zeros(kst, unit, d) + offset);
        int8_scales(vst, unit, d)[offset] = quantize_i8(
            vp + tokens[i] * tok + h * d, d, vst + offset * d, 1,
            int8_zeros(vst, unit, d) + offset);
      }
    });
  }
}

}  // namespace minimill
