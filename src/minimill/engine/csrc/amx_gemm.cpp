// bf16 GEMMs of few rows on AMX tiles, for the experts of a mixture-of-experts layer (moe.cpp):
// an expert sees a few of a step's tokens (16 of a 128-token step for top-8 of 64), where
// oneDNN's GEMM runs at a fraction of its speed and pads to a fixed row count for batch
// invariance. Here the weight is packed once into the tiles' VNNI layout and streamed once per
// call; each 16-row tile of the input multiplies it with one tile instruction per 16x16x32
// block. A row's result depends on that row alone (the tiles add the K blocks in one fixed
// order, whatever the other rows are), so a token gets the same bits alone or in any batch.
//
// The weight W [N, K] (out = x @ W^T) is packed in tiles of 16 x 32: the tile of output block
// nb and K block kb holds in row p (W[n][32kb + 2p], W[n][32kb + 2p + 1]) for n = 16nb ..
// 16nb+15, the B operand of `tdpbf16ps` as it is loaded. Output blocks go in groups of four,
// computed together; a group's tiles are stored in the order the kernel reads them (K block by
// K block, the four side by side), so the weight streams from memory in one pass.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define MINIMILL_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace minimill {

namespace {

constexpr int64_t kTileRows = 16;  // rows of an A tile, of a C tile
constexpr int64_t kTileK = 32;     // bf16 values of K per tile instruction
constexpr int64_t kTileN = 16;     // fp32 columns of a C tile
constexpr int64_t kGroupN = 4;     // C tiles (output blocks) computed together

#ifdef MINIMILL_AMX

// Linux hands out AMX's tile state only to a process that asks for it (once per process).
bool request_amx() {
  static const bool granted = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes: A (16 rows x 32 bf16), B (16 K pairs x 16 columns x 2),
// C (16 rows x 16 fp32). Loaded on every call: oneDNN's AMX kernels load their own
// configuration and release the tiles after them, on the same threads.
void load_tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// C tiles tmm4..tmm7 for the `kCount` output blocks of group `b` (its tiles in K order, the
// group's blocks side by side for each K block) and the 16 rows at `a`.
template <int kCount>
void tile_block(const BFloat16* a, int64_t a_stride, const BFloat16* b, int64_t k_blocks,
                float* c, int64_t c_stride) {
  constexpr int64_t kTile = kTileRows * kTileK;  // bf16 values of one B tile
  _tile_zero(4);
  if constexpr (kCount > 1) _tile_zero(5);
  if constexpr (kCount > 2) _tile_zero(6);
  if constexpr (kCount > 3) _tile_zero(7);
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    const BFloat16* bk = b + kb * kCount * kTile;
    _tile_loadd(0, a + kb * kTileK, a_stride * sizeof(BFloat16));
    _tile_loadd(1, bk, 64);
    _tile_dpbf16ps(4, 0, 1);
    if constexpr (kCount > 1) {
      _tile_loadd(2, bk + kTile, 64);
      _tile_dpbf16ps(5, 0, 2);
    }
    if constexpr (kCount > 2) {
      _tile_loadd(3, bk + 2 * kTile, 64);
      _tile_dpbf16ps(6, 0, 3);
    }
    if constexpr (kCount > 3) {
      _tile_loadd(1, bk + 3 * kTile, 64);
      _tile_dpbf16ps(7, 0, 1);
    }
  }
  _tile_stored(4, c, c_stride * sizeof(float));
  if constexpr (kCount > 1) _tile_stored(5, c + kTileN, c_stride * sizeof(float));
  if constexpr (kCount > 2) _tile_stored(6, c + 2 * kTileN, c_stride * sizeof(float));
  if constexpr (kCount > 3) _tile_stored(7, c + 3 * kTileN, c_stride * sizeof(float));
}

// out[r, n] = bf16(sum_k x[r, k] W[n, k] + bias[n]) for `rows` rows, rows a multiple of 16
// (the caller pads). Output blocks are split over the threads.
void amx_gemm(const BFloat16* x, int64_t x_stride, int64_t rows, const BFloat16* packed,
              int64_t n, int64_t k, const float* bias, BFloat16* out, int64_t out_stride) {
  const int64_t k_blocks = k / kTileK, n_blocks = n / kTileN;
  const int64_t groups = (n_blocks + kGroupN - 1) / kGroupN;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    load_tile_config();
    alignas(64) float c[kTileRows * kTileN * kGroupN];
    constexpr int64_t c_stride = kTileN * kGroupN;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t nb0 = g * kGroupN, count = std::min(kGroupN, n_blocks - nb0);
      for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
        const BFloat16* a = x + r0 * x_stride;
        const BFloat16* b = packed + nb0 * k_blocks * kTileRows * kTileK;
        switch (count) {
          case 4: tile_block<4>(a, x_stride, b, k_blocks, c, c_stride); break;
          case 3: tile_block<3>(a, x_stride, b, k_blocks, c, c_stride); break;
          case 2: tile_block<2>(a, x_stride, b, k_blocks, c, c_stride); break;
          default: tile_block<1>(a, x_stride, b, k_blocks, c, c_stride); break;
        }
        const int64_t cols = count * kTileN, col0 = nb0 * kTileN;
        for (int64_t r = 0; r < kTileRows; ++r) {
          BFloat16* o = out + (r0 + r) * out_stride + col0;
          const float* cr = c + r * c_stride;
          for (int64_t j = 0; j < cols; j += kVec) {
            fVec v = load_f(cr + j);
            if (bias) v = v + load_f(bias + col0 + j);
            store_f(o + j, v);
          }
        }
      }
    }
    _tile_release();
  });
}

