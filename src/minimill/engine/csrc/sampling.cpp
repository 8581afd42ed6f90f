// Token choice and logprobs from logits, row by row (semantics: engine/sampler.py).

#include "ops.h"
#include "vec.h"

namespace minimill {

namespace {

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
  std::vector<int32_t> ids;   // a compacted guided row's token ids (see gather_allowed)
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
  if (static_cast<int64_t>(s.e.size()) < vocab) s.e.resize(vocab);
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

// A guided row's allowed tokens: bit (i % 32) of word i / 32; ids past the mask's words are
// never allowed. A mask that allows nothing is not applied (the engine never fills one: a
// finished grammar still allows the end of the output).
int64_t count_allowed(const int32_t* words, int64_t num_words, int64_t vocab) {
  int64_t count = 0;
  const int64_t full = std::min(num_words, vocab / 32);
  for (int64_t w = 0; w < full; ++w) count += __builtin_popcount(static_cast<uint32_t>(words[w]));
  for (int64_t i = full * 32; i < std::min(vocab, num_words * 32); ++i) {
    count += (static_cast<uint32_t>(words[i / 32]) >> (i % 32)) & 1u;
  }
  return count;
}

// Every disallowed logit of a dense row becomes -inf. Words that allow all 32 ids are skipped;
// the others are blended without a branch per id (the compiler vectorizes the inner loop).
void apply_mask(float* x, int64_t vocab, const int32_t* words, int64_t num_words) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t covered = std::min(vocab, num_words * 32);
  for (int64_t w = 0; w * 32 < covered; ++w) {
    const uint32_t bits = static_cast<uint32_t>(words[w]);
    if (bits == 0xFFFFFFFFu) continue;
    const int64_t lo = w * 32, n = std::min<int64_t>(32, covered - lo);
    float* xs = x + lo;
    for (int64_t j = 0; j < n; ++j) xs[j] = ((bits >> j) & 1u) ? xs[j] : ninf;
  }
  for (int64_t i = covered; i < vocab; ++i) x[i] = ninf;
}

// A row whose grammar allows few tokens (most steps of a JSON answer outside its strings):
// its allowed logits, in id order, into x[0, n) and their ids into `ids`. Sampling those n
// values picks what sampling the whole row with every other logit at -inf picks (argmax,
// temperature, top-k/top-p and the inverse CDF all run in id order and ignore -inf tokens),
// without reading, exponentiating and summing the tens of thousands it leaves out.
template <typename T>
int64_t gather_allowed(const T* row, int64_t vocab, const int32_t* words, int64_t num_words,
                       float* x, std::vector<int32_t>& ids) {
  ids.clear();
  for (int64_t w = 0; w < num_words; ++w) {
    uint32_t bits = static_cast<uint32_t>(words[w]);
    while (bits) {
      const int64_t i = w * 32 + __builtin_ctz(bits);
      if (i >= vocab) return static_cast<int64_t>(ids.size());
      x[ids.size()] = to_f(row[i]);
      ids.push_back(static_cast<int32_t>(i));
      bits &= bits - 1;
    }
  }
  return static_cast<int64_t>(ids.size());
}

// Rows allowing at most vocab / kSparseShare tokens are gathered rather than masked.
constexpr int64_t kSparseShare = 4;

template <typename T>
void sample_tokens_impl(const at::Tensor& logits, const float* temperature, const int64_t* top_k,
                        const float* top_p, const double* u, const int64_t* adj_off,
                        const int64_t* adj_ids, const float* adj_vals,
                        const int64_t* mask_index, const int32_t* mask_words,
                        int64_t num_words, int64_t* out) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const T* lp = logits.data_ptr<T>();
  const int64_t stride = logits.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    RowScratch s;
    s.x.resize(vocab);
    for (int64_t r = b; r < e; ++r) {
      const bool greedy = temperature[r] == 0.f || top_k[r] == 1;
      const int32_t* words = mask_index[r] >= 0 ? mask_words + mask_index[r] * num_words
                                                : nullptr;
      const int64_t allowed = words ? count_allowed(words, num_words, vocab) : vocab;
      if (allowed == 0) words = nullptr;
      if (greedy && adj_off[r] == adj_off[r + 1] && words == nullptr) {
        out[r] = row_argmax(lp + r * stride, vocab);
        continue;
      }
      float* x = s.x.data();
      // n: the width sampled; a gathered row's position j is token s.ids[j].
      int64_t n = vocab;
      const bool gathered = words != nullptr && allowed * kSparseShare <= vocab;
      if (gathered) {
        n = gather_allowed(lp + r * stride, vocab, words, num_words, x, s.ids);
      } else {
        load_row(lp + r * stride, vocab, x);
      }
      for (int64_t a = adj_off[r]; a < adj_off[r + 1]; ++a) {
        if (adj_ids[a] < 0 || adj_ids[a] >= vocab) continue;
        if (!gathered) {
          x[adj_ids[a]] += adj_vals[a];
          continue;
        }
        const auto at = std::lower_bound(s.ids.begin(), s.ids.end(), adj_ids[a]);
        if (at != s.ids.end() && *at == adj_ids[a]) x[at - s.ids.begin()] += adj_vals[a];
      }
      if (words != nullptr && !gathered) apply_mask(x, vocab, words, num_words);
      const auto token = [&](int64_t j) { return gathered ? s.ids[j] : j; };
      if (greedy) {
        out[r] = token(row_argmax(x, n));
        continue;
      }
      const fVec vt(temperature[r]);
      int64_t i = 0;
      for (; i + kVec <= n; i += kVec) (fVec::loadu(x + i) / vt).store(x + i);
      for (; i < n; ++i) x[i] /= temperature[r];
      if (top_k[r] <= 0 && top_p[r] >= 1.f) {
        if (static_cast<int64_t>(s.e.size()) < n) s.e.resize(n);
        const float m = row_max(x, n);
        const double total = exp_and_sum(x, m, n, s.e.data(), s.chunk);
        out[r] = token(walk_unfiltered(s.e.data(), s.chunk, total, n, u[r]));
      } else {
        out[r] = token(sample_filtered(s, n, top_k[r], top_p[r], u[r]));
      }
    }
  });
}

}  // namespace

