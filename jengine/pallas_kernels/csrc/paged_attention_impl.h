// The per-task kernel of paged_attention.cc, compiled once per instruction set: per_isa.h
// includes it in the namespaces portable / avx2 / avx512 with JE_SIMD 0 / 1 / 2 under the
// matching target pragma. No include guard on purpose. The vector primitives below are the only
// per-ISA code; the kernel is written once over them (kLanes floats a vector: 8, 8, 16).
//
// One task: the query rows of one block (consecutive tokens of one sequence) and the q heads of
// one kv head, over a range of key positions. Each row's visible keys are contiguous (causal and
// sliding window), so no mask is materialised: each row visits only its own key range, page by
// page, straight from the cache, with an online softmax in f32.

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

// The pointer to `n` keys (or values) of one page row range as f32: in place for an f32
// cache, widened into `buf` for a bf16 one.
inline const float* PageRows(const Problem& pb, const void* cache, int64_t offset, int64_t n,
                             float* buf) {
  if (!pb.bf16) return static_cast<const float*>(cache) + offset;
  WidenBf16(buf, static_cast<const uint16_t*>(cache) + offset, n * pb.D);
  return buf;
}

// Asks for `n` cache elements of K and V from `offset` on, ahead of their use.
inline void Prefetch(const Problem& pb, int64_t offset, int64_t n) {
#if JE_X86
  const int64_t item = pb.bf16 ? 2 : 4;
  const char* k = static_cast<const char*>(pb.k) + offset * item;
  const char* v = static_cast<const char*>(pb.v) + offset * item;
  for (int64_t b = 0; b < n * item; b += 64) {
    _mm_prefetch(k + b, _MM_HINT_T0);
    _mm_prefetch(v + b, _MM_HINT_T0);
  }
#endif
}

inline void RunTask(const Problem& pb, const Task& task, Scratch& ws) {
  const Block& b = pb.blocks[task.block];
  const std::vector<int>& heads = pb.groups[task.kv_head];
  const int64_t G = static_cast<int64_t>(heads.size()), D = pb.D, O = pb.O;
  const int64_t rows = b.num_rows * G;
  ws.Reserve(rows, D, O);
  for (int64_t r = 0; r < b.num_rows; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const float* src = pb.q + ((b.first_token + r) * pb.H + heads[g]) * D;
      float* dst = ws.q.data() + (r * G + g) * D;
      for (int64_t c = 0; c < D; ++c) dst[c] = src[c] * pb.sm_scale;
    }
  }
  std::fill(ws.m.begin(), ws.m.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(ws.l.begin(), ws.l.begin() + rows, 0.0f);
  std::fill(ws.acc.begin(), ws.acc.begin() + rows * D, 0.0f);

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
    const float* keys = PageRows(pb, pb.k, offset, j1 - j0, ws.k.data());
    const float* values = PageRows(pb, pb.v, offset, j1 - j0, ws.v.data());
    for (int64_t r = 0; r < b.num_rows; ++r) {
      const int64_t pos = pb.positions[b.first_token + r];
      // This row's visible keys within the page: [pos - window + 1, pos].
      const int64_t lo = std::max(j0, pos - pb.window + 1 - page_start);
      const int64_t hi = std::min(j1, pos + 1 - page_start);
      if (lo >= hi) continue;
      const int64_t n = hi - lo;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = r * G + g;
        float* s = ws.s.data();
        const float* qi = ws.q.data() + i * D;
        Scores(qi, keys + (lo - j0) * D, n, D, s);
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
        AccumulateValues(ws.acc.data() + i * D, alpha, s, values + (lo - j0) * D, n, D);
      }
    }
  }
  FinishTask(pb, task, ws);
}
