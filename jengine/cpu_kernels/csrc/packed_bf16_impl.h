// The body of the packed-bf16 GEMM without AMX (packed_bf16.cc), compiled once per instruction
// set: JE_SIMD 3 AVX-512-BF16 (VDPBF16PS on the weight's k pairs), 2 AVX-512F and 1 AVX2+FMA
// (each pair widened to two f32 vectors, f32 FMA), 0 portable C++. No include guard: included
// once per namespace.
//
// The weight is the AMX tiles' layout (amx_bf16.h; cpu_matmul.amx_tiles): strip s of 32 columns,
// k step ks of 32, half h of 16 columns, row p = 16 (k pair, column) word pairs, i.e. 64 bytes
// holding w[32 ks + 2p, c] and w[32 ks + 2p + 1, c] side by side for 16 columns c. That row is
// exactly VDPBF16PS's second operand for one k pair, so the AMX and the AVX-512-BF16 paths read
// one packed form. x is staged once per call as `XElem` [R, Kp] (zeros past K): bf16 for
// VDPBF16PS, whose k pair is then one 32-bit word to broadcast; f32 (the bf16 values widened)
// for the FMA paths, so that each of their broadcasts is a load (vbroadcastss m32) and not a
// shuffle on the FMA ports. A block is kRows rows x one strip.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

constexpr int64_t kRows = JE_SIMD >= 2 ? 8 : (JE_SIMD == 1 ? 3 : 4);  // rows a block holds

#if JE_SIMD == 3
using XElem = uint16_t;  // x staged as bf16
#else
using XElem = float;  // x staged as f32 (bf16 values)
#endif

inline int32_t PairWord(const uint16_t* x) {  // x[0], x[1] as one 32-bit word
  int32_t v;
  std::memcpy(&v, x, 4);
  return v;
}

#if JE_SIMD >= 2
using Acc = __m512;  // 16 columns of sums
constexpr int kAccs = 2;  // vectors of sums a row holds for a strip (32 columns)

// acc[r][h] += x[r, pair kp] . w[pair kp, 16 h + (0..15)] for the kp'th pair of the k step at b.
template <int64_t R>
inline void PairStep(const XElem* xs, int64_t Kp, int64_t kp, const uint16_t* b,
                     Acc (&acc)[kRows][kAccs]) {
  const __m512i w0 = _mm512_loadu_si512(b);
  const __m512i w1 = _mm512_loadu_si512(b + 512);
#if JE_SIMD == 3
  for (int64_t r = 0; r < R; ++r) {
    const __m512i a = _mm512_set1_epi32(PairWord(xs + r * Kp + 2 * kp));
    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)a, (__m512bh)w0);
    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)a, (__m512bh)w1);
  }
#else
  const __m512i hi = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16));
  const __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(w0, hi));
  const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16));
  const __m512 o1 = _mm512_castsi512_ps(_mm512_and_si512(w1, hi));
  for (int64_t r = 0; r < R; ++r) {
    const __m512 xe = _mm512_set1_ps(xs[r * Kp + 2 * kp]);
    const __m512 xo = _mm512_set1_ps(xs[r * Kp + 2 * kp + 1]);
    acc[r][0] = _mm512_fmadd_ps(xo, o0, _mm512_fmadd_ps(xe, e0, acc[r][0]));
    acc[r][1] = _mm512_fmadd_ps(xo, o1, _mm512_fmadd_ps(xe, e1, acc[r][1]));
  }
#endif
}

inline void StoreAcc(const Acc& a, float* out) { _mm512_storeu_ps(out, a); }
inline Acc LoadAcc(const float* in) { return _mm512_loadu_ps(in); }

// v rounded to bf16 (nearest even; no NaN here: sums of finite bf16 products), back in f32.
inline __m512 RoundedBf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(
      static_cast<int32_t>(0xffff0000u))));
}

// 16 f32 rounded to bf16 and stored (the first `cols`, at most 16).
inline void StoreBf16(__m512 v, int64_t cols, uint16_t* out) {
  const __m256i h = _mm512_cvtepi32_epi16(
      _mm512_srli_epi32(_mm512_castps_si512(RoundedBf16(v)), 16));
  if (cols == 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), h);
  } else {
    alignas(32) uint16_t tmp[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), h);
    std::memcpy(out, tmp, cols * 2);
  }
}
inline Acc ZeroAcc() { return _mm512_setzero_ps(); }
constexpr int kAccCols = 16;
#elif JE_SIMD == 1
using Acc = __m256;  // 8 columns of sums
constexpr int kAccs = 4;

