// Prefill attention on the AMX tiles, for a bf16 cache and bf16 queries (a bf16 model): included
// by paged_attention.cc after its Problem, Task and Scratch, and run for the tasks of prefill
// blocks when the call asks for it (isa kAmx); decode rows keep the vector paths.
//
// Why: the vector path widens every bf16 key and value to f32 and spends an FMA a lane on each
// product, so a 1,500-token prompt spent most of its first token in attention (docs/kernels.md,
// "Prefill blocks on the AMX tiles"). Here QK^T and PV are TDPBF16PS products (bf16 in, f32
// sums) and only the softmax runs on the vector units.
//
// Layouts. Before the tasks run, each prefill sequence's visible keys are staged once per call
// (`Stage`), per kv head in chunks of 64 keys: K as the B tiles of S = Q K^T and V as the B
// tiles of O += P V (StageChunk says how). Every query block of the sequence then loads its
// tiles straight from the stage instead of transposing K and V again. A task's query vectors
// (row i = token r, head g, i = r * G + g, as the vector paths order them) are rounded to bf16
// once, 16 rows an A tile.
//
// Per chunk and 16 rows: S [16, 64] in C tiles 0-3 -> memory; scaled, soft-capped, masked (keys
// outside a row's visible range get probability exactly 0; chunks every row sees in full skip
// the masks); the online softmax's max and sum per row; P rounded to bf16 (two A tiles); P V
// into C tiles 0-3 (four 16-dim column tiles a pass); acc = alpha acc + P V in f32 on the
// vector units. P in bf16 is what flash attention does on bf16 hardware: the result matches the
// f32 path to bf16 rounding, not bit for bit.
//
// Measured (docs/kernels.md, "Prefill blocks on the AMX tiles"): a 512-token chunk over 1,000 cached
// tokens, one layer, 7.0 -> 2.3-2.5 ms; of that ~0.8 ms is the softmax's vector work, ~0.2 ms
// the staging.

#ifndef JENGINE_AMX_ATTENTION_H_
#define JENGINE_AMX_ATTENTION_H_

#if defined(__x86_64__)

// Needs amx_tiles.h, included by paged_attention.cc outside its namespaces.

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")

