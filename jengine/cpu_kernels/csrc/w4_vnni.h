// The W4A8 body of the 4-bit matmul (included by w4_matmul.cc): the activations quantized to
// int8 per row and group of 32 k, then VPDPBUSD (AVX-512 VNNI) multiplies the weight's u8
// nibbles by them, 4 k per 32-bit lane, exact int32 sums per group. Per row r, group g and
// column n (llama.cpp's Q4_1 x Q8_1 scheme, with the exact float sum for the min term):
//   sum_k w[k, n] x[r, k] ~= s[g, n] * d[r, g] * sum_k q[k, n] xq[r, k] + m[g, n] * xs[r, g]
// where xq = round(x / d), d = max |x over the group| / 127 and xs = sum_k x[r, k].
//
// Why: the float paths spend 5 instructions per 16 weights and row widening nibbles to f32 and
// FMA-ing them, so past a few rows they are compute-bound; here a run of 64 packed bytes becomes
// two u8 vectors with an AND and a shift (shared by every row), and each row takes one
// VPDPBUSD per 64 weights. The cost is the activation's int8 rounding (docs/quantization.md).
//
// Register plan: one vector of 16 columns at a time over all groups, kVnniRows rows at once:
// 8 unpacked weight vectors, kVnniRows f32 sums, 2 int32 sums per row in flight.

#if JE_X86
#define JE_W4_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

constexpr int kVnniRows = 8;

struct VnniActs {  // x quantized: what every tile's rows read
  const int8_t* xq;  // [R, K]
  const float* d;    // [R, G] the groups' scales
  const float* xs;   // [R, G] the groups' float sums
};

// Rows [0, RB) of `a` (row stride K, group stride G) against the 16 columns 16 v .. 16 v + 15
// of one tile (q its [G, 16, 64] bytes, s / m its [G, 64] floats); `mask` the columns kept.
template <int RB>
JE_W4_VNNI void VnniRows(const int8_t* xq, const float* d, const float* xs, const uint8_t* q,
                         const float* s, const float* m, int64_t K, int64_t G, int v,
                         float* y, int64_t ldy, __mmask16 mask) {
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* qg = q + g * 16 * kW4Cols + v * 256;
    __m512i lo[4], hi[4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i raw = _mm512_loadu_si512(qg + p * 64);
      lo[p] = _mm512_and_si512(raw, low);
      hi[p] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
    const __m512 sv = _mm512_loadu_ps(s + g * kW4Cols + v * 16);
    const __m512 mv = _mm512_loadu_ps(m + g * kW4Cols + v * 16);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const int32_t* xr = reinterpret_cast<const int32_t*>(xq + r * K + g * 32);
      __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        a = _mm512_dpbusd_epi32(a, lo[p], _mm512_set1_epi32(xr[p]));
        b = _mm512_dpbusd_epi32(b, hi[p], _mm512_set1_epi32(xr[4 + p]));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(a, b));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(sv, _mm512_set1_ps(d[r * G + g])), dot, acc[r]);
      acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * G + g]), acc[r]);
    }
  }
  for (int r = 0; r < RB; ++r) _mm512_mask_storeu_ps(y + r * ldy + v * 16, mask, acc[r]);
}

template <int RB>
JE_W4_VNNI void VnniBlock(const VnniActs& a, int64_t r0, const uint8_t* q, const float* s,
                          const float* m, int64_t K, int64_t G, int64_t width, float* y,
                          int64_t ldy) {
  for (int v = 0; v < 4 && 16 * v < width; ++v) {
    const int64_t left = width - 16 * v;
    const __mmask16 mask = left >= 16 ? 0xFFFF : (1u << left) - 1;
    VnniRows<RB>(a.xq + r0 * K, a.d + r0 * G, a.xs + r0 * G, q, s, m, K, G, v, y + r0 * ldy,
                 ldy, mask);
  }
}

// Tiles [t0, t1) of y[R, N], every row.
JE_W4_VNNI void VnniTiles(const VnniActs& a, const uint8_t* q, const float* s, const float* m,
                          float* y, int64_t R, int64_t K, int64_t N, int64_t t0, int64_t t1) {
  const int64_t G = K / 32;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* qt = q + t * G * 16 * kW4Cols;
    const float* st = s + t * G * kW4Cols;
    const float* mt = m + t * G * kW4Cols;
    const int64_t width = std::min<int64_t>(kW4Cols, N - t * kW4Cols);
    float* yt = y + t * kW4Cols;
    int64_t r0 = 0;
    for (; r0 + kVnniRows <= R; r0 += kVnniRows) {
      VnniBlock<kVnniRows>(a, r0, qt, st, mt, K, G, width, yt, N);
    }
    switch (R - r0) {  // the rows left, one body each so that every loop unrolls
      case 7: VnniBlock<7>(a, r0, qt, st, mt, K, G, width, yt, N); break;
      case 6: VnniBlock<6>(a, r0, qt, st, mt, K, G, width, yt, N); break;
      case 5: VnniBlock<5>(a, r0, qt, st, mt, K, G, width, yt, N); break;
      case 4: VnniBlock<4>(a, r0, qt, st, mt, K, G, width, yt, N); break;
      case 3: VnniBlock<3>(a, r0, qt, st, mt, K, G, width, yt, N); break;
      case 2: VnniBlock<2>(a, r0, qt, st, mt, K, G, width, yt, N); break;
      case 1: VnniBlock<1>(a, r0, qt, st, mt, K, G, width, yt, N); break;
      default: break;
    }
  }
}
// The same scheme on AVX-VNNI (the 256-bit VPDPBUSD of CPUs with AVX2 but no AVX-512: Intel's
// Alder Lake and later clients, Sierra Forest): 8 columns at a time, the first or second half
// of each 64-byte run, kAvxVnniRows rows at once, one int32 sum per row (16 ymm registers).
#define JE_W4_AVX_VNNI __attribute__((target("avx2,fma,avxvnni")))

