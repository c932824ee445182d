// y[R, N] = float(xq[R, K] @ wq[K, N]) * sx[R] * sw[N] on the AMX tiles (TDPBSSD: int8 x int8
// -> exact int32 sums) for an int8 weight packed once, at load time, into the tiles' layout
// (jengine.pallas_kernels.cpu_matmul.amx_int8_tiles): an `int8` (W8A8) projection, its
// activations quantized per row by the caller. The rescale is quant._rescale's, in its order
// ((sum * sx) * sw, f32), so y equals XLA's int8 dot and rescale to the bit; y is f32, or that
// rounded to bf16. Included by small_matmul.cc.
//
// Why: XLA:CPU runs the int8 dot on the tiles too, but each dot on one thread, from a weight it
// repacks per call, and into an int32 result that a second pass rescales; at decode sizes an
// int8 model's projections took 1.3x the bf16 AMX kernel's time (docs/quantization.md). Here the
// weight is read once per call straight from its packed tiles, the columns split over the
// threads as in amx_bf16.h, and the rescale happens on the C tile while it is in cache.
//
// Blocking: amx_bf16.h's (strips of 32 columns, blocks of 32 rows, four C tiles), with a k step
// of 64 int8 values (an A tile row is 64 bytes, a B tile 16 k quads x 16 columns x 4 bytes).

#ifndef JENGINE_AMX_INT8_H_
#define JENGINE_AMX_INT8_H_

#if defined(__x86_64__)

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_bf16.h"
#include "amx_swiglu.h"
#include "amx_tiles.h"

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512bf16,prfchw")

namespace jengine {
namespace amx {

constexpr int64_t kTileK8 = 64;             // int8 elements of k in one A tile row
constexpr int64_t kStepBytes8 = 2 * 1024;   // a k step's two B tiles

// Whether this process may run TDPBSSD: the tile state granted and the CPU has AMX-INT8.
inline bool PermittedInt8() {
  static const bool ok = Permitted() && __builtin_cpu_supports("amx-int8");
  return ok;
}

// xq [R, K] as the A tiles read it: [Rp, Kp] (R padded to 16, K to 64 with zeros), in place
// when its shape fits, else staged in `staged`.
inline const int8_t* TileRowsInt8(const int8_t* x, int64_t R, int64_t K, int64_t Kp,
                                  std::vector<int8_t>& staged) {
  const int64_t Rp = (R + kTileRows - 1) / kTileRows * kTileRows;
  if (Rp == R && Kp == K) return x;
  staged.assign(Rp * Kp, 0);
  for (int64_t r = 0; r < R; ++r) std::memcpy(&staged[r * Kp], x + r * K, K);
  return staged.data();
}

// The C tile of rows [r, r + 16) and columns [c, c + 16), its int32 sums in `acc` (16 x 16),
// rescaled by the rows' and columns' scales into y (f32, or rounded to bf16 as XLA's convert).
// sw holds `scale_cols` scales (N's, or fewer where y is a strip's buffer past the weight).
inline void StoreRescaled(const int32_t* acc, const float* sx, const float* sw,
                          int64_t scale_cols, void* y, bool y_bf16, int64_t R, int64_t N,
                          int64_t r, int64_t c) {
  const int64_t rows = std::min<int64_t>(kTileRows, R - r), cols = std::min<int64_t>(16, N - c);
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  const int64_t scaled = std::max<int64_t>(0, std::min<int64_t>(cols, scale_cols - c));
  const __m512 w = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << scaled) - 1), sw + c);
  for (int64_t i = 0; i < rows; ++i) {
    const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(acc + i * 16));
    const __m512 v = _mm512_mul_ps(_mm512_mul_ps(sum, _mm512_set1_ps(sx[r + i])), w);
    if (y_bf16) {
      const __m256bh h = _mm512_cvtneps_pbh(v);
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + (r + i) * N + c, keep,
                               reinterpret_cast<const __m256i&>(h));
    } else {
      _mm512_mask_storeu_ps(static_cast<float*>(y) + (r + i) * N + c, keep, v);
    }
  }
}

// _tile_stored takes the tile's number as a literal, hence a macro.
#define JE_STORE_RESCALED(tile, r, c)                            \
  do {                                                           \
    if ((c) < N) {                                               \
      _tile_stored(tile, acc, 64);                               \
      StoreRescaled(acc, sx, sw, scale_cols, y, y_bf16, R, N, r, c); \
    }                                                            \
  } while (0)

