// The W8A8 matmul for XLA:CPU, called through the XLA FFI:
//   y[R, N] = float(xq[R, K] @ w[K, N]) * sx[R] * sw[N]
// (or xq @ w^T for w [N, K], `transpose_w`: a tied int8 embedding as the output head), with
// int8 operands, exact int32 sums, and the f32 rescale in the order jengine.models.quant applies
// it, so the result equals XLA's int8 dot bit for bit.
//
// XLA:CPU's int8 dots already reach 300-600 GOP/s on large hot shapes of a 2-core Zen 5, near
// VPDPBUSD's ~1 zmm instruction per cycle per core there, so the kernel gains little on hot
// weights and more on weights streamed from DRAM (docs/kernels.md). It runs VPDPBUSD directly:
// it multiplies unsigned bytes by signed ones, so x is shifted to u8 (x + 128, a bit flip) and
// 128 * (column sum of w) is taken off again; the column sums come from the same instruction
// run on a vector of 128s.
// VPDPBUSD sums 4 consecutive k per 32-bit lane, so each block of 64 output columns is first
// packed into [K/4][64 columns][4 k] bytes (byte/word unpacks of four weight rows; a 16 x 16
// dword transpose for w^T), kept in L1/L2 while every row tile of 6 x 64 sums runs over it.
// Blocks are split over XLA's intra-op threads; with fewer blocks than 2 per thread the rows are
// split too (each part packs its block again, which costs one weight pass per part).
//
// The VNNI path needs AVX-512F/BW and AVX512_VNNI; elsewhere the portable loop runs (exact too,
// slow: jengine keeps XLA's dot there, see jengine.pallas_kernels.cpu_matmul).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"
#include "parallel_for.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jengine {
namespace {

enum Int8Isa : int32_t { kInt8Auto = 0, kInt8Portable = 1, kInt8Vnni = 4 };

bool Int8Supports(int32_t isa) {
#if JE_X86
  if (isa == kInt8Vnni) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
  }
#endif
  return isa == kInt8Portable;
}

int32_t Int8BestIsa() { return Int8Supports(kInt8Vnni) ? kInt8Vnni : kInt8Portable; }

struct Problem {
  const int8_t* x;   // [R, K]
  const float* sx;   // [R]
  const int8_t* w;   // [K, N], or [N, K] with transpose_w
  const float* sw;   // [N]
  float* y;          // [R, N]
  int64_t R, K, N;
  bool transpose_w;
};

// Columns [c0, c1) of rows [r0, r1), one int32 sum at a time.
void PortableBlock(const Problem& p, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t n = c0; n < c1; ++n) {
      int32_t acc = 0;
      for (int64_t k = 0; k < p.K; ++k) {
        const int8_t wv = p.transpose_w ? p.w[n * p.K + k] : p.w[k * p.N + n];
        acc += static_cast<int32_t>(p.x[r * p.K + k]) * wv;
      }
      p.y[r * p.N + n] = static_cast<float>(acc) * p.sx[r] * p.sw[n];
    }
  }
}

struct alignas(64) Line {  // one packed vector's bytes (std::vector<__m512i> drops the alignment)
  uint8_t bytes[64];
};

constexpr int64_t kBlock = 64;  // output columns per packed block: 4 vectors of 16 int32 sums

#if JE_X86
#define JE_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
constexpr int kRowTile = 6;     // 6 x 4 = 24 accumulators of 32 zmm registers

