// RMSNorm (alone and with the residual add) and SiLU * up, row by row.

#include "ops.h"
#include "vec.h"

namespace minimill {

namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

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


}  // namespace minimill
