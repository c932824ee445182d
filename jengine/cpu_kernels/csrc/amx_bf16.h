// y[R, N] = x[R, K] @ w[K, N] on the AMX tiles for a bf16 weight packed once, at load time, into
// the tiles' layout (jengine.pallas_kernels.cpu_matmul.amx_tiles); x is bf16, or f32 holding
// bf16 values. The sums are f32 (TDPBF16PS), and so is y. Included by small_matmul.cc.
//
// Why: XLA:CPU runs a bf16 dot on the tiles too, but each dot on one thread, and a projection
// of a few rows on slower code still (docs/kernels.md, "AMX bf16 projections"). Here the output
// columns are split over XLA's intra-op pool, or for a call of one row tile over the caller and
// a spinning helper thread (spin_helper.h). The weight is packed once so that each call reads
// its tiles straight from memory: repacking the row-major weight on every call would read and
// write every weight byte again per call, in a step whose few-row calls only stream them.
//
// Blocking: each thread takes a contiguous run of strips of 32 output columns (two B tiles a k
// step, contiguous in the packed weight) and runs every block of 32 rows (two A tiles) against
// a strip while the strip is in cache (from kPanelRows rows, across a panel of strips while the
// panel is in L2), into four C tiles (tmm0-3; A in tmm4-5, B in tmm6-7), so each weight byte is
// read from memory once for all R rows. Rows are padded to 16 and k to 32 with zeros in a
// staged copy of x (bf16 x of a shape the tiles fit is read in place); the C tiles are stored
// straight into y, those that cross its last row or column through a small buffer. (Through a
// per-thread buffer of the thread's whole [R, columns] and a copy to y, a 512-row call took
// 1.15x as long: that buffer alone is 1.5 MB of a 2 MB L2.)

#ifndef JENGINE_AMX_BF16_H_
#define JENGINE_AMX_BF16_H_

#if defined(__x86_64__)

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "isa.h"
#include "parallel_for.h"
#include "spin_helper.h"

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,prfchw")

namespace jengine {
namespace amx {

constexpr int64_t kStrip = 32;     // output columns a thread computes at a time
// Calls of up to this many rows (one A tile) split their columns with the SpinHelper's thread
// instead of XLA's pool when the pool has two threads: they are short and stream the weight,
// so a pool thread's wake-up cost them most of the second core (spin_helper.h).
constexpr int64_t kHelperRows = 16;

// x [R, K] f32 -> bf16 [Rp, Kp] (round to nearest even; exact for bf16-valued x), zero-padded.
inline void StageRows(const float* x, int64_t R, int64_t K, int64_t Kp, uint16_t* out) {
  for (int64_t r = 0; r < R; ++r) {
    const float* src = x + r * K;
    uint16_t* dst = out + r * Kp;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + k));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k),
                          reinterpret_cast<const __m256i&>(h));
    }
    if (k < K) {
      const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + k));
      _mm256_mask_storeu_epi16(dst + k, m, reinterpret_cast<const __m256i&>(h));
    }
  }
}

// x [R, K] as the A tiles read it: bf16 [Rp, Kp] (R padded to 16, K to 32 with zeros), in place
// for bf16 x of a shape the tiles fit, else staged in `staged`.
inline const uint16_t* TileRows(const void* x, bool x_bf16, int64_t R, int64_t K, int64_t Kp,
                                std::vector<uint16_t>& staged) {
  const int64_t Rp = (R + kTileRows - 1) / kTileRows * kTileRows;
  const uint16_t* xs = static_cast<const uint16_t*>(x);
  if (x_bf16 && Rp == R && Kp == K) return xs;
  staged.assign(Rp * Kp, 0);
  if (x_bf16) {
    for (int64_t r = 0; r < R; ++r) std::memcpy(&staged[r * Kp], xs + r * K, K * 2);
  } else {
    StageRows(static_cast<const float*>(x), R, K, Kp, staged.data());
  }
  return staged.data();
}

// How far ahead of the tiles in use the first block of rows prefetches the packed weight (into
// L2). Measured with scripts/amx_matmul_bench.py: no difference at 1-64 rows, 512-row calls
// 0.93-0.98x the time without it; prefetching each thread's next strip, spread over the current
// strip's k steps, measured no better than this.
constexpr int64_t kPrefetchBytes = 4096;

