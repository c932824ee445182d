// act [R, N] = silu(x @ w_gate) * (x @ w_up) for a bf16 model, both weights packed for the AMX
// tiles (amx_bf16.h): each block of 32 rows x 32 columns runs the gate's and the up strip's
// products into an L1 buffer each, and the activation is applied there, so neither product goes
// to memory. Included by small_matmul.cc after amx_bf16.h.
//
// Why: as two projections and an XLA elementwise pass, a 512-token chunk wrote both products
// ([512, 1536] each) to memory and read them back for the activation: 0.5-0.6 ms a layer in
// that pass alone, besides the stores (docs/kernels.md, "AMX bf16 projections").
//
// Rounding as the unfused model rounds: each product to bf16, the activation in f32 on the
// rounded gate and rounded once, its product with the rounded up rounded (what XLA does for
// `silu(gate.astype(f32)).astype(bf16) * up`); the sigmoid's exp here and XLA's may differ by
// an f32 ulp, which can move an activation by one bf16 ulp where it sits on a rounding edge.

#ifndef JENGINE_AMX_SWIGLU_H_
#define JENGINE_AMX_SWIGLU_H_

#if defined(__x86_64__)

#include "amx_bf16.h"

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,prfchw")

namespace jengine {
namespace amx {

inline __m512 RoundToBf16(__m512 v) {  // nearest even, back to f32
  const __m256bh h = _mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(h)), 16));
}

// 1 / (1 + e^-g): e^-g = 2^t, t = n + f (|f| <= 1/2), 2^f by its degree-7 Taylor polynomial
// (error ~5e-9, under an f32 ulp) and vscalefps for 2^n (inf past the range: sigmoid 0).
inline __m512 Sigmoid(__m512 g) {
  const __m512 t = _mm512_mul_ps(g, _mm512_set1_ps(-1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5252733804e-5f);  // ln(2)^k / k!, k = 7 .. 0
  for (float c : {1.5403530393e-4f, 1.3333558146e-3f, 9.6181291076e-3f, 5.5504108665e-2f,
                  2.4022650696e-1f, 6.9314718056e-1f, 1.0f}) {
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  }
  const __m512 e = _mm512_scalef_ps(p, n);
  return _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// y [rows, cols] (row stride N) = the activation of the block's sums g and u ([32, 32] f32).
inline void SwiGluBlock(const float* g, const float* u, int64_t rows, int64_t cols, uint16_t* y,
                        int64_t N) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < cols; c += 16) {
      const int64_t n = std::min<int64_t>(16, cols - c);
      const __m512 gate = RoundToBf16(_mm512_load_ps(g + i * kStrip + c));
      const __m512 up = RoundToBf16(_mm512_load_ps(u + i * kStrip + c));
      const __m512 act = RoundToBf16(_mm512_mul_ps(gate, Sigmoid(gate)));
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_mul_ps(act, up));
      _mm256_mask_storeu_epi16(y + i * N + c, static_cast<__mmask16>((1u << n) - 1),
                               reinterpret_cast<const __m256i&>(out));
    }
  }
}

// y [R, N] bf16 = silu(x @ w_gate) * (x @ w_up), both weights in the tiles' layout (as
// PackedMatmul takes them, of the same [K, N]); threads split the strips as PackedMatmul does.
inline void PackedSwiGlu(xla::ffi::ThreadPool& pool, int32_t max_threads, const void* x,
                         bool x_bf16, const uint16_t* gate, const uint16_t* up, uint16_t* y,
                         int64_t R, int64_t K, int64_t Kp, int64_t N) {
  const int64_t Rp = (R + kTileRows - 1) / kTileRows * kTileRows;
  std::vector<uint16_t> staged;
  const uint16_t* xs = TileRows(x, x_bf16, R, K, Kp, staged);
  const int64_t strips = (N + kStrip - 1) / kStrip;
  const int64_t strip_words = Kp / kTileK * 1024;
  ForStripRuns(pool, max_threads, R, strips, [&](int64_t s0, int64_t s1) {
    alignas(64) float g[2 * kTileRows * kStrip], u[2 * kTileRows * kStrip];
    for (int64_t s = s0; s < s1; ++s) {
      for (int64_t r0 = 0; r0 < Rp; r0 += 2 * kTileRows) {
        const int row_tiles = Rp - r0 >= 2 * kTileRows ? 2 : 1;
        const int64_t rows = row_tiles * kTileRows;  // the block's sums land in g and u whole
        Block(xs + r0 * Kp, Kp, gate + s * strip_words, 0, row_tiles, g, false, rows, kStrip,
              0, r0 == 0);
        Block(xs + r0 * Kp, Kp, up + s * strip_words, 0, row_tiles, u, false, rows, kStrip, 0,
              r0 == 0);
        SwiGluBlock(g, u, std::min(rows, R - r0), std::min(kStrip, N - s * kStrip),
                    y + r0 * N + s * kStrip, N);
      }
    }
  });
}

}  // namespace amx
}  // namespace jengine

#pragma GCC pop_options

#endif  // __x86_64__
#endif  // JENGINE_AMX_SWIGLU_H_
