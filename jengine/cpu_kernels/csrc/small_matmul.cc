// Matmul of a few f32 rows for XLA:CPU, called through the XLA FFI: y[R, N] = x[R, K] @ w[K, N],
// or x @ w^T for w [N, K] (`transpose_w`: a tied embedding as the output head). The weight is
// f32, bf16 or int8 (weight-only quantization; its per-channel scale is applied by the caller);
// x, the sums and y stay f32.
//
// A decode step of R sequences (or a speculative verification of R query rows) multiplies a few
// rows by every weight matrix; the weights are far larger than the activations, so the step is
// as fast as the weights stream from memory, if each weight is read once for all R rows.
// Register tiles of R x 2 vectors do that (small_matmul_impl.h). Output columns are split into
// one contiguous range per thread of XLA's intra-op pool. The instruction set (AVX-512F, AVX2+FMA
// or portable C++) is chosen at run time, or forced by the `isa` attribute. A bf16 weight packed
// into the AMX tiles' layout at load time has its own target (AmxMatmul, amx_bf16.h).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_bf16.h"
#include "amx_int8.h"
#include "amx_swiglu.h"
#include "bf16.h"
#include "isa.h"
#include "parallel_for.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jengine {
namespace {

constexpr int32_t kAmxBf16 = 4;  // JengineMatmulIsa's code for "AmxMatmul runs here"
constexpr int32_t kAmxInt8 = 5;  // JengineMatmulIsa's code for "AmxInt8Matmul runs here"

inline bool SupportsHere(int32_t isa) {
#if JE_X86
  if (isa == kAmxBf16) return amx::Permitted();
  if (isa == kAmxInt8) return amx::PermittedInt8();
#endif
  return Supports(isa);
}

#define JE_IMPL_HEADER "small_matmul_impl.h"
#include "per_isa.h"
#undef JE_IMPL_HEADER

template <typename W>
using ColumnsFn = void (*)(const float*, const W*, float*, int64_t, int64_t, int64_t, int64_t,
                           int64_t);

// y = x @ w (or x @ w^T) for one weight type, the columns (streamed rows: K) split over the
// intra-op pool.
template <typename W>
void Run(ffi::ThreadPool& pool, int32_t isa, bool transpose_w, int32_t max_threads,
         const float* x, const W* w, float* y, int64_t R, int64_t K, int64_t N) {
  ColumnsFn<W> columns = transpose_w ? portable::NtColumns<W> : portable::Columns<W>;
  int64_t tile = transpose_w ? portable::kNtCols : portable::kTile;
#if JE_X86
  if (isa == kAvx512) {
    columns = transpose_w ? avx512::NtColumns<W> : avx512::Columns<W>;
    tile = transpose_w ? avx512::kNtCols : avx512::kTile;
  } else if (isa == kAvx2) {
    columns = transpose_w ? avx2::NtColumns<W> : avx2::Columns<W>;
    tile = transpose_w ? avx2::kNtCols : avx2::kTile;
  }
#endif
  const int64_t threads = KernelThreads(pool, max_threads);
  if (!transpose_w && threads > 1 && K >= 64 * threads) {
    // Each thread takes a contiguous run of whole weight rows (a k range) into its own partial
    // sums, added in order at the end. Streamed rows (one to kStreamRows) gain from it: splitting
    // the columns instead gives every thread short strided runs of each row (96 floats of a
    // 192-wide weight on two threads), which the hardware prefetchers stream worse. More rows
    // split the same way so that a row's sums are added in one order whatever R is: a
    // verification's rows then equal a one-row decode's to the bit (batch invariance).
    const int64_t parts = threads;
    std::vector<float> partial((parts - 1) * R * N);
    ParallelFor(pool, parts, parts, [&](int64_t i, int64_t) {
      const int64_t k0 = i * K / parts / 8 * 8;
      const int64_t k1 = i + 1 == parts ? K : (i + 1) * K / parts / 8 * 8;
      float* out = i == 0 ? y : partial.data() + (i - 1) * R * N;
      if (R == 1) {
        columns(x + k0, w + k0 * N, out, 1, k1 - k0, N, 0, N);
      } else {  // the rows' k ranges side by side, as the row stride is the k length
        std::vector<float> xs(R * (k1 - k0));
        for (int64_t r = 0; r < R; ++r) {
          std::copy(x + r * K + k0, x + r * K + k1, xs.begin() + r * (k1 - k0));
        }
        columns(xs.data(), w + k0 * N, out, R, k1 - k0, N, 0, N);
      }
    });
    const int64_t total = R * N;
    ParallelFor(pool, parts, parts, [&](int64_t i, int64_t) {
      const int64_t c1 = (i + 1) * total / parts;
      for (int64_t p = 0; p + 1 < parts; ++p) {
        const float* src = partial.data() + p * total;
        for (int64_t c = i * total / parts; c < c1; ++c) y[c] += src[c];
      }
    });
    return;
  }
  const int64_t tiles = (N + tile - 1) / tile;
  const int64_t parts = std::min(threads, tiles);
  ParallelFor(pool, parts, parts, [&](int64_t i, int64_t) {
    const int64_t c0 = i * tiles / parts * tile;
    const int64_t c1 = std::min(N, (i + 1) * tiles / parts * tile);
    columns(x, w, y, R, K, N, c0, c1);
  });
}

ffi::Error SmallMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                       int32_t isa, int32_t transpose_w, int32_t max_threads,
                       ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[transpose_w ? 1 : 0]) {
    return ffi::Error::InvalidArgument(
        "small matmul: expected x [R, K] and w [K, N] (or [N, K] with transpose_w)");
  }
  const int64_t R = xd[0], K = xd[1], N = wd[transpose_w ? 0 : 1];
  if (isa == kAuto) isa = BestIsa();
  if (!Supports(isa)) {
    return ffi::Error::InvalidArgument("small matmul: the forced instruction set is unsupported");
  }
  float* out = y->typed_data();
  if (R == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::memset(out, 0, R * N * sizeof(float));
    return ffi::Error::Success();
  }
  const float* xs = x.typed_data();
  const void* ws = w.untyped_data();
  switch (w.element_type()) {
    case ffi::F32:
      Run(pool, isa, transpose_w, max_threads, xs, static_cast<const float*>(ws), out, R, K, N);
      break;
    case ffi::BF16:
      Run(pool, isa, transpose_w, max_threads, xs, static_cast<const Bf16*>(ws), out, R, K, N);
      break;
    case ffi::S8:
      Run(pool, isa, transpose_w, max_threads, xs, static_cast<const int8_t*>(ws), out, R, K, N);
      break;
    default:
      return ffi::Error::InvalidArgument("small matmul: the weight must be f32, bf16 or int8");
  }
  return ffi::Error::Success();
}