namespace amx_attention {

using amx::kTileRows;
constexpr int64_t kChunk = 64;  // keys a pass: four C tiles of scores, two A tiles of P

// Where kv head `kv_head`'s staged K (which 0) or V (which 1) of sequence `seq` begins.
inline uint16_t* Staged(const Problem& pb, int64_t seq, int64_t kv_head, int which) {
  const Staging& st = pb.staging;
  return st.data + st.offset[seq] + (kv_head * 2 + which) * st.chunks[seq] * kChunk * pb.D;
}

// One chunk of 64 keys of one kv head from key position `key0`, keys outside [lo, hi) as zeros
// (never visible, and finite where a probability of 0 multiplies them):
//   K: dims [32 db, 32 db + 32) of keys [16 q, 16 q + 16) -> tile db * 4 + q, whose row j is
//      dim pair 32 db + 2j and column n key 16 q + n (a 32-bit scatter a key and 32 dims);
//   V: dims [16 t, 16 t + 16) of keys [32 h, 32 h + 32) -> tile h * D / 16 + t, whose row p
//      holds keys 32 h + 2p and 32 h + 2p + 1 interleaved (two keys' rows, two permutes).
inline void StageChunk(const Problem& pb, int64_t seq, int64_t kv_head, int64_t chunk,
                       int64_t lo, int64_t hi) {
  const int64_t D = pb.D, O = pb.O, key0 = pb.staging.base[seq] + chunk * kChunk;
  const int32_t* table = pb.page_table + seq * pb.max_pages;
  const int64_t head_base = (pb.layer * pb.K + kv_head) * pb.P;
  const uint16_t* k_rows[kChunk];
  const uint16_t* v_rows[kChunk];
  for (int64_t n = 0; n < kChunk; ++n) {
    const int64_t pos = key0 + n;
    k_rows[n] = v_rows[n] = nullptr;
    if (pos >= lo && pos < hi) {
      const int64_t page = std::min<int64_t>(std::max<int32_t>(table[pos / O], 0), pb.P - 1);
      const int64_t at = ((head_base + page) * O + pos % O) * D;
      k_rows[n] = static_cast<const uint16_t*>(pb.k) + at;
      v_rows[n] = static_cast<const uint16_t*>(pb.v) + at;
    }
  }
  auto load = [](const uint16_t* row, int64_t at) {
    return row ? _mm512_loadu_si512(row + at) : _mm512_setzero_si512();
  };
  int32_t* kt = reinterpret_cast<int32_t*>(Staged(pb, seq, kv_head, 0) + chunk * kChunk * D);
  const __m512i rows16 = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(16));
  for (int64_t n = 0; n < kChunk; ++n) {
    for (int64_t db = 0; db < D / 32; ++db) {
      _mm512_i32scatter_epi32(kt + (db * 4 + n / 16) * 256 + n % 16, rows16,
                              load(k_rows[n], db * 32), 4);
    }
  }
  uint16_t* vt = Staged(pb, seq, kv_head, 1) + chunk * kChunk * D;
  alignas(64) int16_t first[32], second[32];
  for (int i = 0; i < 16; ++i) {  // (a[i], b[i]) pairs from the low and the high 16 of each
    first[2 * i] = static_cast<int16_t>(i);
    first[2 * i + 1] = static_cast<int16_t>(32 + i);
    second[2 * i] = static_cast<int16_t>(16 + i);
    second[2 * i + 1] = static_cast<int16_t>(48 + i);
  }
  const __m512i lo_pairs = _mm512_load_si512(first), hi_pairs = _mm512_load_si512(second);
  for (int64_t p = 0; p < kChunk / 2; ++p) {
    for (int64_t u = 0; u < D / 32; ++u) {
      const __m512i a = load(v_rows[2 * p], u * 32), b = load(v_rows[2 * p + 1], u * 32);
      uint16_t* row = vt + ((p / 16) * (D / 16) + 2 * u) * 512 + (p % 16) * 32;
      _mm512_storeu_si512(row, _mm512_permutex2var_epi16(a, lo_pairs, b));
      _mm512_storeu_si512(row + 512, _mm512_permutex2var_epi16(a, hi_pairs, b));
    }
  }
}

// Every key range a prefill block (Takes) of each sequence can see, staged: sizes the stage (a buffer
// of this thread's kept between calls, so its pages are not faulted in again each layer), then
// fills it over the pool, a few chunks an item.
inline void Stage(Problem& pb, xla::ffi::ThreadPool& pool, int64_t threads, int64_t num_seqs) {
  Staging& st = pb.staging;
  std::vector<int64_t> lo(num_seqs, std::numeric_limits<int64_t>::max()), hi(num_seqs, 0);
  for (const Block& b : pb.blocks) {
    if (b.num_rows < kPrefillRows || b.key_hi <= b.key_lo) continue;  // as Takes
    lo[b.seq] = std::min(lo[b.seq], b.key_lo);
    hi[b.seq] = std::max(hi[b.seq], b.key_hi);
  }
  st.base.assign(num_seqs, -1);
  st.chunks.assign(num_seqs, 0);
  st.offset.assign(num_seqs, 0);
  int64_t total = 0;
  struct Item { int64_t seq, kv_head, first, last; };
  std::vector<Item> items;
  constexpr int64_t kChunksPerItem = 4;
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (hi[s] <= lo[s]) continue;
    st.base[s] = lo[s] / kChunk * kChunk;
    st.chunks[s] = (hi[s] - st.base[s] + kChunk - 1) / kChunk;
    st.offset[s] = total;
    total += 2 * pb.K * st.chunks[s] * kChunk * pb.D;
    for (int64_t k = 0; k < pb.K; ++k) {
      for (int64_t c = 0; c < st.chunks[s]; c += kChunksPerItem) {
        items.push_back({s, k, c, std::min(c + kChunksPerItem, st.chunks[s])});
      }
    }
  }
  thread_local std::vector<uint16_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < total + 32) buffer.resize(total + 32);
  st.data = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) &
                                        ~uintptr_t{63});
  ParallelFor(pool, static_cast<int64_t>(items.size()), threads, [&](int64_t i, int64_t) {
    const Item& it = items[i];
    for (int64_t c = it.first; c < it.last; ++c) {
      StageChunk(pb, it.seq, it.kv_head, c, lo[it.seq], hi[it.seq]);
    }
  });
}