// acc += dot4(u8 a, s8 b) per 32-bit lane, in place: GCC 12's intrinsic copied each
// accumulator out and back (and to the stack) around every instruction of the tile loop.
JE_VNNI __attribute__((always_inline)) inline void Dpbusd(__m512i& acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

// Packs rows [k0, k1) of w[:, c0 : c0 + 64 * blocks] (clipped at N) into `blocks` blocks of
// 4 x groups vectors (packed[64-column block][k group][4 vectors]), groups = ceil((k1-k0)/4):
// vector i of k group g holds, in 32-bit lane l (128-bit lane j = l / 4), the 4 bytes
// w[k0 + 4g .. k0 + 4g + 3][c] of the block's column c = 16 j + 4 i + l % 4 (the unpacks work
// within 128-bit lanes; Finish undoes that order). Each weight row's run over the whole panel is
// read before the next row's, so the weight streams from memory in long contiguous runs
// (packing a 64-column block at a time read 64 bytes per row, strided: steps ran 1.1-1.8x
// slower once the weights came from DRAM, not cache). Missing rows and columns are zeros.
// corr[4 b + i] gains 128 * the column sums of vector i of block b.
JE_VNNI void PackKn(const int8_t* w, int64_t N, int64_t k0, int64_t k1, int64_t c0,
                    int64_t blocks, __m512i* packed, __m512i* corr) {
  const __m512i u128 = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t groups = (k1 - k0 + 3) / 4;
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t c = c0 + blk * kBlock, cols = std::min(kBlock, N - c);
      const __mmask64 mask = cols >= 64 ? ~0ULL : (1ULL << cols) - 1;
      __m512i r[4];
      for (int j = 0; j < 4; ++j) {
        const int64_t k = k0 + 4 * g + j;
        r[j] = k < k1 ? _mm512_maskz_loadu_epi8(mask, w + k * N + c) : _mm512_setzero_si512();
      }
      const __m512i a = _mm512_unpacklo_epi8(r[0], r[1]), b = _mm512_unpackhi_epi8(r[0], r[1]);
      const __m512i cc = _mm512_unpacklo_epi8(r[2], r[3]), d = _mm512_unpackhi_epi8(r[2], r[3]);
      __m512i* out = packed + blk * 4 * groups + 4 * g;
      out[0] = _mm512_unpacklo_epi16(a, cc);
      out[1] = _mm512_unpackhi_epi16(a, cc);
      out[2] = _mm512_unpacklo_epi16(b, d);
      out[3] = _mm512_unpackhi_epi16(b, d);
      __m512i* sums = corr + 4 * blk;
      for (int i = 0; i < 4; ++i) sums[i] = _mm512_dpbusd_epi32(sums[i], u128, out[i]);
    }
  }
}

// Packs rows c0 .. c0 + cols of w [N, K] (K % 4 == 0), all of k, so that vector i of k group g
// holds the 4 bytes w[c0 + 16 i + l][4g .. 4g + 3] in lane l: 16 x 16 dword transposes of 16
// weight rows (each read contiguously). corr[i] gains 128 * the column sums of vector i.
JE_VNNI void PackNk(const int8_t* w, int64_t K, int64_t c0, int64_t cols, __m512i* packed,
                    __m512i* corr) {
  const __m512i u128 = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t groups = K / 4;
  for (int i = 0; i < 4; ++i) {
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
      const int64_t gs = std::min<int64_t>(16, groups - g0);
      const __mmask16 gmask = gs >= 16 ? 0xFFFF : (1u << gs) - 1;
      __m512i t[16];
      for (int l = 0; l < 16; ++l) {
        const int64_t n = 16 * i + l;
        t[l] = n < cols ? _mm512_maskz_loadu_epi32(gmask, w + (c0 + n) * K + 4 * g0)
                        : _mm512_setzero_si512();
      }
      // 16 x 16 transpose of 32-bit elements: t[l][g] -> u[g][l].
      __m512i u[16];
      for (int l = 0; l < 16; l += 2) {
        u[l] = _mm512_unpacklo_epi32(t[l], t[l + 1]);
        u[l + 1] = _mm512_unpackhi_epi32(t[l], t[l + 1]);
      }
      for (int l = 0; l < 16; l += 4) {
        t[l] = _mm512_unpacklo_epi64(u[l], u[l + 2]);
        t[l + 1] = _mm512_unpackhi_epi64(u[l], u[l + 2]);
        t[l + 2] = _mm512_unpacklo_epi64(u[l + 1], u[l + 3]);
        t[l + 3] = _mm512_unpackhi_epi64(u[l + 1], u[l + 3]);
      }
      // t[4q + s] now holds, in 128-bit lane j, elements g = 4 j + s of rows 4 q .. 4 q + 3.
      for (int s = 0; s < 4; ++s) {
        const __m512i a = _mm512_shuffle_i32x4(t[s], t[4 + s], 0x88);  // lanes 0,2 | 0,2
        const __m512i b = _mm512_shuffle_i32x4(t[s], t[4 + s], 0xDD);  // lanes 1,3 | 1,3
        const __m512i c = _mm512_shuffle_i32x4(t[8 + s], t[12 + s], 0x88);
        const __m512i d = _mm512_shuffle_i32x4(t[8 + s], t[12 + s], 0xDD);
        u[s] = _mm512_shuffle_i32x4(a, c, 0x88);       // g = s      (lane 0 of each)
        u[8 + s] = _mm512_shuffle_i32x4(a, c, 0xDD);   // g = 8 + s  (lane 2)
        u[4 + s] = _mm512_shuffle_i32x4(b, d, 0x88);   // g = 4 + s  (lane 1)
        u[12 + s] = _mm512_shuffle_i32x4(b, d, 0xDD);  // g = 12 + s (lane 3)
      }
      for (int64_t g = 0; g < gs; ++g) {
        packed[4 * (g0 + g) + i] = u[g];
        corr[i] = _mm512_dpbusd_epi32(corr[i], u128, u[g]);
      }
    }
  }
}