// From kPanelRows rows on, a thread runs each block of rows across a panel of its strips holding
// up to kPanelBytes of the weight (in L2: 2 MB here) instead of each strip down all the rows.
// Why: a strip run down R rows stores each C tile row to another page of y ([R, N] f32, row
// stride N * 4 bytes), one 32-column strip of y at a time; across a panel, a block writes its
// 32 rows of y left to right. At 1,536 rows storing the sums had taken half of one thread's
// time. Below that the strip order stays: a panel's first block of rows streams the whole
// panel from memory with little arithmetic to hide it behind, which cost 64-256-row calls
// more than their stores gained (docs/kernels.md, "AMX bf16 projections").
constexpr int64_t kPanelRows = 1024;
constexpr int64_t kPanelBytes = 1 << 20;

// y's lines a block will store its sums to, requested for writing (PREFETCHW) this many per k
// step from its first, so that the stores at its end find them in cache rather than each
// waiting for its line: 0.91-1.02x the time of one thread's hot 512-row calls, 0.96-0.98x
// SmolLM2's projections at 64-512 rows (2, 4 and 8 lines measured alike). Calls of one block of
// rows (decode) write a few lines of y and are left as they were.
constexpr int64_t kSumLinesPerStep = 4;

// Where the C tile of rows [r, r + 16) and columns [c, c + 16) is stored: straight into y
// [R, N] (row stride N) where the tile lies inside it, else into `edge` (16 x 16, for
// CopyEdge), or nowhere (nullptr) where it lies past N (a strip's second half).
inline float* SumsAt(float* y, int64_t R, int64_t N, int64_t r, int64_t c, float* edge,
                     int64_t* stride_bytes) {
  if (c >= N) return nullptr;
  if (r + kTileRows <= R && c + 16 <= N) {
    *stride_bytes = N * 4;
    return y + r * N + c;
  }
  *stride_bytes = 64;
  return edge;
}

inline void CopyEdge(const float* edge, float* y, int64_t R, int64_t N, int64_t r, int64_t c) {
  const int64_t rows = std::min<int64_t>(kTileRows, R - r), cols = std::min<int64_t>(16, N - c);
  for (int64_t i = 0; i < rows; ++i) std::memcpy(y + (r + i) * N + c, edge + i * 16, cols * 4);
}

// The C tile of rows [r, r + 16) and columns [c, c + 16), stored in `edge`, rounded to bf16
// (nearest even, as XLA's convert) into a bf16 y [R, N].
inline void StoreBf16(const float* edge, uint16_t* y, int64_t R, int64_t N, int64_t r,
                      int64_t c) {
  const int64_t rows = std::min<int64_t>(kTileRows, R - r), cols = std::min<int64_t>(16, N - c);
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  for (int64_t i = 0; i < rows; ++i) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_load_ps(edge + i * 16));
    _mm256_mask_storeu_epi16(y + (r + i) * N + c, keep, reinterpret_cast<const __m256i&>(h));
  }
}

// _tile_stored takes the tile's number as a literal, hence a macro.
#define JE_STORE_SUMS(tile, r, c)                                  \
  do {                                                             \
    int64_t stride;                                                \
    if (y_bf16) {                                                  \
      if ((c) < N) {                                               \
        _tile_stored(tile, edge, 64);                              \
        StoreBf16(edge, yb, R, N, r, c);                           \
      }                                                            \
    } else if (float* at = SumsAt(yf, R, N, r, c, edge, &stride)) { \
      _tile_stored(tile, at, stride);                              \
      if (at == edge) CopyEdge(edge, yf, R, N, r, c);              \
    }                                                              \
  } while (0)