void sample_tokens(at::Tensor logits, at::Tensor temperature, at::Tensor top_k, at::Tensor top_p,
                   at::Tensor u, at::Tensor adjust_offsets, at::Tensor adjust_ids,
                   at::Tensor adjust_values, at::Tensor mask_index, at::Tensor mask_words,
                   at::Tensor out) {
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
  TORCH_CHECK(mask_index.scalar_type() == at::kLong && mask_index.numel() == rows &&
                  mask_words.scalar_type() == at::kInt && mask_words.dim() == 2,
              "sample_tokens: masks");
  const int64_t num_masks = mask_words.size(0), num_words = mask_words.size(1);
  const int64_t* mi = mask_index.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(mi[r] < num_masks, "sample_tokens: mask index out of range");
  }
  for (const at::Tensor* t : {&temperature, &top_k, &top_p, &u, &adjust_offsets, &adjust_ids,
                              &adjust_values, &mask_index, &mask_words, &out}) {
    TORCH_CHECK(t->is_contiguous(), "sample_tokens: parameters must be contiguous");
  }
  auto run = [&](auto tag) {
    using T = decltype(tag);
    sample_tokens_impl<T>(logits, temperature.data_ptr<float>(), top_k.data_ptr<int64_t>(),
                          top_p.data_ptr<float>(), u.data_ptr<double>(),
                          adjust_offsets.data_ptr<int64_t>(), adjust_ids.data_ptr<int64_t>(),
                          adjust_values.data_ptr<float>(), mi, mask_words.data_ptr<int32_t>(),
                          num_words, out.data_ptr<int64_t>());
  };
  if (logits.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kBFloat16, "sample_tokens: float32 or bfloat16");
    run(BFloat16{});
  }
}

namespace {

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

}  // namespace

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


}  // namespace minimill