// Whether x [R, K] (f32 or bf16) and a weight's tiles [ceil(N / 32), ceil(K / 32), 2, 16, 32]
// (bf16) go together.
bool TilesFit(const ffi::AnyBuffer& x, const ffi::AnyBuffer& tiles, int64_t n) {
  const auto xd = x.dimensions();
  const auto td = tiles.dimensions();
  return xd.size() == 2 && (x.element_type() == ffi::BF16 || x.element_type() == ffi::F32) &&
         td.size() == 5 && tiles.element_type() == ffi::BF16 && td[2] == 2 && td[3] == 16 &&
         td[4] == 32 && td[0] == (n + 31) / 32 && td[1] * 32 >= xd[1] &&
         td[1] * 32 < xd[1] + 32;
}

ffi::Error AmxMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer tiles,
                     int64_t n, int32_t max_threads, ffi::Result<ffi::AnyBuffer> y) {
  const auto xd = x.dimensions();
  const auto td = tiles.dimensions();
  const bool x_bf16 = x.element_type() == ffi::BF16;
  if (!TilesFit(x, tiles, n)) {
    return ffi::Error::InvalidArgument(
        "amx matmul: expected x [R, K] (f32 or bf16) and bf16 tiles "
        "[ceil(N / 32), ceil(K / 32), 2, 16, 32]");
  }
  const bool y_bf16 = y->element_type() == ffi::BF16;
  if (!y_bf16 && y->element_type() != ffi::F32) {
    return ffi::Error::InvalidArgument("amx matmul: y must be f32 or bf16");
  }
#if JE_X86
  if (!amx::Permitted()) {
    return ffi::Error::InvalidArgument("amx matmul: this CPU or kernel gives no AMX-BF16");
  }
  if (xd[0] > 0 && n > 0) {
    amx::PackedMatmul(pool, max_threads, x.untyped_data(), x_bf16,
                      static_cast<const uint16_t*>(tiles.untyped_data()), y->untyped_data(),
                      y_bf16, xd[0], xd[1], td[1] * 32, n);
  }
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument("amx matmul: AMX exists on x86-64 only");
#endif
}

