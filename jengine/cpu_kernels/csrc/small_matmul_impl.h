// One instruction set's body of the small-row matmul (included by small_matmul.cc inside the
// namespaces portable / avx2 / avx512, with JE_SIMD 0 / 1 / 2 and the matching target pragma).
//
// y[R, N] = x[R, K] @ w[K, N], w row-major, x and y float32. The weight's element type W is a
// template parameter: float, Bf16 (bfloat16 bits) or int8_t (a per-channel int8 weight whose
// scale the caller applies to y); LoadW widens a vector of W to float32 in registers, so a
// narrower weight is fewer bytes streamed from memory at the same arithmetic.
// Up to kStreamRows rows stream w (StreamRows: 4 with AVX-512's 32 registers, else 2).
// Beyond, a thread's columns are taken a k-block (~64 KiB) at a time; each tile of kTile
// columns (two vectors) keeps its R x kTile sums in registers while k runs over the block,
// so each weight is loaded once per group of up to kMaxRows rows and broadcast-multiplied into
// every row of the group. While a block is computed, the next one is prefetched into L2 row by
// row (contiguous runs, which the memory system streams well; the tiles' own column-strided
// loads would not). Rows beyond kMaxRows form further groups of
// near-equal size (they re-read the block from L2, not memory).

#if JE_SIMD == 2
using Vec = __m512;
constexpr int64_t kLanes = 16;
constexpr int kMaxRows = 12;  // 24 accumulators + 2 weight vectors of 32 zmm registers
constexpr int kStreamRows = 4;  // StreamRows<4>: 16 broadcasts + 4 weight vectors + 1 sum
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec Broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float Sum(Vec v) { return _mm512_reduce_add_ps(v); }
constexpr int kNtRows = 6;  // transposed tiles: 4 weight rows x 6 x-rows = 24 accumulators
inline Vec LoadW(const float* p) { return Load(p); }
inline Vec LoadW(const Bf16* p) {  // 16 bf16 -> f32: the bits are the f32's upper half
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
inline Vec LoadW(const int8_t* p) {  // 16 int8 -> f32 (exact)
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif JE_SIMD == 1
using Vec = __m256;
constexpr int64_t kLanes = 8;
constexpr int kMaxRows = 6;  // 12 accumulators + 2 weight vectors + 1 broadcast of 16 ymm
constexpr int kStreamRows = 2;  // StreamRows<2>: 8 broadcasts + 4 weight vectors + 1 sum
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec Broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float Sum(Vec v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
constexpr int kNtRows = 3;  // transposed tiles: 4 weight rows x 3 x-rows = 12 accumulators
inline Vec LoadW(const float* p) { return Load(p); }
inline Vec LoadW(const Bf16* p) {  // 8 bf16 -> f32: the bits are the f32's upper half
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
inline Vec LoadW(const int8_t* p) {  // 8 int8 -> f32 (exact)
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#else
struct Vec {
  float v[8];
};
constexpr int64_t kLanes = 8;
constexpr int kMaxRows = 4;
constexpr int kStreamRows = 2;
inline Vec Zero() { return Vec{}; }
inline Vec Load(const float* p) {
  Vec r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline void Store(float* p, Vec v) { std::memcpy(p, v.v, sizeof(v.v)); }
inline Vec Broadcast(const float* p) {
  Vec r;
  for (float& f : r.v) f = *p;
  return r;
}
inline Vec Fma(Vec a, Vec b, Vec c) {
  for (int i = 0; i < 8; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline float Sum(Vec v) {
  float s = 0.0f;
  for (float f : v.v) s += f;
  return s;
}
constexpr int kNtRows = 2;
template <typename W>
inline Vec LoadW(const W* p) {
  Vec r;
  for (int i = 0; i < 8; ++i) r.v[i] = ToF32(p[i]);
  return r;
}
#endif

constexpr int64_t kTile = 2 * kLanes;  // output columns per register tile
constexpr int64_t kPanel = 256;  // columns of one panel: 1 KiB runs of each weight row
constexpr int64_t kBlockBytes = 64 * 1024;  // a k-block of one panel (L2)
template <typename W>
constexpr int64_t kLine = 64 / sizeof(W);  // weights per 64-byte cache line

// One register tile: rows [0, RB) of x against w[0:K, 0:kTile] (row stride ldw); the sums start
// from y's current values when `accumulate` (a k-block after the first).
template <int RB, typename W>
void TileRows(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, float* y,
              int64_t ldy, bool accumulate) {
  Vec acc0[RB], acc1[RB];
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r) {
    acc0[r] = accumulate ? Load(y + r * ldy) : Zero();
    acc1[r] = accumulate ? Load(y + r * ldy + kLanes) : Zero();
  }
  for (int64_t k = 0; k < K; ++k) {
    const Vec w0 = LoadW(w + k * ldw), w1 = LoadW(w + k * ldw + kLanes);
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      const Vec b = Broadcast(x + r * ldx + k);
      acc0[r] = Fma(b, w0, acc0[r]);
      acc1[r] = Fma(b, w1, acc1[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r) {
    Store(y + r * ldy, acc0[r]);
    Store(y + r * ldy + kLanes, acc1[r]);
  }
}

template <typename W>
using TileFn = void (*)(const float*, int64_t, const W*, int64_t, int64_t, float*, int64_t, bool);

template <int RB, typename W>
TileFn<W> PickTile(int rows) {
  if constexpr (RB > 1) {
    if (rows < RB) return PickTile<RB - 1, W>(rows);
  }
  return &TileRows<RB, W>;
}

struct Block {  // k rows [k0, k0 + kn) of columns [c0, c0 + width)
  int64_t k0, kn, c0, width;
};

// Asks for lines [first, last) of block b of w, counted row by row: the memory system gets
// long contiguous runs, well ahead of the loads that use them.
template <typename W>
void PrefetchLines(const W* w, int64_t N, const Block& b, int64_t first, int64_t last) {
  const int64_t per_row = (b.width + kLine<W> - 1) / kLine<W>;
  for (int64_t i = first; i < last; ++i) {
    __builtin_prefetch(w + (b.k0 + i / per_row) * N + b.c0 + i % per_row * kLine<W>, 0, 2);
  }
}

template <typename W>
int64_t Lines(const Block& b) {
  return b.kn * ((b.width + kLine<W> - 1) / kLine<W>);
}

// y[0:RB, 0:width] = x[0:RB, :] @ w[:, 0:width] (width a multiple of kLanes) for up to
// kStreamRows rows, where the step is memory-bound and register tiles gain nothing: four
// weight rows at a time stream contiguously through the whole width (the hardware prefetchers' best case; it
// ran 1.3-1.4x faster than the tiles at 1-2 rows), the sums staying in y (L1).
template <int RB, typename W>
void StreamRows(const float* x, int64_t K, const W* w, int64_t N, int64_t width, float* y) {
  constexpr int G = RB == 1 ? 8 : 4;  // weight rows a pass: y is loaded and stored once per G
  for (int r = 0; r < RB; ++r) std::fill(y + r * N, y + r * N + width, 0.0f);
  int64_t k = 0;
  for (; k + G <= K; k += G) {
    Vec b[RB][G];
    for (int r = 0; r < RB; ++r) {
      for (int j = 0; j < G; ++j) b[r][j] = Broadcast(x + r * K + k + j);
    }
    const W* w0 = w + k * N;
    for (int64_t c = 0; c < width; c += kLanes) {
      Vec a[G];
#pragma GCC unroll 8
      for (int j = 0; j < G; ++j) a[j] = LoadW(w0 + j * N + c);
      for (int r = 0; r < RB; ++r) {
        Vec acc = Load(y + r * N + c);
#pragma GCC unroll 8
        for (int j = 0; j < G; ++j) acc = Fma(b[r][j], a[j], acc);
        Store(y + r * N + c, acc);
      }
    }
  }
  for (; k < K; ++k) {
    for (int r = 0; r < RB; ++r) {
      const Vec b = Broadcast(x + r * K + k);
      for (int64_t c = 0; c < width; c += kLanes) {
        Store(y + r * N + c, Fma(b, LoadW(w + k * N + c), Load(y + r * N + c)));
      }
    }
  }
}

// Register tiles over columns [c0, c1) (a multiple of kTile wide): panels of at most kPanel
// columns, each in k-blocks of ~kBlockBytes, the next block prefetched while one is computed.
template <typename W>
void TiledColumns(const float* x, const W* w, float* y, int64_t R, int64_t K, int64_t N,
                  int64_t c0, int64_t c1) {
  std::vector<Block> blocks;  // in the order computed
  for (int64_t p = c0; p < c1; p += kPanel) {
    const int64_t width = std::min(kPanel, c1 - p);
    const int64_t kc = std::max<int64_t>(16, kBlockBytes / (width * int64_t{sizeof(W)}));
    for (int64_t k0 = 0; k0 < K; k0 += kc) blocks.push_back({k0, std::min(kc, K - k0), p, width});
  }
  const int64_t groups = (R + kMaxRows - 1) / kMaxRows;  // near-equal: rows g*R/groups..
  if (!blocks.empty()) PrefetchLines(w, N, blocks[0], 0, Lines<W>(blocks[0]));
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Block& b = blocks[i];
    const int64_t tiles = b.width / kTile;
    // The next block's lines, a share per tile of this one, so the loads never wait long.
    const int64_t next = i + 1 < blocks.size() ? Lines<W>(blocks[i + 1]) : 0;
    const int64_t share = (next + tiles - 1) / tiles;
    for (int64_t t = 0; t < tiles; ++t) {
      if (next > 0) {
        PrefetchLines(w, N, blocks[i + 1], std::min(next, t * share),
                      std::min(next, (t + 1) * share));
      }
      const int64_t c = b.c0 + t * kTile;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t r0 = g * R / groups, rows = (g + 1) * R / groups - r0;
        PickTile<kMaxRows, W>(static_cast<int>(rows))(x + r0 * K + b.k0, K, w + b.k0 * N + c, N,
                                                   b.kn, y + r0 * N + c, N, b.k0 > 0);
      }
    }
  }
}

// Columns [c0, c1) of y; c0 is a multiple of kTile, and only the last range may end ragged.
template <typename W>
void Columns(const float* x, const W* w, float* y, int64_t R, int64_t K, int64_t N, int64_t c0,
             int64_t c1) {
  const int64_t full_end = c0 + (c1 - c0) / kTile * kTile;
  if (R == 1) {
    StreamRows<1>(x, K, w + c0, N, full_end - c0, y + c0);
  } else if (R == 2) {
    StreamRows<2>(x, K, w + c0, N, full_end - c0, y + c0);
  } else if (R == 3 && kStreamRows >= 3) {
    StreamRows<3>(x, K, w + c0, N, full_end - c0, y + c0);
  } else if (R == 4 && kStreamRows >= 4) {
    StreamRows<4>(x, K, w + c0, N, full_end - c0, y + c0);
  } else {
    TiledColumns(x, w, y, R, K, N, c0, full_end);
  }
  if (full_end == c1) return;
  const int64_t width = c1 - full_end;  // < kTile ragged columns: plain sums
  float acc[kTile];
  for (int64_t r = 0; r < R; ++r) {
    std::fill(acc, acc + width, 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[r * K + k];
      const W* wk = w + k * N + full_end;
      for (int64_t c = 0; c < width; ++c) acc[c] += xv * ToF32(wk[c]);
    }
    std::copy(acc, acc + width, y + r * N + full_end);
  }
}

// The transposed form, y[R, N] = x[R, K] @ w[N, K]^T (a tied embedding as the output head):
// kNtCols weight rows at a time stream contiguously along K, each multiplied into up to kNtRows
// rows of x whose vectors sit in registers; the vector sums reduce once per output.
constexpr int kNtCols = 4;

template <int RB, int CB, typename W>
void NtTile(const float* x, const W* w, int64_t K, float* y, int64_t N) {
  Vec acc[CB][RB];
  for (int c = 0; c < CB; ++c) {
    for (int r = 0; r < RB; ++r) acc[c][r] = Zero();
  }
  const int64_t kv = K / kLanes * kLanes;
  for (int64_t k = 0; k < kv; k += kLanes) {
    Vec xr[RB];
    for (int r = 0; r < RB; ++r) xr[r] = Load(x + r * K + k);
    for (int c = 0; c < CB; ++c) {
      const Vec wc = LoadW(w + c * K + k);
      for (int r = 0; r < RB; ++r) acc[c][r] = Fma(xr[r], wc, acc[c][r]);
    }
  }
  for (int c = 0; c < CB; ++c) {
    for (int r = 0; r < RB; ++r) {
      float sum = Sum(acc[c][r]);
      for (int64_t k = kv; k < K; ++k) sum += x[r * K + k] * ToF32(w[c * K + k]);
      y[r * N + c] = sum;
    }
  }
}

template <typename W>
using NtFn = void (*)(const float*, const W*, int64_t, float*, int64_t);

template <int RB, typename W>
NtFn<W> PickNt(int rows, bool full) {
  if constexpr (RB > 1) {
    if (rows < RB) return PickNt<RB - 1, W>(rows, full);
  }
  return full ? &NtTile<RB, kNtCols, W> : &NtTile<RB, 1, W>;
}

// Columns [c0, c1) of y (rows [c0, c1) of w).
template <typename W>
void NtColumns(const float* x, const W* w, float* y, int64_t R, int64_t K, int64_t N,
               int64_t c0, int64_t c1) {
  const int64_t groups = (R + kNtRows - 1) / kNtRows;
  for (int64_t c = c0; c < c1;) {
    const bool full = c + kNtCols <= c1;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r0 = g * R / groups, rows = (g + 1) * R / groups - r0;
      PickNt<kNtRows, W>(static_cast<int>(rows), full)(x + r0 * K, w + c * K, K, y + r0 * N + c, N);
    }
    c += full ? kNtCols : 1;
  }
}
