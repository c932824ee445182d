// One instruction set's body of the W4A16 matmul (included by w4_matmul.cc inside the namespaces
// portable / avx2 / avx512, with JE_SIMD 0 / 1 / 2 and the matching target pragma).
//
// y[R, N] = x[R, K] @ w[K, N] for a 4-bit weight w[k, n] = s[g, n] * q[k, n] + m[g, n], g = k / 32,
// q in 0..15, stored tile-major (w4_matmul.cc): per tile of kW4Cols columns and group of 32 k,
// 4 x 4 runs of 64 bytes, run (v, p) byte 4 l + b holding, for column 16 v + l, q[32 g + 4 p + b]
// (low nibble) and q[32 g + 16 + 4 p + b] (high). Per group the sums over its 32 k of x * q
// stay in registers, then y += s * partial + m * sum_k x (the row's group sums, given).

#if JE_SIMD == 2
using Vec = __m512;
constexpr int64_t kLanes = 16;
constexpr int kRows = 3;  // 3 rows x 4 vectors x (sums + partials) = 24 of 32 zmm registers
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec Broadcast(float f) { return _mm512_set1_ps(f); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
// Byte `b` of each of 16 32-bit lanes at p -> its low and its high nibble, as float32.
inline void Nibbles(const uint8_t* p, int b, Vec& lo, Vec& hi) {
  const __m512i w = _mm512_srl_epi32(_mm512_loadu_si512(p), _mm_cvtsi32_si128(8 * b));
  const __m512i f = _mm512_set1_epi32(15);
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(w, f));
  hi = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, 4), f));
}
#elif JE_SIMD == 1
using Vec = __m256;
constexpr int64_t kLanes = 8;
constexpr int kRows = 1;  // 4 sums + 4 partials + 2 nibble vectors + 2 broadcasts of 16 ymm
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec Broadcast(float f) { return _mm256_set1_ps(f); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void Nibbles(const uint8_t* p, int b, Vec& lo, Vec& hi) {
  const __m256i w = _mm256_srl_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                                     _mm_cvtsi32_si128(8 * b));
  const __m256i f = _mm256_set1_epi32(15);
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(w, f));
  hi = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, 4), f));
}
#else
struct Vec {
  float v[8];
};
constexpr int64_t kLanes = 8;
constexpr int kRows = 2;
inline Vec Zero() { return Vec{}; }
inline Vec Load(const float* p) {
  Vec r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline void Store(float* p, Vec v) { std::memcpy(p, v.v, sizeof(v.v)); }
inline Vec Broadcast(float f) {
  Vec r;
  for (float& e : r.v) e = f;
  return r;
}
inline Vec Fma(Vec a, Vec b, Vec c) {
  for (int i = 0; i < 8; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline void Nibbles(const uint8_t* p, int b, Vec& lo, Vec& hi) {
  for (int i = 0; i < 8; ++i) {
    lo.v[i] = static_cast<float>(p[4 * i + b] & 15);
    hi.v[i] = static_cast<float>(p[4 * i + b] >> 4);
  }
}
#endif

constexpr int64_t kVecs = 4;  // vectors of columns per chunk of a tile
constexpr int64_t kChunk = kVecs * kLanes;

// Rows [0, RB) of x (stride K; xs their group sums, stride G) against the chunk of kChunk
// columns at `col` of tile `t`: out[r * ldo + c] for the chunk's columns.
template <int RB>
void Chunk(const float* x, const float* xs, const uint8_t* q, const float* s, const float* m,
           int64_t K, int64_t G, int64_t col, float* out, int64_t ldo) {
  Vec acc[RB][kVecs];
  for (int r = 0; r < RB; ++r) {
    for (int v = 0; v < kVecs; ++v) acc[r][v] = Zero();
  }
  for (int64_t g = 0; g < G; ++g) {
    Vec part[RB][kVecs];
    for (int r = 0; r < RB; ++r) {
      for (int v = 0; v < kVecs; ++v) part[r][v] = Zero();
    }
    const uint8_t* qg = q + g * 16 * kW4Cols;
    const float* xg = x + g * 32;
#pragma GCC unroll 4
    for (int pb = 0; pb < 16; ++pb) {  // run p, byte b: k = 4 p + b and 16 + 4 p + b
      const int p = pb / 4, b = pb % 4;
      Vec b0[RB], b1[RB];
      for (int r = 0; r < RB; ++r) {
        b0[r] = Broadcast(xg[r * K + pb]);
        b1[r] = Broadcast(xg[r * K + 16 + pb]);
      }
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) {
        const int64_t c = col + v * kLanes;  // the vector's first column in the tile
        Vec lo, hi;
        Nibbles(qg + (c / 16) * 256 + p * 64 + (c % 16) * 4, b, lo, hi);
        for (int r = 0; r < RB; ++r) {
          part[r][v] = Fma(b0[r], lo, part[r][v]);
          part[r][v] = Fma(b1[r], hi, part[r][v]);
        }
      }
    }
    const float* sg = s + g * kW4Cols + col;
    const float* mg = m + g * kW4Cols + col;
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) {
      const Vec sv = Load(sg + v * kLanes), mv = Load(mg + v * kLanes);
      for (int r = 0; r < RB; ++r) {
        acc[r][v] = Fma(sv, part[r][v], acc[r][v]);
        acc[r][v] = Fma(mv, Broadcast(xs[r * G + g]), acc[r][v]);
      }
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int v = 0; v < kVecs; ++v) Store(out + r * ldo + v * kLanes, acc[r][v]);
  }
}

using ChunkFn = void (*)(const float*, const float*, const uint8_t*, const float*, const float*,
                        int64_t, int64_t, int64_t, float*, int64_t);

// The chunk body for `rows` (at most kRows) rows at once.
inline ChunkFn PickChunk(int rows) {
  if constexpr (kRows >= 3) {
    if (rows >= 3) return &Chunk<3>;
  }
  if constexpr (kRows >= 2) {
    if (rows >= 2) return &Chunk<2>;
  }
  return &Chunk<1>;
}

// Tiles [t0, t1) of y[R, N]: q points at the weight's first tile [G, 16, kW4Cols] bytes, s and m
// at its first [G, kW4Cols] floats. A ragged last tile is computed into a scratch row block.
inline void Tiles(const float* x, const float* xs, const uint8_t* q, const float* s,
                  const float* m, float* y, int64_t R, int64_t K, int64_t N, int64_t t0,
                  int64_t t1) {
  const int64_t G = K / 32;
  float scratch[kRows * kW4Cols];
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* qt = q + t * G * 16 * kW4Cols;
    const float* st = s + t * G * kW4Cols;
    const float* mt = m + t * G * kW4Cols;
    const int64_t width = std::min<int64_t>(kW4Cols, N - t * kW4Cols);
    for (int64_t r0 = 0; r0 < R;) {
      const int step = static_cast<int>(std::min<int64_t>(kRows, R - r0));
      const ChunkFn chunk = PickChunk(step);
      const bool ragged = width < kW4Cols;
      float* out = ragged ? scratch : y + r0 * N + t * kW4Cols;
      const int64_t ldo = ragged ? kW4Cols : N;
      for (int64_t col = 0; col < kW4Cols; col += kChunk) {
        if (!ragged && col >= width) break;
        chunk(x + r0 * K, xs + r0 * G, qt, st, mt, K, G, col, out + col, ldo);
      }
      if (ragged) {
        for (int r = 0; r < step; ++r) {
          std::copy(scratch + r * kW4Cols, scratch + r * kW4Cols + width,
                    y + (r0 + r) * N + t * kW4Cols);
        }
      }
      r0 += step;
    }
  }
}