// Rows [r, r + ROWS) times one packed block over `groups` k groups from group gk0 of xu: the
// 4 x ROWS int32 sums stay in registers (the loops unroll: ROWS and the 4 vectors are
// compile-time), starting from zero on the first k chunk, else from `sums` (row stride ld
// vectors), where they are left.
template <int ROWS>
JE_VNNI void Rows(const uint8_t* xu, int64_t ldx, int64_t gk0, int64_t groups,
                  const __m512i* packed, __m512i* sums, int64_t ld, bool first) {
  __m512i acc[ROWS][4];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      acc[r][i] = first ? _mm512_setzero_si512() : _mm512_load_si512(sums + r * ld + i);
    }
  }
  const uint8_t* x = xu + 4 * gk0;
  for (int64_t g = 0; g < groups; ++g) {
    const __m512i* pw = packed + 4 * g;
    const __m512i w0 = _mm512_load_si512(pw), w1 = _mm512_load_si512(pw + 1);
    const __m512i w2 = _mm512_load_si512(pw + 2), w3 = _mm512_load_si512(pw + 3);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      int32_t word;
      std::memcpy(&word, x + r * ldx + 4 * g, 4);
      const __m512i b = _mm512_set1_epi32(word);
      Dpbusd(acc[r][0], b, w0);
      Dpbusd(acc[r][1], b, w1);
      Dpbusd(acc[r][2], b, w2);
      Dpbusd(acc[r][3], b, w3);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) _mm512_store_si512(sums + r * ld + i, acc[r][i]);
  }
}