// Whether a task runs here: a prefill block (kPrefillRows), whose keys are staged.
inline bool Takes(const Problem& pb, const Task& task) {
  const Block& b = pb.blocks[task.block];
  // Prefill blocks only: a speculative verification's rows keep the row path, which gives a
  // decode's bits (the tiles round q and the probabilities to bf16).
  return pb.amx && b.num_rows >= kPrefillRows && pb.staging.base[b.seq] >= 0;
}

// Scores of one chunk: s [16, 64] f32 = qa (16 rows of D bf16) . the chunk's staged keys.
inline void ChunkScores(const uint16_t* qa, const uint16_t* kt, int64_t D, float* s) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t db = 0; db < D / 32; ++db) {
    const uint16_t* b = kt + db * 4 * 512;
    _tile_loadd(4, qa + db * 32, D * 2);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b + 512, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, b + 1024, 64);
    _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(7, b + 1536, 64);
    _tile_dpbf16ps(3, 4, 7);
  }
  _tile_stored(0, s, kChunk * 4);
  _tile_stored(1, s + 16, kChunk * 4);
  _tile_stored(2, s + 32, kChunk * 4);
  _tile_stored(3, s + 48, kChunk * 4);
}

// pv [16, D] = p [16, 64] (bf16; keys 0-31 and 32-63 two A tiles) . the chunk's staged values,
// up to four 16-dim column tiles a pass (D % 32 == 0: two or four).
inline void ChunkValues(const uint16_t* p, const uint16_t* vt, int64_t D, float* pv) {
  const int64_t half = (D / 16) * 512;  // the second 32 keys' tiles
  _tile_loadd(4, p, kChunk * 2);
  _tile_loadd(5, p + 32, kChunk * 2);
  for (int64_t c = 0; c < D / 16; c += 4) {
    const uint16_t* b = vt + c * 512;
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b + half, 64);
    _tile_dpbf16ps(0, 5, 7);
    _tile_loadd(6, b + 512, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, b + half + 512, 64);
    _tile_dpbf16ps(1, 5, 7);
    _tile_stored(0, pv + c * 16, D * 4);
    _tile_stored(1, pv + (c + 1) * 16, D * 4);
    if (c + 4 <= D / 16) {
      _tile_zero(2);
      _tile_zero(3);
      _tile_loadd(6, b + 1024, 64);
      _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(7, b + half + 1024, 64);
      _tile_dpbf16ps(2, 5, 7);
      _tile_loadd(6, b + 1536, 64);
      _tile_dpbf16ps(3, 4, 6);
      _tile_loadd(7, b + half + 1536, 64);
      _tile_dpbf16ps(3, 5, 7);
      _tile_stored(2, pv + (c + 2) * 16, D * 4);
      _tile_stored(3, pv + (c + 3) * 16, D * 4);
    }
  }
}