// One weight vector at a time (its even and odd halves widened), every row's broadcasts loaded
// again for each: 12 sums + 2 weight halves + the broadcasts fit AVX2's 16 registers, where
// holding all four vectors' halves (8) spilled.
template <int64_t R>
inline void PairStep(const XElem* xs, int64_t Kp, int64_t kp, const uint16_t* b,
                     Acc (&acc)[kRows][kAccs]) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int v = 0; v < kAccs; ++v) {  // 8 pairs a vector; halves 512 words apart
    const __m256i w = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(b + (v / 2) * 512 + (v % 2) * 16));
    const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    const __m256 o = _mm256_castsi256_ps(_mm256_and_si256(w, hi));
    for (int64_t r = 0; r < R; ++r) {
      const __m256 xe = _mm256_broadcast_ss(xs + r * Kp + 2 * kp);
      const __m256 xo = _mm256_broadcast_ss(xs + r * Kp + 2 * kp + 1);
      acc[r][v] = _mm256_fmadd_ps(xo, o, _mm256_fmadd_ps(xe, e, acc[r][v]));
    }
  }
}

inline void StoreAcc(const Acc& a, float* out) { _mm256_storeu_ps(out, a); }
inline Acc LoadAcc(const float* in) { return _mm256_loadu_ps(in); }
inline Acc ZeroAcc() { return _mm256_setzero_ps(); }

// v rounded to bf16 (nearest even; no NaN here), back in f32: RoundedBf16's 8-wide twin.
inline __m256 RoundedBf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(
      static_cast<int32_t>(0xffff0000u))));
}
constexpr int kAccCols = 8;
#else
struct Acc {
  float v[32];
};
constexpr int kAccs = 1;

template <int64_t R>
inline void PairStep(const XElem* xs, int64_t Kp, int64_t kp, const uint16_t* b,
                     Acc (&acc)[kRows][kAccs]) {
  for (int64_t r = 0; r < R; ++r) {
    const float xe = xs[r * Kp + 2 * kp], xo = xs[r * Kp + 2 * kp + 1];
    for (int c = 0; c < 32; ++c) {
      const uint16_t* pair = b + (c / 16) * 512 + (c % 16) * 2;
      acc[r][0].v[c] += xe * Bf16ToF32(pair[0]) + xo * Bf16ToF32(pair[1]);
    }
  }
}

inline void StoreAcc(const Acc& a, float* out) { std::memcpy(out, a.v, sizeof(a.v)); }
inline Acc LoadAcc(const float* in) {
  Acc a;
  std::memcpy(a.v, in, sizeof(a.v));
  return a;
}
inline Acc ZeroAcc() { return Acc{}; }
constexpr int kAccCols = 32;
#endif

// The f32 sums [R, 32] of rows xs[0..R) ([R, Kp]) against k steps [ks0, ks1) of one strip
// (1024 words a step), added to `sums` (row stride 32), or written there when `first`: a sum
// leaves the registers between chunks exactly as it stood, so chunking does not change a bit.
template <int64_t R>
inline void BlockSums(const XElem* xs, int64_t Kp, const uint16_t* strip, int64_t ks0,
                      int64_t ks1, bool first, float* sums) {
  Acc acc[kRows][kAccs];
  for (int64_t r = 0; r < R; ++r) {
    for (int v = 0; v < kAccs; ++v) {
      acc[r][v] = first ? ZeroAcc() : LoadAcc(sums + r * 32 + v * kAccCols);
    }
  }
  for (int64_t ks = ks0; ks < ks1; ++ks) {
    const uint16_t* step = strip + ks * 1024;
    for (int64_t p = 0; p < 16; ++p) PairStep<R>(xs, Kp, ks * 16 + p, step + p * 32, acc);
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int v = 0; v < kAccs; ++v) StoreAcc(acc[r][v], sums + r * 32 + v * kAccCols);
  }
}

inline void BlockSumsAny(int64_t rows, const XElem* xs, int64_t Kp, const uint16_t* strip,
                         int64_t ks0, int64_t ks1, bool first, float* sums) {
  switch (rows) {
#define JE_ROWS_CASE(n) \
  case n:               \
    if constexpr (n <= kRows) BlockSums<n>(xs, Kp, strip, ks0, ks1, first, sums); \
    break;
    JE_ROWS_CASE(1) JE_ROWS_CASE(2) JE_ROWS_CASE(3) JE_ROWS_CASE(4)
    JE_ROWS_CASE(5) JE_ROWS_CASE(6) JE_ROWS_CASE(7) JE_ROWS_CASE(8)
#undef JE_ROWS_CASE
    default:
      break;
  }
}

// act[c] = round(round(silu(round(gate[c]))) * round(up[c])) for c < cols, each round to bf16
// (nearest even), as amx_swiglu.h rounds; the sigmoid vectorized on AVX-512F and AVX2 (a scalar
// std::exp per element cost a 1,500-token prompt ~69 M calls).
inline void Activation(const float* gate, const float* up, int64_t cols, uint16_t* out) {
  int64_t c = 0;
#if JE_SIMD >= 2
  for (; c + 16 <= cols; c += 16) {
    const __m512 g = RoundedBf16(_mm512_loadu_ps(gate + c));
    // e^-g = 2^t, t = n + f: 2^f = e^(f ln 2) by its degree-7 Taylor polynomial, n by vscalefps
    // (inf past the range: the sigmoid 0)
    const __m512 t = _mm512_mul_ps(g, _mm512_set1_ps(-1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 y = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718f));
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    for (float k : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) {
      p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(k));
    }
    const __m512 e = _mm512_scalef_ps(p, n);
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    const __m512 u = RoundedBf16(_mm512_loadu_ps(up + c));
    StoreBf16(_mm512_mul_ps(RoundedBf16(s), u), 16, out + c);
  }