constexpr int kAvxVnniRows = 4;

// Rows [0, RB) against columns 8 c .. 8 c + 7 of one tile; `width` (1..8) of them stored.
template <int RB>
JE_W4_AVX_VNNI void AvxVnniRows(const int8_t* xq, const float* d, const float* xs,
                                const uint8_t* q, const float* s, const float* m, int64_t K,
                                int64_t G, int c, float* y, int64_t ldy, int64_t width) {
  const __m256i low = _mm256_set1_epi8(15);
  const uint8_t* qc = q + (c / 2) * 256 + (c % 2) * 32;  // vector c / 2, half c % 2
  __m256 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* qg = qc + g * 16 * kW4Cols;
    __m256i lo[4], hi[4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + p * 64));
      lo[p] = _mm256_and_si256(raw, low);
      hi[p] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
    const __m256 sv = _mm256_loadu_ps(s + g * kW4Cols + c * 8);
    const __m256 mv = _mm256_loadu_ps(m + g * kW4Cols + c * 8);
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const int32_t* xr = reinterpret_cast<const int32_t*>(xq + r * K + g * 32);
      __m256i sum = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        sum = _mm256_dpbusd_avx_epi32(sum, lo[p], _mm256_set1_epi32(xr[p]));
        sum = _mm256_dpbusd_avx_epi32(sum, hi[p], _mm256_set1_epi32(xr[4 + p]));
      }
      const __m256 dot = _mm256_cvtepi32_ps(sum);
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(sv, _mm256_set1_ps(d[r * G + g])), dot, acc[r]);
      acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[r * G + g]), acc[r]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    if (width == 8) {
      _mm256_storeu_ps(y + r * ldy + c * 8, acc[r]);
    } else {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[r]);
      std::copy(lanes, lanes + width, y + r * ldy + c * 8);
    }
  }
}

template <int RB>
JE_W4_AVX_VNNI void AvxVnniBlock(const VnniActs& a, int64_t r0, const uint8_t* q,
                                 const float* s, const float* m, int64_t K, int64_t G,
                                 int64_t width, float* y, int64_t ldy) {
  for (int c = 0; c < 8 && 8 * c < width; ++c) {
    AvxVnniRows<RB>(a.xq + r0 * K, a.d + r0 * G, a.xs + r0 * G, q, s, m, K, G, c, y + r0 * ldy,
                    ldy, std::min<int64_t>(8, width - 8 * c));
  }
}

// Tiles [t0, t1) of y[R, N], every row.
JE_W4_AVX_VNNI void AvxVnniTiles(const VnniActs& a, const uint8_t* q, const float* s,
                                 const float* m, float* y, int64_t R, int64_t K, int64_t N,
                                 int64_t t0, int64_t t1) {
  const int64_t G = K / 32;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* qt = q + t * G * 16 * kW4Cols;
    const float* st = s + t * G * kW4Cols;
    const float* mt = m + t * G * kW4Cols;
    const int64_t width = std::min<int64_t>(kW4Cols, N - t * kW4Cols);
    float* yt = y + t * kW4Cols;
    int64_t r0 = 0;
    for (; r0 + kAvxVnniRows <= R; r0 += kAvxVnniRows) {
      AvxVnniBlock<kAvxVnniRows>(a, r0, qt, st, mt, K, G, width, yt, N);
    }
    switch (R - r0) {
      case 3: AvxVnniBlock<3>(a, r0, qt, st, mt, K, G, width, yt, N); break;
      case 2: AvxVnniBlock<2>(a, r0, qt, st, mt, K, G, width, yt, N); break;
      case 1: AvxVnniBlock<1>(a, r0, qt, st, mt, K, G, width, yt, N); break;
      default: break;
    }
  }
}
#endif  // JE_X86

// Rows [r0, r1) of x [R, K] f32 -> int8 per group of 32 (round to nearest even of x / d,
// d = max |x| / 127; an all-zero group gets d = 0 and q = 0) and each group's float sum.
inline void QuantizeGroups(const float* x, int64_t K, int64_t r0, int64_t r1, int8_t* xq,
                           float* d, float* xs) {
  const int64_t G = K / 32;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + r * K + g * 32;
      float amax = 0.0f, sum = 0.0f;
      for (int k = 0; k < 32; ++k) {
        amax = std::max(amax, std::fabs(xg[k]));
        sum += xg[k];
      }
      const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      for (int k = 0; k < 32; ++k) {
        xq[r * K + g * 32 + k] = static_cast<int8_t>(std::nearbyint(xg[k] * inv));
      }
      d[r * G + g] = scale;
      xs[r * G + g] = sum;
    }
  }
}
