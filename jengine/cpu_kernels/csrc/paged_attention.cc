// Ragged paged attention and the paged KV write for XLA:CPU, called through the XLA FFI.
//
// Layouts are the reference's (jengine/pallas_kernels/reference.py): q [T, H, D] f32, caches
// [L, K, P, O, D] f32, bf16 or int8 (with f32 scales [L, K, P, O, 1], one a row), page_table [S, Pmax], token_seq / positions [T]. Key slot s of a
// sequence holds position s, so a query at position p sees slots max(0, p - W + 1) .. p.
//
// Work split: consecutive tokens of one sequence form blocks of up to `block_q` rows; a
// (block, kv head) item runs that kv head's q heads together over the keys the block can see,
// reading pages in place; a decode-sized block's item runs as one task per chunk of 256 key
// positions (fixed positions, so a row's result does not depend on its batch), a prefill block's
// as one task, split over the threads when the items are too few. Tasks are shared out over
// XLA's intra-op thread pool, or for a call of a few rows (decodes, a verification) right after
// the AMX projections over the caller and the SpinHelper's thread they left spinning
// (spin_helper.h: a pool thread woke too late to take its share of a short call), and the
// partial softmax states of split items merged afterwards. The
// instruction set (AVX-512F, AVX2+FMA or portable C++) is chosen at run time, or forced by the
// `isa` attribute.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "amx_tiles.h"
#include "bf16.h"
#include "isa.h"
#include "parallel_for.h"
#include "spin_helper.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jengine {
namespace {

// Key positions a task covers at most (rounded to whole pages): see MakeTasks.
constexpr int64_t kSplitKeys = 256;
// A block of this many query rows or more is a prefill block: it runs the paths that take its
// rows together (the vector tiles, the AMX tiles). Fewer rows (a decode, a speculative
// verification of up to 15 proposals: speculative.MAX_PROPOSAL) run each row alone, so that a
// row's bits do not depend on the rows beside it.
constexpr int64_t kPrefillRows = 17;
// Calls of up to this many query tokens split their tasks with the SpinHelper's thread when
// XLA's pool has two threads and the helper is awake (the AMX projections of as many rows just
// ran on it: amx_bf16.h).
constexpr int64_t kHelperTokens = 16;

struct Block {  // consecutive query tokens of one sequence
  int32_t seq;
  int64_t first_token, num_rows;
  int64_t key_lo, key_hi;  // key positions any row of the block can see: [key_lo, key_hi)
};

struct Task {  // one (block, kv head) item, or one key range of it
  int64_t block, kv_head;
  int64_t key_lo, key_hi;
  int64_t partial;  // -1: write the output; else the index of this task's partial state
  int64_t cost;
};

enum class KvType { kF32, kBf16, kInt8 };  // int8: rows times one f32 scale each

// The AMX path's keys and values of each prefill sequence in the tiles' layouts
// (amx_attention.h): per sequence from key position base (a multiple of 64), chunks of 64 keys,
// at offset (in bf16 elements) within data.
struct Staging {
  std::vector<int64_t> base, chunks, offset;  // [num_seqs]; base -1: nothing staged
  uint16_t* data = nullptr;  // 64-byte aligned, in a buffer of the calling thread's
};

struct Problem {
  const float* q;
  const void* k;
  const void* v;
  KvType kv_type;
  int64_t item;  // bytes of a cache element
  const float* k_scale;  // int8: [L, K, P, O], one per row of D; else unused
  const float* v_scale;
  const int32_t* positions;
  const int32_t* page_table;
  int64_t T, H, D, K, P, O, max_pages;
  int64_t layer, window;
  float sm_scale, soft_cap;
  const float* sinks = nullptr;  // [H] gpt-oss's sink logits, or none
  std::vector<std::vector<int>> groups;  // [K] q heads of each kv head
  std::vector<Block> blocks;
  bool amx = false;  // prefill blocks on the AMX tiles (bf16 cache and queries)
  Staging staging;
  float* out;
  // Partial softmax states of split items: per partial, rows * (2 + D) floats at offset[i].
  std::vector<int64_t> partial_offset;
  std::vector<float> partials;
};

struct Scratch {  // one worker's buffers
  std::vector<float> q, m, l, acc, s, k, v;
  // The tiled path's: Qt [D, lanes], scores / probabilities [O, lanes], per lane the factor
  // for acc and the row's position, per vector of lanes their least and greatest position.
  std::vector<float> qt, st, alpha, lane_pos;
  std::vector<int64_t> lane_min_pos, lane_max_pos;
  // The AMX path's: bf16 query rows, each row's visible key range [lo, hi), one chunk's scores,
  // probabilities (bf16) and P V.
  std::vector<uint16_t> qb, p16;
  std::vector<int32_t> lo, hi;
  std::vector<float> s32, pv;
  void ReserveAmx(int64_t rows, int64_t d) {
    if (static_cast<int64_t>(lo.size()) < rows) {
      qb.resize(rows * d);
      lo.resize(rows);
      hi.resize(rows);
    }
    if (static_cast<int64_t>(pv.size()) < 16 * d) {
      s32.resize(16 * 64);
      p16.resize(16 * 64);
      pv.resize(16 * d);
    }
  }
  void Reserve(int64_t rows, int64_t d, int64_t page_size) {
    if (static_cast<int64_t>(m.size()) < rows) {
      q.resize(rows * d);
      m.resize(rows);
      l.resize(rows);
      acc.resize(rows * d);
    }
    if (static_cast<int64_t>(s.size()) < page_size) {
      s.resize(page_size);
      k.resize(page_size * d);
      v.resize(page_size * d);
    }
  }
  void ReserveLanes(int64_t lanes, int64_t d, int64_t page_size) {
    if (static_cast<int64_t>(alpha.size()) < lanes) {
      qt.resize(lanes * d);
      alpha.resize(lanes);
      lane_pos.resize(lanes);
      lane_min_pos.resize(lanes);
      lane_max_pos.resize(lanes);
    }
    if (static_cast<int64_t>(st.size()) < lanes * page_size) st.resize(lanes * page_size);
  }
};

// The factor that turns a row's accumulated values into its output: 1 / l, or with a sink
// logit s for the head (gpt-oss), exp(m - t) / (l exp(m - t) + exp(s - t)) for t = max(m, s):
// the sink joins the softmax's denominator and weighs no value. 0 for a row that saw no key.
inline float OutputScale(const Problem& pb, int head, float m, float l) {
  if (pb.sinks == nullptr) return l > 0.0f ? 1.0f / l : 0.0f;
  if (!(l > 0.0f)) return 0.0f;
  const float s = pb.sinks[head], top = std::max(m, s);
  const float keep = std::exp(m - top);
  return keep / (l * keep + std::exp(s - top));
}

// Normalises a task's rows into the output, or stores its partial state for the merge.
void FinishTask(const Problem& pb, const Task& task, const Scratch& ws) {
  const Block& b = pb.blocks[task.block];
  const std::vector<int>& heads = pb.groups[task.kv_head];
  const int64_t G = static_cast<int64_t>(heads.size()), D = pb.D, rows = b.num_rows * G;
  if (task.partial >= 0) {
    float* dst = const_cast<float*>(pb.partials.data()) + pb.partial_offset[task.partial];
    std::memcpy(dst, ws.m.data(), rows * sizeof(float));
    std::memcpy(dst + rows, ws.l.data(), rows * sizeof(float));
    std::memcpy(dst + 2 * rows, ws.acc.data(), rows * D * sizeof(float));
    return;
  }
  for (int64_t r = 0; r < b.num_rows; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = r * G + g;
      const float inv = OutputScale(pb, heads[g], ws.m[i], ws.l[i]);
      float* dst = pb.out + ((b.first_token + r) * pb.H + heads[g]) * D;
      for (int64_t c = 0; c < D; ++c) dst[c] = ws.acc[i * D + c] * inv;
    }
  }
}