// 2^t for t <= 0 to ~3e-6 relative (t = n + f, |f| <= 1/2, a degree-5 polynomial for 2^f and
// vscalefps for 2^n): finer than the bf16 rounding of the probabilities it makes. Finite t
// below -150 gives 0; -inf gives NaN (callers clamp where it can occur).
inline __m512 Pow2(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);  // ln(2)^k / k!, k = 5 .. 1
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The online-softmax step of 16 rows over one chunk from `key0`: s [16, 64] raw scores (q . k)
// in, p [16, 64] bf16 probabilities out; m and l (16 each, in scaled scores) updated, alpha
// (16) the factor for acc. Without a soft cap the raw scores need no pass of their own: the
// row max of s times the (positive) scale is that of the scaled scores, and exp(scale s - m) =
// 2^(s scale log2(e) - m log2(e)) is one FMA from s. `full`: every row sees every key of the
// chunk, so no mask is made; a row's values are the same either way (its mask would keep
// every key), so they do not depend on which rows share its tile.
inline void ChunkSoftmax(const Problem& pb, int64_t key0, const int32_t* lo, const int32_t* hi,
                         bool full, float* s, uint16_t* p, float* m, float* l, float* alpha) {
  constexpr float kLog2e = 1.44269504088896341f;
  const bool capped = pb.soft_cap > 0.0f;
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 masked = _mm512_set1_ps(avx512::kMasked);
  __mmask16 vis[kTileRows][4];
  alignas(64) float row_max[kTileRows];
  for (int64_t r = 0; r < kTileRows; ++r) {
    float* sr = s + r * kChunk;
    __m512 x[4];
    for (int q = 0; q < 4; ++q) x[q] = _mm512_loadu_ps(sr + 16 * q);
    if (capped) {  // Gemma 2's cap * tanh(scale s / cap): rare enough for libm
      alignas(64) float c[kChunk];
      for (int q = 0; q < 4; ++q) _mm512_store_ps(c + 16 * q, x[q]);
      for (float& v : c) v = pb.soft_cap * std::tanh(v * pb.sm_scale / pb.soft_cap);
      for (int q = 0; q < 4; ++q) {
        x[q] = _mm512_load_ps(c + 16 * q);
        _mm512_storeu_ps(sr + 16 * q, x[q]);
      }
    }
    __m512 mx = masked;
    if (full) {
      mx = _mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3]));
    } else {  // the max over the keys in [lo, hi)
      const __m512i vlo = _mm512_set1_epi32(lo[r]), vhi = _mm512_set1_epi32(hi[r]);
      for (int q = 0; q < 4; ++q) {
        const __m512i keys = _mm512_add_epi32(iota, _mm512_set1_epi32(key0 + 16 * q));
        vis[r][q] = _mm512_cmpge_epi32_mask(keys, vlo) & _mm512_cmplt_epi32_mask(keys, vhi);
        mx = _mm512_mask_max_ps(mx, vis[r][q], mx, x[q]);
      }
    }
    row_max[r] = _mm512_reduce_max_ps(mx);
  }
  const __m512 m_old = _mm512_loadu_ps(m);
  __m512 chunk_max = _mm512_load_ps(row_max);  // kMasked where a row sees none of the keys
  if (!capped) {
    chunk_max = _mm512_mask_mul_ps(chunk_max, _mm512_cmp_ps_mask(chunk_max, masked, _CMP_GT_OQ),
                                   chunk_max, _mm512_set1_ps(pb.sm_scale));
  }
  const __m512 m_new = _mm512_max_ps(m_old, chunk_max);
  // m_old is -inf before a row's first chunk: clamped, its factor is 0 (acc is 0 anyway).
  _mm512_storeu_ps(alpha, Pow2(_mm512_max_ps(
      _mm512_mul_ps(_mm512_sub_ps(m_old, m_new), _mm512_set1_ps(kLog2e)),
      _mm512_set1_ps(-200.0f))));
  _mm512_storeu_ps(m, m_new);
  alignas(64) float m_rows[kTileRows], sums[kTileRows];
  _mm512_store_ps(m_rows, _mm512_mul_ps(m_new, _mm512_set1_ps(kLog2e)));
  const __m512 slope = _mm512_set1_ps(capped ? kLog2e : pb.sm_scale * kLog2e);
  for (int64_t r = 0; r < kTileRows; ++r) {
    const __m512 mr = _mm512_set1_ps(m_rows[r]);
    const float* sr = s + r * kChunk;
    __m512 e[4];
    for (int q = 0; q < 4; ++q) {  // masked lanes zeroed (they are finite scores)
      e[q] = Pow2(_mm512_fmsub_ps(_mm512_loadu_ps(sr + 16 * q), slope, mr));
      if (!full) e[q] = _mm512_maskz_mov_ps(vis[r][q], e[q]);
    }
    sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(e[0], e[1]),
                                                 _mm512_add_ps(e[2], e[3])));
    const __m512bh lo_keys = _mm512_cvtne2ps_pbh(e[1], e[0]);  // e[0]'s 16 first, then e[1]'s
    const __m512bh hi_keys = _mm512_cvtne2ps_pbh(e[3], e[2]);
    _mm512_storeu_si512(p + r * kChunk, reinterpret_cast<const __m512i&>(lo_keys));
    _mm512_storeu_si512(p + r * kChunk + 32, reinterpret_cast<const __m512i&>(hi_keys));
  }
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), _mm512_loadu_ps(alpha),
                                      _mm512_load_ps(sums)));
}