// act [R, N] bf16 = silu(x @ w_gate) * (x @ w_up) from both weights' tiles (amx_swiglu.h).
ffi::Error AmxSwiGlu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer gate,
                     ffi::AnyBuffer up, int64_t n, int32_t max_threads,
                     ffi::ResultBuffer<ffi::BF16> y) {
  if (!TilesFit(x, gate, n) || !TilesFit(x, up, n)) {
    return ffi::Error::InvalidArgument(
        "amx swiglu: expected x [R, K] (f32 or bf16) and two bf16 tiles "
        "[ceil(N / 32), ceil(K / 32), 2, 16, 32]");
  }
#if JE_X86
  if (!amx::Permitted()) {
    return ffi::Error::InvalidArgument("amx swiglu: this CPU or kernel gives no AMX-BF16");
  }
  const auto xd = x.dimensions();
  if (xd[0] > 0 && n > 0) {
    amx::PackedSwiGlu(pool, max_threads, x.untyped_data(), x.element_type() == ffi::BF16,
                      static_cast<const uint16_t*>(gate.untyped_data()),
                      static_cast<const uint16_t*>(up.untyped_data()),
                      reinterpret_cast<uint16_t*>(y->typed_data()), xd[0], xd[1],
                      gate.dimensions()[1] * 32, n);
  }
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument("amx swiglu: AMX exists on x86-64 only");
#endif
}

// Whether xq [R, K] (int8, with its [R] scales sx) and an int8 weight's tiles
// [ceil(N / 32), ceil(K / 64), 2, 16, 64] with their [N] scales go together.
bool Int8TilesFit(const ffi::Buffer<ffi::S8>& x, const ffi::Buffer<ffi::F32>& sx,
                  const ffi::Buffer<ffi::S8>& tiles, const ffi::Buffer<ffi::F32>& sw,
                  int64_t n) {
  const auto xd = x.dimensions();
  const auto td = tiles.dimensions();
  return xd.size() == 2 && td.size() == 5 && td[2] == 2 && td[3] == 16 && td[4] == 64 &&
         td[0] == (n + 31) / 32 && td[1] * 64 >= xd[1] && td[1] * 64 < xd[1] + 64 &&
         sx.element_count() == xd[0] && sw.element_count() == n;
}

// y [R, N] = float(xq @ w) * sx * sw from an int8 weight's tiles (amx_int8.h).
ffi::Error AmxInt8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::F32> sx,
                         ffi::Buffer<ffi::S8> tiles, ffi::Buffer<ffi::F32> sw, int64_t n,
                         int32_t max_threads, ffi::Result<ffi::AnyBuffer> y) {
  if (!Int8TilesFit(x, sx, tiles, sw, n)) {
    return ffi::Error::InvalidArgument(
        "amx int8 matmul: expected xq [R, K] int8, sx [R], int8 tiles "
        "[ceil(N / 32), ceil(K / 64), 2, 16, 64] and sw [N]");
  }
  const bool y_bf16 = y->element_type() == ffi::BF16;
  if (!y_bf16 && y->element_type() != ffi::F32) {
    return ffi::Error::InvalidArgument("amx int8 matmul: y must be f32 or bf16");
  }
#if JE_X86
  if (!amx::PermittedInt8()) {
    return ffi::Error::InvalidArgument("amx int8 matmul: this CPU or kernel gives no AMX-INT8");
  }
  const auto xd = x.dimensions();
  if (xd[0] > 0 && n > 0) {
    amx::PackedMatmulInt8(pool, max_threads, x.typed_data(), sx.typed_data(), tiles.typed_data(),
                          sw.typed_data(), y->untyped_data(), y_bf16, xd[0], xd[1],
                          tiles.dimensions()[1] * 64, n);
  }
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument("amx int8 matmul: AMX exists on x86-64 only");
#endif
}

// act [R, N] bf16 = silu(x @ w_gate) * (x @ w_up) from two int8 weights' tiles (amx_int8.h).
ffi::Error AmxInt8SwiGlu(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::F32> sx,
                         ffi::Buffer<ffi::S8> gate, ffi::Buffer<ffi::F32> gate_scale,
                         ffi::Buffer<ffi::S8> up, ffi::Buffer<ffi::F32> up_scale, int64_t n,
                         int32_t max_threads, ffi::ResultBuffer<ffi::BF16> y) {
  if (!Int8TilesFit(x, sx, gate, gate_scale, n) || !Int8TilesFit(x, sx, up, up_scale, n)) {
    return ffi::Error::InvalidArgument(
        "amx int8 swiglu: expected xq [R, K] int8, sx [R], two int8 tiles "
        "[ceil(N / 32), ceil(K / 64), 2, 16, 64] and their [N] scales");
  }
#if JE_X86
  if (!amx::PermittedInt8()) {
    return ffi::Error::InvalidArgument("amx int8 swiglu: this CPU or kernel gives no AMX-INT8");
  }
  const auto xd = x.dimensions();
  if (xd[0] > 0 && n > 0) {
    amx::PackedSwiGluInt8(pool, max_threads, x.typed_data(), sx.typed_data(), gate.typed_data(),
                          gate_scale.typed_data(), up.typed_data(), up_scale.typed_data(),
                          reinterpret_cast<uint16_t*>(y->typed_data()), xd[0], xd[1],
                          gate.dimensions()[1] * 64, n);
  }
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument("amx int8 swiglu: AMX exists on x86-64 only");
#endif
}

}  // namespace
}  // namespace jengine