#define JE_IMPL_HEADER "paged_attention_impl.h"
#include "per_isa.h"
#undef JE_IMPL_HEADER

#include "amx_attention.h"

using TaskFn = void (*)(const Problem&, const Task&, Scratch&);

// Whether the AMX prefill path runs here: the tiles, and the process allowed to use them.
bool AmxSupported() {
#if JE_X86
  return amx::Permitted();
#else
  return false;
#endif
}

// Merges the partial softmax states of each split item into the output.
void MergePartials(const Problem& pb, const std::vector<Task>& tasks) {
  std::vector<std::vector<int64_t>> by_item;  // task indices per (block, kv head) with partials
  std::vector<int64_t> item_of(pb.blocks.size() * pb.K, -1);
  for (int64_t t = 0; t < static_cast<int64_t>(tasks.size()); ++t) {
    if (tasks[t].partial < 0) continue;
    int64_t key = tasks[t].block * pb.K + tasks[t].kv_head;
    if (item_of[key] < 0) {
      item_of[key] = static_cast<int64_t>(by_item.size());
      by_item.emplace_back();
    }
    by_item[item_of[key]].push_back(t);
  }
  for (auto& parts : by_item) {  // in key order, whatever order the tasks ran in
    std::sort(parts.begin(), parts.end(),
              [&](int64_t a, int64_t b) { return tasks[a].key_lo < tasks[b].key_lo; });
  }
  const int64_t D = pb.D;
  std::vector<float> acc(D);
  for (const auto& parts : by_item) {
    const Task& first = tasks[parts[0]];
    const Block& b = pb.blocks[first.block];
    const std::vector<int>& heads = pb.groups[first.kv_head];
    const int64_t G = static_cast<int64_t>(heads.size()), rows = b.num_rows * G;
    for (int64_t i = 0; i < rows; ++i) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t t : parts) m = std::max(m, pb.partials[pb.partial_offset[tasks[t].partial] + i]);
      float l = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      if (m > -std::numeric_limits<float>::infinity()) {
        for (int64_t t : parts) {
          const float* st = pb.partials.data() + pb.partial_offset[tasks[t].partial];
          const float w = std::exp(st[i] - m);
          l += w * st[rows + i];
          const float* a = st + 2 * rows + i * D;
          for (int64_t c = 0; c < D; ++c) acc[c] += w * a[c];
        }
      }
      const int64_t r = i / G, g = i % G;
      const float inv = OutputScale(pb, heads[g], m, l);
      float* dst = pb.out + ((b.first_token + r) * pb.H + heads[g]) * D;
      for (int64_t c = 0; c < D; ++c) dst[c] = acc[c] * inv;
    }
  }
}

