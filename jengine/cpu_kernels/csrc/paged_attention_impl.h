// The per-task kernel of paged_attention.cc, compiled once per instruction set: per_isa.h
// includes it in the namespaces portable / avx2 / avx512 with JE_SIMD 0 / 1 / 2 under the
// matching target pragma. No include guard on purpose. The vector primitives below are the only
// per-ISA code; the kernel is written once over them (kLanes floats a vector: 8, 8, 16).
//
// One task: the query rows of one block (consecutive tokens of one sequence) and the q heads of
// one kv head, over a range of key positions, page by page straight from the cache, with an
// online softmax in f32. Each row's visible keys are contiguous (causal and sliding window):
// the row path (decode) visits only each row's own key range; the tiled path (prefill blocks)
// computes a page for all of the task's query vectors at once and masks per lane.

#if JE_SIMD == 2
using Vec = __m512;
constexpr int64_t kLanes = 16;
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Set(float x) { return _mm512_set1_ps(x); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec Min(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }   // a * b + c
inline Vec Fnma(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline Vec Round(Vec x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline Vec Pow2(Vec n) {  // 2^n for integral n in [-127, 128)
  const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
  return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
inline float Sum(Vec v) { return _mm512_reduce_add_ps(v); }
inline __m256 HalfSum(Vec v) {  // the two 256-bit halves added (AVX-512F has no 32x8 extract)
  return _mm256_add_ps(_mm512_castps512_ps256(v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
inline void Sum4(Vec a, Vec b, Vec c, Vec d, float* out) {  // out[i] = Sum of the i-th
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(HalfSum(a), HalfSum(b)),
                                  _mm256_hadd_ps(HalfSum(c), HalfSum(d)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
inline Vec LoadBf16(const uint16_t* p) {  // 16 bf16 -> f32: the bits are the f32's upper half
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline Vec LoadInt8(const int8_t* p) {  // 16 int8 -> f32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif JE_SIMD == 1
using Vec = __m256;
constexpr int64_t kLanes = 8;
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Set(float x) { return _mm256_set1_ps(x); }
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec Min(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec Fnma(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline Vec Round(Vec x) {
  return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline Vec Pow2(Vec n) {
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
inline float Sum(Vec v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
}
inline void Sum4(Vec a, Vec b, Vec c, Vec d, float* out) {
  // hadd(hadd(a, b), hadd(c, d)) holds the four sums split over the two 128-bit lanes.
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
inline Vec LoadBf16(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline Vec LoadInt8(const int8_t* p) {  // 8 int8 -> f32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#else
struct Vec {  // eight floats; the compiler vectorises the loops for the baseline target
  float v[8];
};
constexpr int64_t kLanes = 8;
template <typename F>
inline Vec Map(F f) {
  Vec r;
  for (int i = 0; i < 8; ++i) r.v[i] = f(i);
  return r;
}
inline Vec Zero() { return Vec{}; }
inline Vec Set(float x) { return Map([&](int) { return x; }); }
inline Vec Load(const float* p) {
  Vec r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline void Store(float* p, Vec v) { std::memcpy(p, v.v, sizeof(v.v)); }
inline Vec Add(Vec a, Vec b) { return Map([&](int i) { return a.v[i] + b.v[i]; }); }
inline Vec Sub(Vec a, Vec b) { return Map([&](int i) { return a.v[i] - b.v[i]; }); }
inline Vec Mul(Vec a, Vec b) { return Map([&](int i) { return a.v[i] * b.v[i]; }); }
inline Vec Max(Vec a, Vec b) { return Map([&](int i) { return std::max(a.v[i], b.v[i]); }); }
inline Vec Min(Vec a, Vec b) { return Map([&](int i) { return std::min(a.v[i], b.v[i]); }); }
inline Vec Fma(Vec a, Vec b, Vec c) {
  return Map([&](int i) { return a.v[i] * b.v[i] + c.v[i]; });
}
inline Vec Fnma(Vec a, Vec b, Vec c) {
  return Map([&](int i) { return c.v[i] - a.v[i] * b.v[i]; });
}
inline Vec Round(Vec x) {  // to nearest for |x| < 2^22 (here |x| <= 126), without a libm call
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23
  return Map([&](int i) { return (x.v[i] + kShift) - kShift; });
}
inline Vec Pow2(Vec n) {
  return Map([&](int i) {
    const uint32_t u = static_cast<uint32_t>(static_cast<int32_t>(n.v[i]) + 127) << 23;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  });
}
inline float Sum(Vec v) {
  return ((v.v[0] + v.v[1]) + (v.v[2] + v.v[3])) + ((v.v[4] + v.v[5]) + (v.v[6] + v.v[7]));
}
inline void Sum4(Vec a, Vec b, Vec c, Vec d, float* out) {
  out[0] = Sum(a);
  out[1] = Sum(b);
  out[2] = Sum(c);
  out[3] = Sum(d);
}
inline Vec LoadBf16(const uint16_t* p) { return Map([&](int i) { return Bf16ToF32(p[i]); }); }
inline Vec LoadInt8(const int8_t* p) { return Map([&](int i) { return static_cast<float>(p[i]); }); }
#endif

// exp(x) for x <= 0 (scores minus their running max): Cody-Waite range reduction and a degree-6
// polynomial, ~1 ulp; inputs below -87 give ~1e-38, which is 0 next to the max's 1.
inline Vec Exp(Vec x) {
  x = Max(x, Set(-87.0f));
  const Vec n = Round(Mul(x, Set(1.44269504088896341f)));
  Vec r = Fnma(n, Set(0.693359375f), x);
  r = Fnma(n, Set(-2.12194440e-4f), r);
  Vec p = Set(1.9875691500e-4f);
  p = Fma(p, r, Set(1.3981999507e-3f));
  p = Fma(p, r, Set(8.3334519073e-3f));
  p = Fma(p, r, Set(4.1665795894e-2f));
  p = Fma(p, r, Set(1.6666665459e-1f));
  p = Fma(p, r, Set(5.0000001201e-1f));
  p = Fma(p, Mul(r, r), Add(r, Set(1.0f)));
  return Mul(p, Pow2(n));
}

inline float Dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  Vec acc0 = Zero(), acc1 = Zero();
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    acc0 = Fma(Load(a + i), Load(b + i), acc0);
    acc1 = Fma(Load(a + i + kLanes), Load(b + i + kLanes), acc1);
  }
  if (i + kLanes <= n) {
    acc0 = Fma(Load(a + i), Load(b + i), acc0);
    i += kLanes;
  }
  float sum = Sum(Add(acc0, acc1));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// s[j] = exp(s[j] - m) for j < n; returns their sum.
inline float ExpShifted(float* s, float m, int64_t n) {
  int64_t j = 0;
  const Vec vm = Set(m);
  Vec acc = Zero();
  for (; j + kLanes <= n; j += kLanes) {
    const Vec e = Exp(Sub(Load(s + j), vm));
    Store(s + j, e);
    acc = Add(acc, e);
  }
  float sum = Sum(acc);
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
}

// s[j] = q . k_j for n keys (rows of length d), four keys per pass so that one reduction
// serves four dot products.
inline void Scores(const float* q, const float* k, int64_t n, int64_t d, float* s) {
  int64_t j = 0;
  if (d % kLanes == 0) {
    for (; j + 4 <= n; j += 4) {
      const float* k0 = k + j * d;
      Vec a0 = Zero(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t c = 0; c < d; c += kLanes) {
        const Vec x = Load(q + c);
        a0 = Fma(x, Load(k0 + c), a0);
        a1 = Fma(x, Load(k0 + d + c), a1);
        a2 = Fma(x, Load(k0 + 2 * d + c), a2);
        a3 = Fma(x, Load(k0 + 3 * d + c), a3);
      }
      Sum4(a0, a1, a2, a3, s + j);
    }
  }
  for (; j < n; ++j) s[j] = Dot(q, k + j * d, d);
}

// acc[:NC kLanes] = alpha * acc + sum_j p[j] v[j, :NC kLanes], the NC accumulators held in
// registers so that the FMA chains of different columns overlap.
template <int NC>
inline void AccumulateColumns(float* acc, Vec alpha, const float* p, const float* v, int64_t n,
                              int64_t d) {
  Vec a[NC];
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) a[c] = Mul(alpha, Load(acc + kLanes * c));
  for (int64_t j = 0; j < n; ++j) {
    const Vec pj = Set(p[j]);
    const float* vj = v + j * d;
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) a[c] = Fma(pj, Load(vj + kLanes * c), a[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) Store(acc + kLanes * c, a[c]);
}

// acc[:d] = alpha * acc[:d] + sum_j p[j] * v[j, :d]  (v rows of length d, n of them).
inline void AccumulateValues(float* acc, float alpha, const float* p, const float* v, int64_t n,
                             int64_t d) {
  int64_t c = 0;
  const Vec va = Set(alpha);
  for (; c + 8 * kLanes <= d; c += 8 * kLanes) AccumulateColumns<8>(acc + c, va, p, v + c, n, d);
  if (c + 4 * kLanes <= d) {
    AccumulateColumns<4>(acc + c, va, p, v + c, n, d);
    c += 4 * kLanes;
  }
  if (c + 2 * kLanes <= d) {
    AccumulateColumns<2>(acc + c, va, p, v + c, n, d);
    c += 2 * kLanes;
  }
  if (c + kLanes <= d) {
    AccumulateColumns<1>(acc + c, va, p, v + c, n, d);
    c += kLanes;
  }
  for (; c < d; ++c) {
    float a = alpha * acc[c];
    for (int64_t j = 0; j < n; ++j) a += p[j] * v[j * d + c];
    acc[c] = a;
  }
}

inline void WidenBf16(float* dst, const uint16_t* src, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) Store(dst + i, LoadBf16(src + i));
  for (; i < n; ++i) dst[i] = Bf16ToF32(src[i]);
}

// n int8 rows of d times their scales (one a row) -> f32.
inline void WidenInt8(float* dst, const int8_t* src, const float* scale, int64_t n, int64_t d) {
  for (int64_t j = 0; j < n; ++j) {
    const Vec s = Set(scale[j]);
    int64_t c = 0;
    for (; c + kLanes <= d; c += kLanes) Store(dst + j * d + c, Mul(LoadInt8(src + j * d + c), s));
    for (; c < d; ++c) dst[j * d + c] = static_cast<float>(src[j * d + c]) * scale[j];
  }
}

// The pointer to `n` keys (or values) of one page row range as f32: in place for an f32
// cache, widened into `buf` for a bf16 one, dequantized into `buf` with the rows' scales
// (`scales`, one per row of D) for an int8 one.
inline const float* PageRows(const Problem& pb, const void* cache, const float* scales,
                             int64_t offset, int64_t n, float* buf) {
  switch (pb.kv_type) {
    case KvType::kF32:
      return static_cast<const float*>(cache) + offset;
    case KvType::kBf16:
      WidenBf16(buf, static_cast<const uint16_t*>(cache) + offset, n * pb.D);
      return buf;
    case KvType::kInt8:
      WidenInt8(buf, static_cast<const int8_t*>(cache) + offset, scales + offset / pb.D, n, pb.D);
      return buf;
  }
  return buf;
}

// Asks for `n` cache elements of K and V from `offset` on, ahead of their use (and an int8
// cache's scales of those rows).
inline void Prefetch(const Problem& pb, int64_t offset, int64_t n) {
#if JE_X86
  const int64_t item = pb.item;
  const char* k = static_cast<const char*>(pb.k) + offset * item;
  const char* v = static_cast<const char*>(pb.v) + offset * item;
  for (int64_t b = 0; b < n * item; b += 64) {
    _mm_prefetch(k + b, _MM_HINT_T0);
    _mm_prefetch(v + b, _MM_HINT_T0);
  }
  if (pb.kv_type == KvType::kInt8) {
    for (int64_t r = 0; r < n / pb.D; r += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(pb.k_scale + offset / pb.D + r), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(pb.v_scale + offset / pb.D + r), _MM_HINT_T0);
    }
  }
#endif
}

// Calls visit(key0, n, keys, values) for each page of the task's key range: n keys from key
// position key0 on, their K and V rows [n, D] as f32. The next page is prefetched.
template <typename Visit>
inline void ForEachPage(const Problem& pb, const Task& task, Scratch& ws, Visit visit) {
  const Block& b = pb.blocks[task.block];
  const int64_t D = pb.D, O = pb.O;
  const int32_t* table = pb.page_table + static_cast<int64_t>(b.seq) * pb.max_pages;
  const int64_t head_base = (pb.layer * pb.K + task.kv_head) * pb.P;
  for (int64_t page_index = task.key_lo / O; page_index * O < task.key_hi; ++page_index) {
    const int64_t page_start = page_index * O;
    const int64_t j0 = std::max(task.key_lo, page_start) - page_start;
    const int64_t j1 = std::min(task.key_hi, page_start + O) - page_start;
    const int64_t page = std::min<int64_t>(std::max<int32_t>(table[page_index], 0), pb.P - 1);
    const int64_t offset = ((head_base + page) * O + j0) * D;
    if (page_start + O < task.key_hi) {  // the next page's rows: a DRAM miss otherwise
      const int64_t next = std::min<int64_t>(std::max<int32_t>(table[page_index + 1], 0),
                                             pb.P - 1);
      Prefetch(pb, (head_base + next) * O * D, O * D);
    }
    const float* keys = PageRows(pb, pb.k, pb.k_scale, offset, j1 - j0, ws.k.data());
    const float* values = PageRows(pb, pb.v, pb.v_scale, offset, j1 - j0, ws.v.data());
    visit(page_start + j0, j1 - j0, keys, values);
  }
}

// The softmax state of `rows` query vectors before any key: m = -inf, l = 0, acc = 0.
inline void ClearState(Scratch& ws, int64_t rows, int64_t d) {
  std::fill(ws.m.begin(), ws.m.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(ws.l.begin(), ws.l.begin() + rows, 0.0f);
  std::fill(ws.acc.begin(), ws.acc.begin() + rows * d, 0.0f);
}

// One query vector at a time: its scores by dot products, its values row by row. Serves
// decode (one row per sequence) and head dims that are not whole vectors.
inline void RunRowsTask(const Problem& pb, const Task& task, Scratch& ws) {
  const Block& b = pb.blocks[task.block];
  const std::vector<int>& heads = pb.groups[task.kv_head];
  const int64_t G = static_cast<int64_t>(heads.size()), D = pb.D;
  const int64_t rows = b.num_rows * G;
  ws.Reserve(rows, D, pb.O);
  for (int64_t r = 0; r < b.num_rows; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const float* src = pb.q + ((b.first_token + r) * pb.H + heads[g]) * D;
      float* dst = ws.q.data() + (r * G + g) * D;
      for (int64_t c = 0; c < D; ++c) dst[c] = src[c] * pb.sm_scale;
    }
  }
  ClearState(ws, rows, D);
  ForEachPage(pb, task, ws, [&](int64_t key0, int64_t n_page, const float* keys,
                                const float* values) {
    for (int64_t r = 0; r < b.num_rows; ++r) {
      const int64_t pos = pb.positions[b.first_token + r];
      // This row's visible keys within the page: [pos - window + 1, pos], from key0 on.
      const int64_t lo = std::max<int64_t>(0, pos - pb.window + 1 - key0);
      const int64_t hi = std::min(n_page, pos + 1 - key0);
      if (lo >= hi) continue;
      const int64_t n = hi - lo;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = r * G + g;
        float* s = ws.s.data();
        const float* qi = ws.q.data() + i * D;
        Scores(qi, keys + lo * D, n, D, s);
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) {
          if (pb.soft_cap > 0.0f) s[j] = pb.soft_cap * std::tanh(s[j] / pb.soft_cap);
          mx = std::max(mx, s[j]);
        }
        const float m_new = std::max(ws.m[i], mx);
        const float alpha = std::exp(ws.m[i] - m_new);  // 0 on the first visit (m = -inf)
        const float sum = ExpShifted(s, m_new, n);
        ws.l[i] = ws.l[i] * alpha + sum;
        ws.m[i] = m_new;
        AccumulateValues(ws.acc.data() + i * D, alpha, s, values + lo * D, n, D);
      }
    }
  });
  FinishTask(pb, task, ws);
}

// ---- Prefill blocks: each page as register-tiled matrix products ----
// The N = rows x G query vectors of the task lie across the lanes (vector i = r * G + g): a
// page's scores are St [n, N] = K [n, D] . Qt [D, N] (Qt transposed once per task, keys read in
// place), so the softmax statistics of kLanes vectors update together, and the values are
// acc [N, D] += P [N, n] . V [n, D]. Per lane, the keys outside its row's visible range are
// masked: probability exactly 0, and no effect on the running max.

constexpr float kMasked = -3.0e38f;  // a masked score: finite, below every real one
constexpr float kPadPosition = -1.0e9f;  // the position of a padding lane: it sees no key

// 1 where 0 <= d <= window - 1, else 0 (d = query position - key position, integral: exact in
// f32 for positions below 2^24).
inline Vec Visible(Vec d, Vec window) {
  const Vec one = Set(1.0f), zero = Zero();
  return Mul(Min(Max(Add(d, one), zero), one), Min(Max(Sub(window, d), zero), one));
}

// The register tile of both products: for M rows and N vectors of columns,
//   c[m, cols] = s[m] c[m, cols] + sum_t a[m * am + t * at] b[t * bt + cols]   (t < steps),
// one broadcast of a and N loads of b a step; without `s` the sum starts from 0.
template <int M, int N>
inline void TileProduct(const float* a, int64_t am, int64_t at, const float* b, int64_t bt,
                        int64_t steps, const float* s, float* c, int64_t cm) {
  Vec acc[M][N];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    const Vec sm = s ? Set(s[m]) : Zero();
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) acc[m][n] = s ? Mul(sm, Load(c + m * cm + n * kLanes)) : sm;
  }
  for (int64_t t = 0; t < steps; ++t) {
    Vec x[N];
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) x[n] = Load(b + t * bt + n * kLanes);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const Vec am_t = Set(a[m * am + t * at]);
#pragma GCC unroll 4
      for (int n = 0; n < N; ++n) acc[m][n] = Fma(am_t, x[n], acc[m][n]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) Store(c + m * cm + n * kLanes, acc[m][n]);
  }
}

// st[j, lanes] = sum_c k[j, c] qt[c, lanes] for n keys and NR vectors of lanes (rows ld apart),
// kKeys keys a pass.
template <int NR>
inline void ScoreLanes(const float* k, int64_t n, const float* qt, int64_t d, int64_t ld,
                       float* st) {
  constexpr int kKeys = JE_SIMD == 2 ? 8 : 4;  // kKeys x NR accumulators: 16 of 32, 8 of 16
  int64_t j = 0;
  for (; j + kKeys <= n; j += kKeys) {
    TileProduct<kKeys, NR>(k + j * d, d, 1, qt, ld, d, nullptr, st + j * ld, ld);
  }
  for (; j < n; ++j) TileProduct<1, NR>(k + j * d, d, 1, qt, ld, d, nullptr, st + j * ld, ld);
}

// acc[r, :d] = alpha[r] acc[r, :d] + sum_j st[j, r] v[j, :d] for R rows (d apart; st's rows
// ld apart; d a multiple of kLanes).
template <int R>
inline void ValueRows(const float* st, int64_t ld, const float* alpha, const float* v,
                      int64_t n, int64_t d, float* acc) {
  constexpr int kCols = JE_SIMD == 2 ? 4 : 2;  // R x kCols accumulators: 16 of 32, 8 of 16
  int64_t c = 0;
  for (; c + kCols * kLanes <= d; c += kCols * kLanes) {
    TileProduct<R, kCols>(st, 1, ld, v + c, d, n, alpha, acc + c, d);
  }
  for (; c < d; c += kLanes) TileProduct<R, 1>(st, 1, ld, v + c, d, n, alpha, acc + c, d);
}

// One page's online-softmax update of the kLanes vectors at `lane`: st[:n, lane...] turns from
// scores into probabilities, m and l are updated and alpha gets the factor for acc.
inline void LaneSoftmax(const Problem& pb, int64_t key0, int64_t n, int64_t ld, int64_t lane,
                        Scratch& ws, float* st) {
  const int64_t lo_pos = ws.lane_min_pos[lane / kLanes], hi_pos = ws.lane_max_pos[lane / kLanes];
  float* alpha = ws.alpha.data() + lane;
  if (hi_pos < key0 || lo_pos - pb.window + 1 > key0 + n - 1) {  // no lane sees these keys
    Store(alpha, Set(1.0f));
    for (int64_t j = 0; j < n; ++j) Store(st + j * ld + lane, Zero());
    return;
  }
  // Whether every real lane sees every key (then padding lanes, whose rows are never written
  // out, count as seeing them too).
  const bool all = lo_pos >= key0 + n - 1 && hi_pos - pb.window + 1 <= key0;
  if (pb.soft_cap > 0.0f) {
    for (int64_t j = 0; j < n; ++j) {
      float* s = st + j * ld + lane;
      for (int64_t t = 0; t < kLanes; ++t) s[t] = pb.soft_cap * std::tanh(s[t] / pb.soft_cap);
    }
  }
  const Vec pos = Load(ws.lane_pos.data() + lane), window = Set(static_cast<float>(pb.window));
  const Vec one = Set(1.0f), masked = Set(kMasked);
  Vec mx = masked;
  for (int64_t j = 0; j < n; ++j) {
    Vec s = Load(st + j * ld + lane);
    if (!all) {  // s where visible, kMasked elsewhere (vis 0 or 1: exact)
      const Vec vis = Visible(Sub(pos, Set(static_cast<float>(key0 + j))), window);
      s = Fma(vis, s, Mul(Sub(one, vis), masked));
      Store(st + j * ld + lane, s);
    }
    mx = Max(mx, s);
  }
  const Vec m_old = Load(ws.m.data() + lane);
  const Vec m_new = Max(m_old, mx);
  const Vec a = Exp(Sub(m_old, m_new));  // ~0 on the first visit (m = -inf), 1 if m holds
  Vec sum = Zero();
  for (int64_t j = 0; j < n; ++j) {
    Vec p = Exp(Sub(Load(st + j * ld + lane), m_new));
    if (!all) p = Mul(p, Visible(Sub(pos, Set(static_cast<float>(key0 + j))), window));
    Store(st + j * ld + lane, p);
    sum = Add(sum, p);
  }
  Store(ws.m.data() + lane, m_new);
  Store(ws.l.data() + lane, Fma(Load(ws.l.data() + lane), a, sum));
  Store(alpha, a);
}

inline void RunTiledTask(const Problem& pb, const Task& task, Scratch& ws) {
  const Block& b = pb.blocks[task.block];
  const std::vector<int>& heads = pb.groups[task.kv_head];
  const int64_t G = static_cast<int64_t>(heads.size()), D = pb.D;
  const int64_t rows = b.num_rows * G;
  const int64_t num_vecs = (rows + kLanes - 1) / kLanes, ld = num_vecs * kLanes;
  ws.Reserve(ld, D, pb.O);
  ws.ReserveLanes(ld, D, pb.O);
  for (int64_t i = 0; i < ld; ++i) {
    const bool real = i < rows;
    const int64_t r = i / G;
    const float* src = pb.q + ((b.first_token + r) * pb.H + heads[i % G]) * D;
    for (int64_t c = 0; c < D; ++c) ws.qt[c * ld + i] = real ? src[c] * pb.sm_scale : 0.0f;
    ws.lane_pos[i] = real ? static_cast<float>(pb.positions[b.first_token + r]) : kPadPosition;
  }
  for (int64_t v = 0; v < num_vecs; ++v) {  // over the real lanes: every vector has one
    const float* p = ws.lane_pos.data() + v * kLanes;
    const int64_t real = std::min<int64_t>(kLanes, rows - v * kLanes);
    ws.lane_min_pos[v] = static_cast<int64_t>(*std::min_element(p, p + real));
    ws.lane_max_pos[v] = static_cast<int64_t>(*std::max_element(p, p + real));
  }
  ClearState(ws, ld, D);
  float* st = ws.st.data();
  ForEachPage(pb, task, ws, [&](int64_t key0, int64_t n, const float* keys,
                                const float* values) {
    int64_t lane = 0;
    for (; lane + 2 * kLanes <= ld; lane += 2 * kLanes) {
      ScoreLanes<2>(keys, n, ws.qt.data() + lane, D, ld, st + lane);
    }
    if (lane < ld) ScoreLanes<1>(keys, n, ws.qt.data() + lane, D, ld, st + lane);
    for (lane = 0; lane < ld; lane += kLanes) LaneSoftmax(pb, key0, n, ld, lane, ws, st);
    constexpr int kRows = 4;
    int64_t i = 0;
    for (; i + kRows <= rows; i += kRows) {
      ValueRows<kRows>(st + i, ld, ws.alpha.data() + i, values, n, D, ws.acc.data() + i * D);
    }
    for (; i < rows; ++i) {
      ValueRows<1>(st + i, ld, ws.alpha.data() + i, values, n, D, ws.acc.data() + i * D);
    }
  });
  FinishTask(pb, task, ws);
}

// Prefill blocks (kPrefillRows query rows or more) with at least a vector of query vectors and
// whole-vector head dims take the tiled path; decode rows, a speculative verification's few rows
// (each as its decode would run, to the bit) and other head dims the row path.
inline void RunTask(const Problem& pb, const Task& task, Scratch& ws) {
  const Block& b = pb.blocks[task.block];
  const int64_t rows = b.num_rows * static_cast<int64_t>(pb.groups[task.kv_head].size());
  if (b.num_rows >= kPrefillRows && rows >= kLanes && pb.D % kLanes == 0) {
    RunTiledTask(pb, task, ws);
  } else {
    RunRowsTask(pb, task, ws);
  }
}