#endif  // MINIMILL_AMX

void check_packed(const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTileRows && packed.size(3) == kTileK &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "amx_linear: the weight must come from amx_pack_weight");
}

}  // namespace

bool amx_available() {
#ifdef MINIMILL_AMX
  return request_amx();
#else
  return false;
#endif
}

at::Tensor amx_pack_weight(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "amx_pack_weight: a bf16 [out, in] weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kTileN == 0 && k % kTileK == 0, "amx_pack_weight: out (", n,
              ") must be a multiple of 16 and in (", k, ") of 32");
  // [N, K] -> tiles [N/16 (block), K/32, 16 (pair), 16 (n), 2]; then each group of 4
  // blocks (the last may hold fewer) K block by K block, its blocks side by side.
  const int64_t n_blocks = n / kTileN, k_blocks = k / kTileK;
  const at::Tensor tiles = weight.contiguous()
                               .view({n_blocks, kTileN, k_blocks, kTileK / 2, 2})
                               .permute({0, 2, 3, 1, 4});
  std::vector<at::Tensor> groups;
  for (int64_t nb0 = 0; nb0 < n_blocks; nb0 += kGroupN) {
    const int64_t count = std::min(kGroupN, n_blocks - nb0);
    groups.push_back(tiles.narrow(0, nb0, count).transpose(0, 1).contiguous().view({-1}));
  }
  return at::cat(groups).view({n_blocks, k_blocks, kTileRows, kTileK});
}

// x [rows, in] bf16 -> [rows, out] bf16; rows zero-padded to 16 inside.
at::Tensor amx_linear(at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias) {
  check_packed(packed);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "amx_linear: x bf16 [rows, in] with contiguous rows");
  const int64_t n = packed.size(0) * kTileN, k = packed.size(1) * kTileK;
  TORCH_CHECK(x.size(1) == k, "amx_linear: x has ", x.size(1), " columns, the weight ", k);
  const int64_t rows = x.size(0);
  const int64_t padded_rows = (rows + kTileRows - 1) / kTileRows * kTileRows;
  at::Tensor input = x;
  if (padded_rows != rows) {
    input = x.new_zeros({padded_rows, k});
    input.narrow(0, 0, rows).copy_(x);
  }
  at::Tensor b;
  if (bias) {
    TORCH_CHECK(bias->numel() == n, "amx_linear: bias of ", n, " values");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = x.new_empty({padded_rows, n});
#ifdef MINIMILL_AMX
  TORCH_CHECK(request_amx(), "amx_linear: the kernel did not grant AMX's tile state");
  amx_gemm(input.data_ptr<BFloat16>(), input.stride(0), padded_rows,
           packed.data_ptr<BFloat16>(), n, k, bias ? b.data_ptr<float>() : nullptr,
           out.data_ptr<BFloat16>(), out.stride(0));
#else
  TORCH_CHECK(false, "amx_linear: these kernels were built without AMX");
#endif
  return padded_rows == rows ? out : out.narrow(0, 0, rows);
}

}  // namespace minimill