// Groups consecutive tokens of one sequence at consecutive positions into blocks of at most
// `block_q` rows.
void MakeBlocks(Problem& pb, const int32_t* token_seq, int64_t num_seqs, int64_t block_q) {
  const int64_t max_keys = pb.max_pages * pb.O;
  for (int64_t t = 0; t < pb.T;) {
    const int32_t seq = std::min<int32_t>(std::max<int32_t>(token_seq[t], 0),
                                          static_cast<int32_t>(num_seqs - 1));
    int64_t end = t + 1;
    // A block is a run of consecutive positions: bucket padding (token_seq 0, position 0)
    // after a sequence's rows must not join its block and turn a decode into a prefill block.
    while (end < pb.T && end - t < block_q && token_seq[end] == token_seq[t] &&
           pb.positions[end] == pb.positions[end - 1] + 1) {
      ++end;
    }
    int64_t lo_pos = pb.positions[t], hi_pos = pb.positions[t];
    for (int64_t u = t; u < end; ++u) {
      lo_pos = std::min<int64_t>(lo_pos, pb.positions[u]);
      hi_pos = std::max<int64_t>(hi_pos, pb.positions[u]);
    }
    Block b{seq, t, end - t, std::max<int64_t>(0, lo_pos - pb.window + 1),
            std::min<int64_t>(hi_pos + 1, max_keys)};
    pb.blocks.push_back(b);
    t = end;
  }
}