// Row r's sums of one block minus the correction, back in column order (kn), then either
// rescaled into y or, for a k part (`part`), stored as int32.
JE_VNNI void Finish(const Problem& p, const __m512i* sums, const __m512i* corr, int64_t r,
                    int64_t c, int32_t* part) {
  const int64_t cols = std::min(kBlock, p.N - c);
  __m512i v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm512_sub_epi32(_mm512_load_si512(sums + i), corr[i]);
  if (!p.transpose_w) {  // vector i, lane block j holds columns 16 j + 4 i + (0..3)
    const __m512i t0 = _mm512_shuffle_i32x4(v[0], v[1], 0x44);
    const __m512i t1 = _mm512_shuffle_i32x4(v[0], v[1], 0xEE);
    const __m512i t2 = _mm512_shuffle_i32x4(v[2], v[3], 0x44);
    const __m512i t3 = _mm512_shuffle_i32x4(v[2], v[3], 0xEE);
    v[0] = _mm512_shuffle_i32x4(t0, t2, 0x88);
    v[1] = _mm512_shuffle_i32x4(t0, t2, 0xDD);
    v[2] = _mm512_shuffle_i32x4(t1, t3, 0x88);
    v[3] = _mm512_shuffle_i32x4(t1, t3, 0xDD);
  }
  const __m512 s = _mm512_set1_ps(p.sx[r]);
  for (int i = 0; i < 4 && 16 * i < cols; ++i) {
    const int64_t left = cols - 16 * i;
    const __mmask16 mask = left >= 16 ? 0xFFFF : (1u << left) - 1;
    if (part != nullptr) {
      _mm512_mask_storeu_epi32(part + r * p.N + c + 16 * i, mask, v[i]);
      continue;
    }
    const __m512 scale = _mm512_maskz_loadu_ps(mask, p.sw + c + 16 * i);
    const __m512 out = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(v[i]), s), scale);
    _mm512_mask_storeu_ps(p.y + r * p.N + c + 16 * i, mask, out);
  }
}

