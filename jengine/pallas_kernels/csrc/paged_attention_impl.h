// The per-task kernel of paged_attention.cc, compiled once per instruction set: the including
// file defines JE_SIMD (0 portable, 1 AVX2+FMA) and wraps this file in its own namespace, under
// `#pragma GCC target("avx2,fma")` for the AVX2 copy. No include guard on purpose.
//
// One task: the query rows of one block (consecutive tokens of one sequence) and the q heads of
// one kv head, over a range of key positions. Each row's visible keys are contiguous (causal and
// sliding window), so no mask is materialised: each row visits only its own key range, page by
// page, straight from the cache, with an online softmax in f32.

#if JE_SIMD
inline float HorizontalSum(__m256 x) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// exp(x) for x <= 0 (scores minus their running max): Cody-Waite range reduction and a degree-6
// polynomial, ~1 ulp; inputs below -87 give ~1e-38, which is 0 next to the max's 1.
inline __m256 Exp(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                                23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

inline float Dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.0f;
#if JE_SIMD
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  }
  sum = HorizontalSum(_mm256_add_ps(acc0, acc1));
#else
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // eight partial sums: the compiler's SLP vectorises
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) part[j] += a[i + j] * b[i + j];
  }
  sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// s[j] = exp(s[j] - m) for j < n; returns their sum.
inline float ExpShifted(float* s, float m, int64_t n) {
  int64_t j = 0;
  float sum = 0.0f;
#if JE_SIMD
  __m256 vm = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    __m256 e = Exp(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = HorizontalSum(acc);
#endif
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
}

#if JE_SIMD
// s[j] = q . k_j for n keys (rows of length d), four keys per pass so that one horizontal
// reduction serves four dot products.
inline void Scores(const float* q, const float* k, int64_t n, int64_t d, float* s) {
  int64_t j = 0;
  if (d % 8 == 0) {
    for (; j + 4 <= n; j += 4) {
      const float* k0 = k + j * d;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t c = 0; c < d; c += 8) {
        const __m256 x = _mm256_loadu_ps(q + c);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + c), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + d + c), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + 2 * d + c), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + 3 * d + c), a3);
      }
      // hadd(hadd(a0, a1), hadd(a2, a3)) holds the four sums split over the two 128-bit lanes.
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      _mm_storeu_ps(s + j, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
  }
  for (; j < n; ++j) s[j] = Dot(q, k + j * d, d);
}

// acc[:8 NC] = alpha * acc + sum_j p[j] v[j, :8 NC], the NC accumulators held in registers so
// that the FMA chains of different columns overlap.
template <int NC>
inline void AccumulateColumns(float* acc, __m256 alpha, const float* p, const float* v,
                              int64_t n, int64_t d) {
  __m256 a[NC];
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) a[c] = _mm256_mul_ps(alpha, _mm256_loadu_ps(acc + 8 * c));
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* vj = v + j * d;
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * c), a[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}
#else
inline void Scores(const float* q, const float* k, int64_t n, int64_t d, float* s) {
  for (int64_t j = 0; j < n; ++j) s[j] = Dot(q, k + j * d, d);
}
#endif

// acc[:d] = alpha * acc[:d] + sum_j p[j] * v[j, :d]  (v rows of length d, n of them).
inline void AccumulateValues(float* acc, float alpha, const float* p, const float* v, int64_t n,
                             int64_t d) {
  int64_t c = 0;
#if JE_SIMD
  const __m256 va = _mm256_set1_ps(alpha);
  for (; c + 64 <= d; c += 64) AccumulateColumns<8>(acc + c, va, p, v + c, n, d);
  if (c + 32 <= d) {
    AccumulateColumns<4>(acc + c, va, p, v + c, n, d);
    c += 32;
  }
  if (c + 16 <= d) {
    AccumulateColumns<2>(acc + c, va, p, v + c, n, d);
    c += 16;
  }
  if (c + 8 <= d) {
    AccumulateColumns<1>(acc + c, va, p, v + c, n, d);
    c += 8;
  }
#endif
  for (; c < d; ++c) {
    float a = alpha * acc[c];
    for (int64_t j = 0; j < n; ++j) a += p[j] * v[j * d + c];
    acc[c] = a;
  }
}

inline void WidenBf16(float* dst, const uint16_t* src, int64_t n) {
  int64_t i = 0;
#if JE_SIMD
  for (; i + 8 <= n; i += 8) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
#endif
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