// Tasks: for a block of fewer than kPrefillRows rows (decodes, verifications), one per kv head and
// chunk of kSplitKeys key positions it can see. The chunks start at fixed key positions
// (multiples of kSplitKeys), whatever the batch, the block's other rows or the thread count, so
// such a row's keys are summed in the same pieces and merged in the same order wherever it runs:
// a verification's rows give a decode's bits (chunks a row cannot see merge as exact zeros).
// Splitting them by the thread count instead had made a row's last bits depend on its block's
// extent and on the batch, which bf16 activations turned into other tokens under speculation
// (docs/engine.md). Prefill blocks take their paths' own rounding anyway, so each is one task
// per kv head, split into equal key ranges only when the items are too few for the threads.
std::vector<Task> MakeTasks(Problem& pb, int64_t threads) {
  constexpr int64_t kMinSplitPages = 4;
  const int64_t chunk = std::max<int64_t>(1, kSplitKeys / pb.O) * pb.O;  // whole pages
  std::vector<Task> tasks, prefill;
  int64_t num_partials = 0, partial_floats = 0;
  auto add = [&](Task task, bool partial) {
    if (partial) {
      task.partial = num_partials++;
      pb.partial_offset.push_back(partial_floats);
      partial_floats += pb.blocks[task.block].num_rows *
                        static_cast<int64_t>(pb.groups[task.kv_head].size()) * (2 + pb.D);
    }
    tasks.push_back(task);
  };
  for (int64_t b = 0; b < static_cast<int64_t>(pb.blocks.size()); ++b) {
    const Block& blk = pb.blocks[b];
    if (blk.key_hi <= blk.key_lo) continue;
    const int64_t first = blk.key_lo / chunk, last = (blk.key_hi - 1) / chunk;
    for (int64_t k = 0; k < pb.K; ++k) {
      const int64_t rows = blk.num_rows * static_cast<int64_t>(pb.groups[k].size());
      if (rows == 0) continue;
      if (blk.num_rows >= kPrefillRows) {
        prefill.push_back({b, k, blk.key_lo, blk.key_hi, -1, rows * (blk.key_hi - blk.key_lo)});
        continue;
      }
      for (int64_t c = first; c <= last; ++c) {
        Task task{b, k, std::max(blk.key_lo, c * chunk), std::min(blk.key_hi, (c + 1) * chunk),
                  -1, 0};
        task.cost = rows * (task.key_hi - task.key_lo);
        add(task, first < last);
      }
    }
  }
  const int64_t items = static_cast<int64_t>(prefill.size() + tasks.size());
  for (const Task& item : prefill) {
    const int64_t first_page = item.key_lo / pb.O, last_page = (item.key_hi - 1) / pb.O;
    const int64_t pages = last_page - first_page + 1;
    int64_t splits = threads > 1 ? (8 * threads + items - 1) / items : 1;
    splits = std::max<int64_t>(1, std::min(splits, pages / kMinSplitPages));
    for (int64_t s = 0; s < splits; ++s) {
      const int64_t p0 = first_page + pages * s / splits, p1 = first_page + pages * (s + 1) / splits;
      Task part = item;
      if (splits > 1) {
        part.key_lo = std::max(item.key_lo, p0 * pb.O);
        part.key_hi = std::min(item.key_hi, p1 * pb.O);
        part.cost = item.cost / splits;
      }
      add(part, splits > 1);
    }
  }
  pb.partials.assign(partial_floats, 0.0f);
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });
  return tasks;
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                          ffi::AnyBuffer v_cache, ffi::Buffer<ffi::F32> k_scale,
                          ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> layer,
                          ffi::Buffer<ffi::S32> token_seq, ffi::Buffer<ffi::S32> positions,
                          ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> window,
                          ffi::Buffer<ffi::S32> kv_head_map, ffi::Buffer<ffi::F32> sinks,
                          float sm_scale, float soft_cap,
                          int32_t isa, int32_t block_q, int32_t max_threads,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto cd = k_cache.dimensions();
  if (qd.size() != 3 || cd.size() != 5 || page_table.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("paged attention: expected q [T,H,D], caches [L,K,P,O,D]");
  }
  const auto dtype = k_cache.element_type();
  if (dtype != v_cache.element_type() || (dtype != ffi::DataType::F32 &&
                                          dtype != ffi::DataType::BF16 &&
                                          dtype != ffi::DataType::S8)) {
    return ffi::Error::InvalidArgument("paged attention: caches must both be f32, bf16 or int8");
  }
  const int64_t rows = k_cache.element_count() / std::max<int64_t>(cd[4], 1);
  if (dtype == ffi::DataType::S8 &&
      (k_scale.element_count() != rows || v_scale.element_count() != rows)) {
    return ffi::Error::InvalidArgument("paged attention: int8 caches need one scale a row");
  }
  if (cd[4] != qd[2] || kv_head_map.element_count() != qd[1]) {
    return ffi::Error::InvalidArgument("paged attention: head_dim or kv_head_map mismatch");
  }
  if (sinks.element_count() != 0 && sinks.element_count() != qd[1]) {
    return ffi::Error::InvalidArgument("paged attention: sinks must be empty or one per q head");
  }
  Problem pb;
  pb.sinks = sinks.element_count() ? sinks.typed_data() : nullptr;
  pb.q = q.typed_data();
  pb.k = k_cache.untyped_data();
  pb.v = v_cache.untyped_data();
  pb.kv_type = dtype == ffi::DataType::BF16 ? KvType::kBf16
               : dtype == ffi::DataType::S8 ? KvType::kInt8 : KvType::kF32;
  pb.item = dtype == ffi::DataType::BF16 ? 2 : dtype == ffi::DataType::S8 ? 1 : 4;
  pb.k_scale = k_scale.typed_data();
  pb.v_scale = v_scale.typed_data();
  pb.positions = positions.typed_data();
  pb.page_table = page_table.typed_data();
  pb.T = qd[0];
  pb.H = qd[1];
  pb.D = qd[2];
  pb.K = cd[1];
  pb.P = cd[2];
  pb.O = cd[3];
  pb.max_pages = page_table.dimensions()[1];
  pb.layer = std::min<int64_t>(std::max<int32_t>(layer.typed_data()[0], 0), cd[0] - 1);
  pb.window = std::max<int32_t>(window.typed_data()[0], 1);
  pb.sm_scale = sm_scale;
  pb.soft_cap = soft_cap;
  pb.out = out->typed_data();
  pb.groups.assign(pb.K, {});
  for (int64_t h = 0; h < pb.H; ++h) {
    const int32_t kh = kv_head_map.typed_data()[h];
    if (kh < 0 || kh >= pb.K) return ffi::Error::InvalidArgument("paged attention: bad head map");
    pb.groups[kh].push_back(static_cast<int>(h));
  }
  std::memset(pb.out, 0, pb.T * pb.H * pb.D * sizeof(float));
  if (pb.T == 0) return ffi::Error::Success();

  if (isa == kAuto) isa = BestIsa();
  if (isa == kAmx) {
    if (!AmxSupported()) {
      return ffi::Error::InvalidArgument("paged attention: AMX-BF16 unsupported here");
    }
    pb.amx = pb.kv_type == KvType::kBf16 && pb.D % 32 == 0;
    isa = kAvx512;
  }
  if (!Supports(isa)) {
    return ffi::Error::InvalidArgument("paged attention: forced instruction set unsupported");
  }
  TaskFn run = portable::RunTask;