JE_EXPORT XLA_FFI_Error* JengineSmallMatmul(XLA_FFI_CallFrame* call_frame);
JE_EXPORT XLA_FFI_Error* JengineAmxMatmul(XLA_FFI_CallFrame* call_frame);
JE_EXPORT XLA_FFI_Error* JengineAmxSwiGlu(XLA_FFI_CallFrame* call_frame);
JE_EXPORT XLA_FFI_Error* JengineAmxInt8Matmul(XLA_FFI_CallFrame* call_frame);
JE_EXPORT XLA_FFI_Error* JengineAmxInt8SwiGlu(XLA_FFI_CallFrame* call_frame);
JE_EXPORT int JengineMatmulIsa(int isa);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JengineSmallMatmul, jengine::SmallMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [R, K]
                                  .Arg<ffi::AnyBuffer>()  // w [K, N] or [N, K]: f32, bf16, s8
                                  .Attr<int32_t>("isa")
                                  .Attr<int32_t>("transpose_w")
                                  .Attr<int32_t>("max_threads")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [R, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JengineAmxMatmul, jengine::AmxMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [R, K]: bf16, or f32 bf16 values
                                  .Arg<ffi::AnyBuffer>()  // w's tiles [S, KS, 2, 16, 32] bf16
                                  .Attr<int64_t>("n")
                                  .Attr<int32_t>("max_threads")
                                  .Ret<ffi::AnyBuffer>());  // y [R, N]: f32, or bf16 sums

XLA_FFI_DEFINE_HANDLER_SYMBOL(JengineAmxSwiGlu, jengine::AmxSwiGlu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [R, K]: bf16, or f32 bf16 values
                                  .Arg<ffi::AnyBuffer>()  // w_gate's tiles [S, KS, 2, 16, 32]
                                  .Arg<ffi::AnyBuffer>()  // w_up's tiles, the same shape
                                  .Attr<int64_t>("n")
                                  .Attr<int32_t>("max_threads")
                                  .Ret<ffi::Buffer<ffi::BF16>>());  // act [R, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JengineAmxInt8Matmul, jengine::AmxInt8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()  // xq [R, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sx [R]: xq's row scales
                                  .Arg<ffi::Buffer<ffi::S8>>()  // w's tiles [S, KS, 2, 16, 64]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sw [N]: w's column scales
                                  .Attr<int64_t>("n")
                                  .Attr<int32_t>("max_threads")
                                  .Ret<ffi::AnyBuffer>());  // y [R, N]: f32, or bf16

XLA_FFI_DEFINE_HANDLER_SYMBOL(JengineAmxInt8SwiGlu, jengine::AmxInt8SwiGlu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()  // xq [R, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sx [R]
                                  .Arg<ffi::Buffer<ffi::S8>>()  // w_gate's tiles
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_gate's scales [N]
                                  .Arg<ffi::Buffer<ffi::S8>>()  // w_up's tiles
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_up's scales [N]
                                  .Attr<int64_t>("n")
                                  .Attr<int32_t>("max_threads")
                                  .Ret<ffi::Buffer<ffi::BF16>>());  // act [R, N]

// isa 0: the instruction set `auto` picks here (1 portable, 2 AVX2, 3 AVX-512); else whether
// that one runs here (1 or 0).
extern "C" int JengineMatmulIsa(int isa) {
  if (isa == jengine::kAuto) return jengine::BestIsa();
  return jengine::SupportsHere(isa) ? 1 : 0;
}

JE_FFI_TARGET("jengine_small_matmul", JengineSmallMatmul);
JE_FFI_TARGET("jengine_amx_matmul", JengineAmxMatmul);
JE_FFI_TARGET("jengine_amx_swiglu", JengineAmxSwiGlu);
JE_FFI_TARGET("jengine_amx_int8_matmul", JengineAmxInt8Matmul);
JE_FFI_TARGET("jengine_amx_int8_swiglu", JengineAmxInt8SwiGlu);
JE_ISAS("matmul", JengineMatmulIsa,
        {{"auto", jengine::kAuto}, {"portable", jengine::kPortable}, {"avx2", jengine::kAvx2},
         {"avx512", jengine::kAvx512}});
// Not `isa` attributes: the codes JengineMatmulIsa answers whether the AMX targets run here.
JE_ISAS("amx", JengineMatmulIsa, {{"bf16", jengine::kAmxBf16}, {"int8", jengine::kAmxInt8}});