// One task: rows [r0, r1) x blocks [b0, b1) x k [k0, k1). Panels of blocks are packed a k
// chunk at a time into L2-sized scratch (kn: the task's whole column range, k chunks of ~256
// KiB; w^T: all of k, as many blocks as fit), every row tile runs over each packed chunk, and
// the panel's sums are finished once its last chunk is in.
JE_VNNI void VnniTask(const Problem& p, const uint8_t* xu, int64_t ldx, int64_t r0, int64_t r1,
                      int64_t b0, int64_t b1, int64_t k0, int64_t k1, int32_t* part) {
  constexpr int64_t kScratch = 256 << 10;
  const int64_t nb = b1 - b0, rows = r1 - r0;
  int64_t pw, kc;
  if (p.transpose_w) {
    pw = std::max<int64_t>(1, std::min(nb, kScratch / (ldx * kBlock)));
    kc = k1 - k0;
  } else {
    pw = nb;
    kc = std::max<int64_t>(4, kScratch / (pw * kBlock) / 4 * 4);
  }
  const int64_t chunk_groups = (std::min(kc, k1 - k0) + 3) / 4;
  const int64_t ld = 4 * pw;  // sums: row stride in vectors
  thread_local std::vector<Line> scratch;
  const int64_t need = pw * 4 * chunk_groups + 4 * pw + rows * ld;
  if (static_cast<int64_t>(scratch.size()) < need) scratch.resize(need);
  __m512i* packed = reinterpret_cast<__m512i*>(scratch.data());
  __m512i* corr = packed + pw * 4 * chunk_groups;
  __m512i* sums = corr + 4 * pw;
  for (int64_t bp = b0; bp < b1; bp += pw) {
    const int64_t width = std::min(pw, b1 - bp);
    for (int64_t i = 0; i < 4 * width; ++i) corr[i] = _mm512_setzero_si512();
    for (int64_t kk = k0; kk < k1; kk += kc) {
      const int64_t ke = std::min(k1, kk + kc), groups = (ke - kk + 3) / 4;
      if (p.transpose_w) {
        for (int64_t blk = 0; blk < width; ++blk) {
          const int64_t c = (bp + blk) * kBlock;
          PackNk(p.w, p.K, c, std::min(kBlock, p.N - c), packed + blk * 4 * groups,
                 corr + 4 * blk);
        }
      } else {
        PackKn(p.w, p.N, kk, ke, bp * kBlock, width, packed, corr);
      }
      const bool first = kk == k0;
      for (int64_t blk = 0; blk < width; ++blk) {
        const __m512i* pk = packed + blk * 4 * groups;
        __m512i* sb = sums + 4 * blk;
        int64_t r = 0;
        for (; r + kRowTile <= rows; r += kRowTile) {
          Rows<kRowTile>(xu + (r0 + r) * ldx, ldx, kk / 4, groups, pk, sb + r * ld, ld, first);
        }
        const uint8_t* xr = xu + (r0 + r) * ldx;
        __m512i* sr = sb + r * ld;
        switch (rows - r) {
          case 5: Rows<5>(xr, ldx, kk / 4, groups, pk, sr, ld, first); break;
          case 4: Rows<4>(xr, ldx, kk / 4, groups, pk, sr, ld, first); break;
          case 3: Rows<3>(xr, ldx, kk / 4, groups, pk, sr, ld, first); break;
          case 2: Rows<2>(xr, ldx, kk / 4, groups, pk, sr, ld, first); break;
          case 1: Rows<1>(xr, ldx, kk / 4, groups, pk, sr, ld, first); break;
          default: break;
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t blk = 0; blk < width; ++blk) {
        Finish(p, sums + r * ld + 4 * blk, corr + 4 * blk, r0 + r, (bp + blk) * kBlock, part);
      }
    }
  }
}
#endif

// Up to this many rows a product is memory-bound: each thread streams a contiguous k range of
// the whole weight (kn) into int32 partial sums, added at the end, rather than a column range
// of every row (short strided runs, which the prefetchers stream worse).
constexpr int64_t kStreamRows = 16;

// The work is split into k_parts x col_parts x row_parts tasks: k for few rows (above); else
// contiguous ranges of 64-column blocks while there are two blocks per thread (or few rows),
// else rows (each row part then packs the same columns again: one more pass over the weight).
void Run(ffi::ThreadPool& pool, int32_t isa, int32_t max_threads, const Problem& p) {
  const int64_t threads = KernelThreads(pool, max_threads);
  const int64_t blocks = (p.N + kBlock - 1) / kBlock;
  const int64_t groups = (p.K + 3) / 4;
  int64_t k_parts = 1, col_parts = std::min(threads, blocks), row_parts = 1;
  if (!p.transpose_w && p.R <= kStreamRows && threads > 1 && p.K >= 64 * threads) {
    k_parts = threads;
    col_parts = 1;
  } else if (blocks < 2 * threads && p.R >= 12) {
    row_parts = std::min<int64_t>(threads, p.R / 6);
    col_parts = std::max<int64_t>(1, std::min(blocks, threads / row_parts));
  }
  const int64_t tasks = k_parts * col_parts * row_parts;
  auto task = [&](int64_t t, int64_t* b0, int64_t* b1, int64_t* r0, int64_t* r1, int64_t* k0,
                  int64_t* k1) {
    const int64_t kp = t / (col_parts * row_parts), cp = t / row_parts % col_parts;
    const int64_t rp = t % row_parts;
    *b0 = cp * blocks / col_parts;
    *b1 = (cp + 1) * blocks / col_parts;
    *r0 = rp * p.R / row_parts;
    *r1 = (rp + 1) * p.R / row_parts;
    *k0 = kp * groups / k_parts * 4;
    *k1 = std::min(p.K, (kp + 1) * groups / k_parts * 4);
  };
#if JE_X86
  if (isa == kInt8Vnni) {
    const int64_t ldx = groups * 4;
    std::vector<uint8_t> xu(p.R * ldx, 0);  // x + 128 as u8, rows padded to whole k groups
    for (int64_t r = 0; r < p.R; ++r) {
      for (int64_t k = 0; k < p.K; ++k) {
        xu[r * ldx + k] = static_cast<uint8_t>(p.x[r * p.K + k]) ^ 0x80;
      }
    }
    std::vector<int32_t> parts(k_parts > 1 ? k_parts * p.R * p.N : 0);
    ParallelFor(pool, tasks, tasks, [&](int64_t t, int64_t) {
      int64_t b0, b1, r0, r1, k0, k1;
      task(t, &b0, &b1, &r0, &r1, &k0, &k1);
      int32_t* part = k_parts > 1 ? parts.data() + t / (col_parts * row_parts) * p.R * p.N
                                  : nullptr;
      VnniTask(p, xu.data(), ldx, r0, r1, b0, b1, k0, k1, part);
    });
    if (k_parts > 1) {
      for (int64_t r = 0; r < p.R; ++r) {
        for (int64_t n = 0; n < p.N; ++n) {
          int32_t acc = 0;
          for (int64_t kp = 0; kp < k_parts; ++kp) acc += parts[(kp * p.R + r) * p.N + n];
          p.y[r * p.N + n] = static_cast<float>(acc) * p.sx[r] * p.sw[n];
        }
      }
    }
    return;
  }
#endif
  ParallelFor(pool, tasks, tasks, [&](int64_t t, int64_t) {
    int64_t b0, b1, r0, r1, k0, k1;
    task(t, &b0, &b1, &r0, &r1, &k0, &k1);
    if (k0 == 0) PortableBlock(p, r0, r1, b0 * kBlock, std::min(p.N, b1 * kBlock));
  });
}

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::AnyBuffer sx,
                      ffi::Buffer<ffi::S8> w, ffi::AnyBuffer sw, int32_t isa, int32_t transpose_w,
                      int32_t max_threads, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[transpose_w ? 1 : 0]) {
    return ffi::Error::InvalidArgument(
        "int8 matmul: expected x [R, K] and w [K, N] (or [N, K] with transpose_w)");
  }
  const int64_t R = xd[0], K = xd[1], N = wd[transpose_w ? 0 : 1];
  if (sx.element_type() != ffi::F32 || sw.element_type() != ffi::F32 ||
      static_cast<int64_t>(sx.element_count()) != R ||
      static_cast<int64_t>(sw.element_count()) != N) {
    return ffi::Error::InvalidArgument("int8 matmul: expected f32 scales of R and N elements");
  }
  if (transpose_w && K % 4 != 0) {
    return ffi::Error::InvalidArgument("int8 matmul: w^T needs K divisible by 4");
  }
  if (isa == kInt8Auto) isa = Int8BestIsa();
  if (!Int8Supports(isa)) {
    return ffi::Error::InvalidArgument("int8 matmul: the forced instruction set is unsupported");
  }
  float* out = y->typed_data();
  if (R == 0 || N == 0) return ffi::Error::Success();
  const Problem p{x.typed_data(), static_cast<const float*>(sx.untyped_data()), w.typed_data(),
                  static_cast<const float*>(sw.untyped_data()), out, R, K, N, transpose_w != 0};
  Run(pool, isa, max_threads, p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jengine

JE_EXPORT XLA_FFI_Error* JengineInt8Matmul(XLA_FFI_CallFrame* call_frame);
JE_EXPORT int JengineInt8MatmulIsa(int isa);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JengineInt8Matmul, jengine::Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()  // xq [R, K]
                                  .Arg<ffi::AnyBuffer>()        // sx: R f32 row scales
                                  .Arg<ffi::Buffer<ffi::S8>>()  // w [K, N] or [N, K]
                                  .Arg<ffi::AnyBuffer>()        // sw: N f32 channel scales
                                  .Attr<int32_t>("isa")
                                  .Attr<int32_t>("transpose_w")
                                  .Attr<int32_t>("max_threads")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [R, N]

// isa 0: the instruction set `auto` picks here (1 portable, 4 AVX-512 VNNI); else whether that
// one runs here (1 or 0).
extern "C" int JengineInt8MatmulIsa(int isa) {
  if (isa == jengine::kInt8Auto) return jengine::Int8BestIsa();
  return jengine::Int8Supports(isa) ? 1 : 0;
}

JE_FFI_TARGET("jengine_int8_matmul", JengineInt8Matmul);
JE_ISAS("int8_matmul", JengineInt8MatmulIsa,
        {{"auto", jengine::kInt8Auto}, {"portable", jengine::kInt8Portable},
         {"avx512_vnni", jengine::kInt8Vnni}});