#if JE_X86
  if (isa == kAvx512) run = avx512::RunTask;
  if (isa == kAvx2) run = avx2::RunTask;
#endif
  const int64_t threads = KernelThreads(pool, max_threads);
  MakeBlocks(pb, token_seq.typed_data(), page_table.dimensions()[0],
             std::max<int32_t>(block_q, 1));
  const std::vector<Task> tasks = MakeTasks(pb, threads);
#if JE_X86
  if (pb.amx) amx_attention::Stage(pb, pool, threads, page_table.dimensions()[0]);
#endif
  std::vector<Scratch> scratch(threads);
  auto task = [&](int64_t i, int64_t worker) {
#if JE_X86
    if (amx_attention::Takes(pb, tasks[i])) {
      amx_attention::RunTask(pb, tasks[i], scratch[worker]);
      return;
    }
#endif
    run(pb, tasks[i], scratch[worker]);
  };
  const int64_t n = static_cast<int64_t>(tasks.size());
  if (threads == 2 && pb.T <= kHelperTokens && SpinHelper::Awake()) {
    SpinHelper::Get().Run(n, task);
  } else {
    ParallelFor(pool, n, threads, task);
  }
  MergePartials(pb, tasks);
  return ffi::Error::Success();
}

#if JE_X86
__attribute__((target("avx512f,avx512bf16"))) void RoundToBf16Avx512(const float* f, uint16_t* d,
                                                                      int64_t n) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {  // VCVTNEPS2BF16: nearest even, NaN stays NaN
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(f + c));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + c), reinterpret_cast<const __m256i&>(h));
  }
  for (; c < n; ++c) d[c] = F32ToBf16(f[c]);
}
#endif

// d[:n] = f[:n] rounded to bf16: a prefill chunk's K/V rows are ~0.2M values a layer, which the
// scalar loop spent ~0.4 ms on.
void RoundToBf16(const float* f, uint16_t* d, int64_t n) {
#if JE_X86
  static const bool vector = __builtin_cpu_supports("avx512bf16");
  if (vector) return RoundToBf16Avx512(f, d, n);
#endif
  for (int64_t c = 0; c < n; ++c) d[c] = F32ToBf16(f[c]);
}