#elif JE_SIMD == 1
  // The same polynomial; 2^n from its exponent bits (no vscalefps on AVX2), t clamped to
  // +-126 so they stay normal: past that the sigmoid is 0 or 1 to far below bf16's precision.
  for (; c + 8 <= cols; c += 8) {
    const __m256 g = RoundedBf16x8(_mm256_loadu_ps(gate + c));
    const __m256 t = _mm256_max_ps(_mm256_set1_ps(-126.0f), _mm256_min_ps(
        _mm256_set1_ps(126.0f), _mm256_mul_ps(g, _mm256_set1_ps(-1.44269504f))));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 y = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.69314718f));
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    for (float k : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) {
      p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(k));
    }
    const __m256i two_n = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    const __m256 u = RoundedBf16x8(_mm256_loadu_ps(up + c));
    const __m256i bits = _mm256_srli_epi32(
        _mm256_castps_si256(RoundedBf16x8(_mm256_mul_ps(RoundedBf16x8(s), u))), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c),
                     _mm_packus_epi32(_mm256_castsi256_si128(bits),
                                      _mm256_extracti128_si256(bits, 1)));
  }
#endif
  for (; c < cols; ++c) {
    const float g = Bf16ToF32(F32ToBf16(gate[c]));
    const float a = Bf16ToF32(F32ToBf16(g / (1.0f + std::exp(-g))));
    out[c] = F32ToBf16(a * Bf16ToF32(F32ToBf16(up[c])));
  }
}

// y [R, N] (f32, or bf16 when y_bf16) for the strips [s0, s1): for each panel of kPanelRows
// rows and each strip, each chunk of kChunkSteps k steps of the strip runs every block of
// kRows rows of the panel, the panel's sums waiting in `sums` between chunks. Chunks of 8 k
// steps (16 KB, in L1 where a K = 1536 strip's 96 KB is not) measured no faster than whole
// strips on the Xeon (0.86-1.1x, a loaded machine), so a chunk is the whole strip. With `up_strips` (SwiGLU), silu(x @ gate) * (x @ up) rounded
// as amx_swiglu.h rounds, into bf16 y.
inline void Strips(const void* x, int64_t R, int64_t Kp, const uint16_t* strips,
                   const uint16_t* up_strips, int64_t s0, int64_t s1, int64_t N, void* y,
                   bool y_bf16) {
  constexpr int64_t kPanelRows = 64;
  constexpr int64_t kChunkSteps = 1 << 20;  // k steps a chunk
  const auto* xs = static_cast<const XElem*>(x);
  const int64_t steps = Kp / 32, strip_words = steps * 1024;
  alignas(64) float sums[kPanelRows * 32];
  alignas(64) float up[kPanelRows * 32];
  for (int64_t p0 = 0; p0 < R; p0 += kPanelRows) {
    const int64_t p1 = std::min(R, p0 + kPanelRows);
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t c0 = s * 32, cols = std::min<int64_t>(32, N - c0);
      for (int64_t ks0 = 0; ks0 < steps; ks0 += kChunkSteps) {
        const int64_t ks1 = std::min(steps, ks0 + kChunkSteps);
        for (int64_t r0 = p0; r0 < p1; r0 += kRows) {
          const int64_t rows = std::min(kRows, p1 - r0);
          float* block = sums + (r0 - p0) * 32;
          BlockSumsAny(rows, xs + r0 * Kp, Kp, strips + s * strip_words, ks0, ks1, ks0 == 0,
                       block);
          if (up_strips != nullptr) {
            BlockSumsAny(rows, xs + r0 * Kp, Kp, up_strips + s * strip_words, ks0, ks1,
                         ks0 == 0, up + (r0 - p0) * 32);
          }
        }
      }
      for (int64_t r = p0; r < p1; ++r) {
        const float* g = sums + (r - p0) * 32;
        if (up_strips != nullptr) {
          Activation(g, up + (r - p0) * 32, cols, static_cast<uint16_t*>(y) + r * N + c0);
        } else if (y_bf16) {
          uint16_t* out = static_cast<uint16_t*>(y) + r * N + c0;
          int64_t c = 0;
#if JE_SIMD >= 2
          for (; c < cols; c += 16) {
            StoreBf16(_mm512_loadu_ps(g + c), std::min<int64_t>(16, cols - c), out + c);
          }
#endif
          for (; c < cols; ++c) out[c] = F32ToBf16(g[c]);
        } else {
          std::memcpy(static_cast<float*>(y) + r * N + c0, g, cols * 4);
        }
      }
    }
  }
}