// y's rows [r0, r0 + 16 * row_tiles) and the 32 columns of one strip from c0: the strip's
// Kp / 64 k steps of two B tiles each against the staged rows (R of them valid, with scales sx;
// sw holds scale_cols column scales from column 0 of y).
inline void BlockInt8(const int8_t* xs, int64_t Kp, const int8_t* strip, int64_t r0,
                      int row_tiles, const float* sx, const float* sw, int64_t scale_cols,
                      void* y, bool y_bf16, int64_t R, int64_t N, int64_t c0, bool prefetch) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int8_t* a0 = xs + r0 * Kp;
  const int8_t* a1 = a0 + kTileRows * Kp;
  for (int64_t ks = 0; ks < Kp / kTileK8; ++ks) {
    const int8_t* b = strip + ks * kStepBytes8;
    if (prefetch) {  // the weight kPrefetchBytes ahead, as amx_bf16.h's Block
      const char* ahead = reinterpret_cast<const char*>(b) + kPrefetchBytes;
      for (int line = 0; line < 32; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T1);
    }
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + 1024, 64);
    _tile_loadd(4, a0 + ks * kTileK8, Kp);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    if (row_tiles == 2) {
      _tile_loadd(5, a1 + ks * kTileK8, Kp);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    }
  }
  alignas(64) int32_t acc[kTileRows * 16];
  JE_STORE_RESCALED(0, r0, c0);
  JE_STORE_RESCALED(1, r0, c0 + 16);
  if (row_tiles == 2) {
    JE_STORE_RESCALED(2, r0 + kTileRows, c0);
    JE_STORE_RESCALED(3, r0 + kTileRows, c0 + 16);
  }
}

#undef JE_STORE_RESCALED

// y [R, N] from xq [R, K] int8 with its row scales sx [R] and the weight's tiles ([S, Kp / 64,
// 2, 16, 64] int8, S = ceil(N / 32): strip s, k step ks, half h holds the B tile whose byte
// (p, 4 c + q) is w[64 ks + 4p + q][32 s + 16 h + c], zeros past K and N) with its column
// scales sw [N]. Strips split over the threads as PackedMatmul's.
inline void PackedMatmulInt8(xla::ffi::ThreadPool& pool, int32_t max_threads, const int8_t* x,
                             const float* sx, const int8_t* tiles, const float* sw, void* y,
                             bool y_bf16, int64_t R, int64_t K, int64_t Kp, int64_t N) {
  const int64_t Rp = (R + kTileRows - 1) / kTileRows * kTileRows;
  std::vector<int8_t> staged;
  const int8_t* xs = TileRowsInt8(x, R, K, Kp, staged);
  const int64_t strips = (N + kStrip - 1) / kStrip;
  const int64_t strip_bytes = Kp / kTileK8 * kStepBytes8;
  const int64_t panel = Rp < kPanelRows ? 1 : std::max<int64_t>(1, kPanelBytes / strip_bytes);
  ForStripRuns(pool, max_threads, R, strips, [&](int64_t s0, int64_t s1) {
    for (int64_t p0 = s0; p0 < s1; p0 += panel) {
      const int64_t p1 = std::min(s1, p0 + panel);
      for (int64_t r0 = 0; r0 < Rp; r0 += 2 * kTileRows) {
        for (int64_t s = p0; s < p1; ++s) {
          BlockInt8(xs, Kp, tiles + s * strip_bytes, r0, Rp - r0 >= 2 * kTileRows ? 2 : 1, sx,
                    sw, N, y, y_bf16, R, N, s * kStrip, r0 == 0);
        }
      }
    }
  });
}

// act [R, N] bf16 = silu(x @ w_gate) * (x @ w_up) for int8 gate and up weights (their tiles
// and column scales) and xq's rows: each block's two rescaled products into an L1 buffer, the
// activation applied there as amx_swiglu.h's (each product rounded to bf16 first, as the
// unfused `int8` model rounds them), so neither product goes to memory.
inline void PackedSwiGluInt8(xla::ffi::ThreadPool& pool, int32_t max_threads, const int8_t* x,
                             const float* sx, const int8_t* gate, const float* gate_scale,
                             const int8_t* up, const float* up_scale, uint16_t* y, int64_t R,
                             int64_t K, int64_t Kp, int64_t N) {
  const int64_t Rp = (R + kTileRows - 1) / kTileRows * kTileRows;
  std::vector<int8_t> staged;
  const int8_t* xs = TileRowsInt8(x, R, K, Kp, staged);
  const int64_t strips = (N + kStrip - 1) / kStrip;
  const int64_t strip_bytes = Kp / kTileK8 * kStepBytes8;
  ForStripRuns(pool, max_threads, R, strips, [&](int64_t s0, int64_t s1) {
    alignas(64) float g[2 * kTileRows * kStrip], u[2 * kTileRows * kStrip];
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t c0 = s * kStrip, cols = std::min(kStrip, N - c0);
      for (int64_t r0 = 0; r0 < Rp; r0 += 2 * kTileRows) {
        const int row_tiles = Rp - r0 >= 2 * kTileRows ? 2 : 1;
        const int64_t rows = std::min<int64_t>(row_tiles * kTileRows, R - r0);
        BlockInt8(xs + r0 * Kp, Kp, gate + s * strip_bytes, 0, row_tiles, sx + r0,
                  gate_scale + c0, cols, g, false, rows, kStrip, 0, r0 == 0);
        BlockInt8(xs + r0 * Kp, Kp, up + s * strip_bytes, 0, row_tiles, sx + r0, up_scale + c0,
                  cols, u, false, rows, kStrip, 0, r0 == 0);
        SwiGluBlock(g, u, rows, cols, y + r0 * N + c0, N);
      }
    }
  });
}

}  // namespace amx
}  // namespace jengine

#pragma GCC pop_options

#endif  // __x86_64__
#endif  // JENGINE_AMX_INT8_H_