inline void RunTask(const Problem& pb, const Task& task, Scratch& ws) {
  const Block& b = pb.blocks[task.block];
  const std::vector<int>& heads = pb.groups[task.kv_head];
  const int64_t G = static_cast<int64_t>(heads.size()), D = pb.D, rows = b.num_rows * G;
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows, padded = tiles * kTileRows;
  ws.Reserve(padded, D, pb.O);
  ws.ReserveAmx(padded, D);
  uint16_t* qb = ws.qb.data();
  for (int64_t i = 0; i < padded; ++i) {  // bf16 query rows and each row's visible keys
    uint16_t* dst = qb + i * D;
    if (i >= rows) {
      std::fill(dst, dst + D, uint16_t{0});
      ws.lo[i] = 1;
      ws.hi[i] = 0;
      continue;
    }
    const float* src = pb.q + ((b.first_token + i / G) * pb.H + heads[i % G]) * D;
    for (int64_t c = 0; c < D; c += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + c));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c), reinterpret_cast<const __m256i&>(h));
    }
    const int64_t pos = pb.positions[b.first_token + i / G];
    ws.lo[i] = static_cast<int32_t>(std::max(task.key_lo, pos - pb.window + 1));
    ws.hi[i] = static_cast<int32_t>(std::min(task.key_hi, pos + 1));
  }
  std::fill(ws.m.begin(), ws.m.begin() + padded, -std::numeric_limits<float>::infinity());
  std::fill(ws.l.begin(), ws.l.begin() + padded, 0.0f);
  std::fill(ws.acc.begin(), ws.acc.begin() + padded * D, 0.0f);
  const int64_t base = pb.staging.base[b.seq];
  const uint16_t* k_stage = Staged(pb, b.seq, task.kv_head, 0);
  const uint16_t* v_stage = Staged(pb, b.seq, task.kv_head, 1);
  amx::Configure();
  for (int64_t c = (task.key_lo - base) / kChunk; base + c * kChunk < task.key_hi; ++c) {
    const int64_t key0 = base + c * kChunk;
    for (int64_t t = 0; t < tiles; ++t) {
      const int32_t* lo = ws.lo.data() + t * kTileRows;
      const int32_t* hi = ws.hi.data() + t * kTileRows;
      if (*std::min_element(lo, lo + kTileRows) >= key0 + kChunk ||
          *std::max_element(hi, hi + kTileRows) <= key0) {
        continue;  // no row of this tile sees a key of the chunk
      }
      const bool full = *std::max_element(lo, lo + kTileRows) <= key0 &&
                        *std::min_element(hi, hi + kTileRows) >= key0 + kChunk;
      ChunkScores(qb + t * kTileRows * D, k_stage + c * kChunk * D, D, ws.s32.data());
      alignas(64) float alpha[kTileRows];
      ChunkSoftmax(pb, key0, lo, hi, full, ws.s32.data(), ws.p16.data(), ws.m.data() + t * kTileRows,
                   ws.l.data() + t * kTileRows, alpha);
      ChunkValues(ws.p16.data(), v_stage + c * kChunk * D, D, ws.pv.data());
      for (int64_t r = 0; r < kTileRows; ++r) {
        float* acc = ws.acc.data() + (t * kTileRows + r) * D;
        const float* pv = ws.pv.data() + r * D;
        const __m512 a = _mm512_set1_ps(alpha[r]);
        for (int64_t d = 0; d < D; d += 16) {
          _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(_mm512_loadu_ps(acc + d), a,
                                                    _mm512_loadu_ps(pv + d)));
        }
      }
    }
  }
  _tile_release();
  FinishTask(pb, task, ws);
}

}  // namespace amx_attention

#pragma GCC pop_options

#endif  // __x86_64__
#endif  // JENGINE_AMX_ATTENTION_H_