// Writes this step's keys (or values) of one layer into their slots; `out` aliases `cache`, so
// the write is in place and only T * K rows of D are touched. New rows are f32 for an f32 or
// bf16 cache (bf16 rounds to nearest even) and already int8 for an int8 one; an int8 cache's
// scales ([L, K, P, O, 1] f32) are written by the same call with new [T, K, 1].
ffi::Error KvWrite(ffi::AnyBuffer cache, ffi::Buffer<ffi::S32> layer,
                   ffi::Buffer<ffi::S32> slot_mapping, ffi::AnyBuffer new_rows,
                   ffi::Result<ffi::AnyBuffer> out) {
  const auto cd = cache.dimensions();
  const auto nd = new_rows.dimensions();
  if (cd.size() != 5 || nd.size() != 3 || nd[1] != cd[1] || nd[2] != cd[4] ||
      slot_mapping.element_count() != nd[0]) {
    return ffi::Error::InvalidArgument("kv write: expected cache [L,K,P,O,D], new [T,K,D]");
  }
  const auto dtype = cache.element_type();
  const bool bf16 = dtype == ffi::DataType::BF16, int8 = dtype == ffi::DataType::S8;
  if (dtype != ffi::DataType::F32 && !bf16 && !int8) {
    return ffi::Error::InvalidArgument("kv write: cache must be f32, bf16 or int8");
  }
  if (new_rows.element_type() != (int8 ? ffi::DataType::S8 : ffi::DataType::F32)) {
    return ffi::Error::InvalidArgument("kv write: new rows must be int8 for an int8 cache, "
                                       "else f32");
  }
  const size_t item = bf16 ? 2 : int8 ? 1 : 4;
  char* dst_base = static_cast<char*>(out->untyped_data());
  if (dst_base != cache.untyped_data()) {  // not aliased after all: copy, then write
    std::memcpy(dst_base, cache.untyped_data(), cache.element_count() * item);
  }
  const int64_t K = cd[1], slots = cd[2] * cd[3], D = cd[4];
  const int64_t lay = std::min<int64_t>(std::max<int32_t>(layer.typed_data()[0], 0), cd[0] - 1);
  const char* src = static_cast<const char*>(new_rows.untyped_data());
  const size_t src_item = int8 ? 1 : 4;
  for (int64_t t = 0; t < nd[0]; ++t) {
    const int64_t slot = slot_mapping.typed_data()[t];
    if (slot < 0 || slot >= slots) continue;
    for (int64_t kh = 0; kh < K; ++kh) {
      const int64_t dst = ((lay * K + kh) * slots + slot) * D;
      const char* row = src + (t * K + kh) * D * src_item;
      if (bf16) {
        RoundToBf16(reinterpret_cast<const float*>(row),
                    reinterpret_cast<uint16_t*>(dst_base) + dst, D);
      } else {  // the same element type: a copy
        std::memcpy(dst_base + dst * item, row, D * item);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jengine

JE_EXPORT XLA_FFI_Error* JenginePagedAttention(XLA_FFI_CallFrame* call_frame);
JE_EXPORT XLA_FFI_Error* JengineKvWrite(XLA_FFI_CallFrame* call_frame);
JE_EXPORT int JengineAttentionIsa(int isa);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JenginePagedAttention, jengine::PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::AnyBuffer>()          // k_cache
                                  .Arg<ffi::AnyBuffer>()          // v_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_scale (int8; else empty)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_scale
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // token_seq
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()   // window
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_head_map
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sinks [H] (or empty)
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("isa")
                                  .Attr<int32_t>("block_q")
                                  .Attr<int32_t>("max_threads")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JengineKvWrite, jengine::KvWrite,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slot_mapping
                                  .Arg<ffi::AnyBuffer>()          // new rows
                                  .Ret<ffi::AnyBuffer>());

// isa 0: the instruction set `auto` picks here (1 portable, 2 AVX2, 3 AVX-512); else whether
// that one runs here (1 or 0; 4: the AMX prefill path).
extern "C" int JengineAttentionIsa(int isa) {
  if (isa == jengine::kAuto) return jengine::BestIsa();
  if (isa == jengine::kAmx) return jengine::AmxSupported() ? 1 : 0;
  return jengine::Supports(isa) ? 1 : 0;
}

JE_FFI_TARGET("jengine_paged_attention", JenginePagedAttention);
JE_FFI_TARGET("jengine_kv_write", JengineKvWrite);
JE_ISAS("attention", JengineAttentionIsa,
        {{"auto", jengine::kAuto}, {"portable", jengine::kPortable}, {"avx2", jengine::kAvx2},
         {"avx512", jengine::kAvx512}, {"amx", jengine::kAmx}});