// y's rows [r0, r0 + 16 * row_tiles) and the 32 columns of one strip from c0: the strip's
// Kp / 32 k steps of two B tiles each (1 KiB a tile) against the staged x. y is f32, or bf16
// (`y_bf16`: the sums rounded, half the bytes to store).
inline void Block(const uint16_t* xs, int64_t Kp, const uint16_t* strip, int64_t r0,
                  int row_tiles, void* y, bool y_bf16, int64_t R, int64_t N, int64_t c0,
                  bool prefetch) {
  float* yf = static_cast<float*>(y);
  uint16_t* yb = static_cast<uint16_t*>(y);
  const int64_t lines_per_row = y_bf16 ? 1 : 2;  // 32 columns of sums
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t a_stride = Kp * 2;
  const int64_t sum_rows =  // y's rows to prefetch: none for a call of one block of rows
      R > 2 * kTileRows ? std::min<int64_t>(row_tiles * kTileRows, R - r0) : 0;
  const uint16_t* a0 = xs + r0 * Kp;
  const uint16_t* a1 = a0 + kTileRows * Kp;
  for (int64_t ks = 0; ks < Kp / kTileK; ++ks) {
    const uint16_t* b = strip + ks * 1024;
    if (prefetch) {  // the weight kPrefetchBytes ahead (the next strip's, past this one's end)
      const char* ahead = reinterpret_cast<const char*>(b) + kPrefetchBytes;
      for (int line = 0; line < 32; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T1);
    }
    for (int64_t line = ks * kSumLinesPerStep;
         line < (ks + 1) * kSumLinesPerStep && line < lines_per_row * sum_rows; ++line) {
      const int64_t row = r0 + line / lines_per_row, col = c0 + line % lines_per_row * 16;
      _m_prefetchw(y_bf16 ? static_cast<void*>(yb + row * N + col) : yf + row * N + col);
    }
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + 512, 64);
    _tile_loadd(4, a0 + ks * kTileK, a_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (row_tiles == 2) {
      _tile_loadd(5, a1 + ks * kTileK, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float edge[kTileRows * 16];
  JE_STORE_SUMS(0, r0, c0);
  JE_STORE_SUMS(1, r0, c0 + 16);
  if (row_tiles == 2) {
    JE_STORE_SUMS(2, r0 + kTileRows, c0);
    JE_STORE_SUMS(3, r0 + kTileRows, c0 + 16);
  }
}

#undef JE_STORE_SUMS

// Runs run(s0, s1) on the tiles (configured, released after) for each thread's contiguous run
// of the `strips` strips of 32 columns: over the pool's threads (at most `max_threads`), or for
// calls of up to kHelperRows rows on two threads over the caller and the SpinHelper's.
template <typename Run>
inline void ForStripRuns(xla::ffi::ThreadPool& pool, int32_t max_threads, int64_t R,
                         int64_t strips, Run run) {
  const int64_t threads = KernelThreads(pool, max_threads);
  const int64_t parts = std::min(threads, strips);
  auto part = [&](int64_t p) {
    Configure();
    run(p * strips / parts, (p + 1) * strips / parts);
    _tile_release();
  };
  if (threads == 2 && R <= kHelperRows) {
    SpinHelper::Get().Run(parts, [&](int64_t p, int64_t) { part(p); });
  } else {
    ParallelFor(pool, parts, parts, [&](int64_t p, int64_t) { part(p); });
  }
}

// y [R, N] = x [R, K] @ w, w given in the tiles' layout (`tiles` [S, Kp / 32, 2, 16, 32]
// bf16, S = ceil(N / 32): strip s, k step ks, half h holds the B tile whose word pair (p, c)
// is (w[32 ks + 2p][32 s + 16 h + c], w[32 ks + 2p + 1][...]), zeros past K and N; packed once
// at load time, cpu_matmul.amx_tiles). The strips are split over the pool's threads (at most
// `max_threads`; the SpinHelper's two for up to kHelperRows rows); each runs every block of
// 32 rows against a strip (or a panel of strips) while it is in cache, so each weight byte is
// read from memory once.
// x is f32 (bf16 values) or bf16 bits (`x_bf16`); bf16 rows whose shape fits the tiles (R a
// multiple of 16, K of 32) are read in place, others staged in a padded copy. y is f32 sums,
// or (`y_bf16`) those sums rounded to bf16: what a bf16 model's projection keeps, in half the
// bytes of stores, the larger part of a prefill-sized call's time.
inline void PackedMatmul(xla::ffi::ThreadPool& pool, int32_t max_threads, const void* x,
                         bool x_bf16, const uint16_t* tiles, void* y, bool y_bf16, int64_t R,
                         int64_t K, int64_t Kp, int64_t N) {
  const int64_t Rp = (R + kTileRows - 1) / kTileRows * kTileRows;
  std::vector<uint16_t> staged;
  const uint16_t* xs = TileRows(x, x_bf16, R, K, Kp, staged);
  const int64_t strips = (N + kStrip - 1) / kStrip;
  const int64_t strip_words = Kp / kTileK * 1024;
  const int64_t panel =  // strips
      Rp < kPanelRows ? 1 : std::max<int64_t>(1, kPanelBytes / (strip_words * 2));
  ForStripRuns(pool, max_threads, R, strips, [&](int64_t s0, int64_t s1) {
    for (int64_t p0 = s0; p0 < s1; p0 += panel) {
      const int64_t p1 = std::min(s1, p0 + panel);
      for (int64_t r0 = 0; r0 < Rp; r0 += 2 * kTileRows) {
        for (int64_t s = p0; s < p1; ++s) {
          Block(xs, Kp, tiles + s * strip_words, r0, Rp - r0 >= 2 * kTileRows ? 2 : 1, y,
                y_bf16, R, N, s * kStrip, r0 == 0);
        }
      }
    }
  });
}

}  // namespace amx
}  // namespace jengine

#pragma GCC pop_options

#endif  // __x86_64__
#endif  // JENGINE_AMX_BF16_H_
