// y[R, N] = x[R, K] @ w[K, N] for a bf16 weight packed at load time into the AMX tiles' layout,
// on CPUs without AMX: AVX-512-BF16 (VDPBF16PS, f32 sums), AVX-512F or AVX2+FMA (each bf16 pair
// widened to f32 in registers, f32 FMA) or portable C++; x is bf16, or f32 rounded to bf16 as
// the AMX kernel rounds it. Also the fused SwiGLU silu(x @ w_gate) * (x @ w_up) over two such
// weights. Called through the XLA FFI (jengine.cpu_kernels.packed_bf16).
//
// `auto` takes VDPBF16PS only where it measures faster than the FMA path it replaces
// (`DpBf16Pays`): one VDPBF16PS does two f32 FMAs' work, but the Xeons (Sapphire Rapids) issue
// it at half their FMA rate, so there it is no faster than f32 and slower than FMA over the
// widened pairs, while AMD's Zen 4 and 5 issue it at their FMA rate.
//
// Why: off AMX a bf16 model's prefill-sized projections ran on XLA:CPU's bf16 dot, which
// converts and multiplies far below the f32 dot's rate (docs/kernels.md, "bf16 projections
// without AMX"). One packed form (amx_tiles) serves both the AMX kernel and this one: its tile
// rows are VDPBF16PS's k-pair operands as they stand. The output columns are split over XLA's
// intra-op threads, one contiguous run of 32-column strips each, like the AMX kernel's.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "isa.h"
#include "parallel_for.h"
#include "registry.h"
#include "spin_helper.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jengine {
namespace packed_bf16 {

constexpr int32_t kAvx512Bf16 = 6;  // this kernel's `isa` code for AVX-512-BF16

#define JE_IMPL_HEADER "packed_bf16_impl.h"
#include "per_isa.h"

#if JE_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx2,fma")
namespace avx512_bf16 {
#define JE_SIMD 3
#include JE_IMPL_HEADER
#undef JE_SIMD

// Seconds for `rounds` of 12 independent VDPBF16PS (Dp) or VFMADD231PS: their issue rates.
template <bool Dp>
double Issue(int64_t rounds) {
  __m512 acc[12];
  for (auto& a : acc) a = _mm512_setzero_ps();
  __m512 a = _mm512_set1_ps(1e-3f);
  const __m512 b = _mm512_set1_ps(1e-3f);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < rounds; ++i) {
    for (auto& c : acc) {
      c = Dp ? _mm512_dpbf16_ps(c, (__m512bh)_mm512_castps_si512(a),
                                (__m512bh)_mm512_castps_si512(b))
             : _mm512_fmadd_ps(a, b, c);
    }
    __asm__ volatile("" : "+v"(a));  // a stays live: the loop cannot be folded
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  __m512 sum = acc[0];
  for (int j = 1; j < 12; ++j) sum = _mm512_add_ps(sum, acc[j]);
  volatile float sink = _mm512_reduce_add_ps(sum);
  (void)sink;
  return s;
}
}  // namespace avx512_bf16
#pragma GCC pop_options
#endif
#undef JE_IMPL_HEADER

bool SupportsHere(int32_t isa) {
#if JE_X86
  if (isa == kAvx512Bf16) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  }
#endif
  return Supports(isa);
}

// Whether VDPBF16PS issues at least 2/3 of the f32 FMA rate here (it replaces two FMAs and the
// widening), measured once per process: the fastest of 5 tries of ~50 k instructions each.
bool DpBf16Pays() {
#if JE_X86
  static const bool pays = [] {
    if (!SupportsHere(kAvx512Bf16)) return false;
    double dp = 1e9, fma = 1e9;
    for (int t = 0; t < 5; ++t) {
      dp = std::min(dp, avx512_bf16::Issue<true>(4096));
      fma = std::min(fma, avx512_bf16::Issue<false>(4096));
    }
    return dp < 1.5 * fma;
  }();
  return pays;
#else
  return false;
#endif
}

int32_t BestHere() { return DpBf16Pays() ? kAvx512Bf16 : BestIsa(); }

using StripsFn = void (*)(const void*, int64_t, int64_t, const uint16_t*, const uint16_t*,
                          int64_t, int64_t, int64_t, void*, bool);

StripsFn StripsFor(int32_t isa) {
#if JE_X86
  if (isa == kAvx512Bf16) return avx512_bf16::Strips;
  if (isa == kAvx512) return avx512::Strips;
  if (isa == kAvx2) return avx2::Strips;
#endif
  return portable::Strips;
}

// x [R, K] as bf16 [R, Kp] with zeros past K: in place for bf16 x with K == Kp, else a copy
// (f32 rounded to nearest even) in `staged`.
const uint16_t* StageBf16(const void* x, bool x_bf16, int64_t R, int64_t K, int64_t Kp,
                          std::vector<uint16_t>& staged) {
  if (x_bf16 && K == Kp) return static_cast<const uint16_t*>(x);
  staged.assign(R * Kp, 0);
  for (int64_t r = 0; r < R; ++r) {
    if (x_bf16) {
      std::memcpy(&staged[r * Kp], static_cast<const uint16_t*>(x) + r * K, K * 2);
    } else {
      const float* src = static_cast<const float*>(x) + r * K;
      for (int64_t k = 0; k < K; ++k) staged[r * Kp + k] = F32ToBf16(src[k]);
    }
  }
  return staged.data();
}

// x [R, K] as f32 [R, Kp] holding its bf16 values (f32 x rounded to nearest even first), zeros
// past K: what the FMA paths broadcast.
const float* StageF32(const void* x, bool x_bf16, int64_t R, int64_t K, int64_t Kp,
                      std::vector<float>& staged) {
  staged.assign(R * Kp, 0.0f);
  for (int64_t r = 0; r < R; ++r) {
    float* dst = &staged[r * Kp];
    if (x_bf16) {
      const uint16_t* src = static_cast<const uint16_t*>(x) + r * K;
      for (int64_t k = 0; k < K; ++k) dst[k] = Bf16ToF32(src[k]);
    } else {
      const float* src = static_cast<const float*>(x) + r * K;
      for (int64_t k = 0; k < K; ++k) dst[k] = Bf16ToF32(F32ToBf16(src[k]));
    }
  }
  return staged.data();
}

// Calls of up to this many rows (decode steps) split their strips with the SpinHelper's thread
// when XLA's pool has two: waiting for a pool thread to wake cost a short call most of the
// second core, as it did the AMX kernel (spin_helper.h, amx_bf16.h's kHelperRows).
constexpr int64_t kHelperRows = 16;

// Whether x [R, K] (f32 or bf16) and a weight's tiles [ceil(N / 32), ceil(K / 32), 2, 16, 32]
// (bf16) go together.
bool Fits(const ffi::AnyBuffer& x, const ffi::AnyBuffer& tiles, int64_t n) {
  const auto xd = x.dimensions();
  const auto td = tiles.dimensions();
  return xd.size() == 2 && (x.element_type() == ffi::BF16 || x.element_type() == ffi::F32) &&
         td.size() == 5 && tiles.element_type() == ffi::BF16 && td[2] == 2 && td[3] == 16 &&
         td[4] == 32 && td[0] == (n + 31) / 32 && td[1] * 32 >= xd[1] && td[1] * 32 < xd[1] + 32;
}

ffi::Error Run(ffi::ThreadPool& pool, int32_t isa, int32_t max_threads, const ffi::AnyBuffer& x,
               const ffi::AnyBuffer& gate, const ffi::AnyBuffer* up, int64_t n, void* y,
               bool y_bf16) {
  if (isa == kAuto) isa = BestHere();
  if (!SupportsHere(isa)) {
    return ffi::Error::InvalidArgument("packed bf16 matmul: the forced isa is unsupported here");
  }
  const auto xd = x.dimensions();
  const int64_t R = xd[0], K = xd[1], Kp = gate.dimensions()[1] * 32;
  if (R == 0 || n == 0) return ffi::Error::Success();
  const bool x_bf16 = x.element_type() == ffi::BF16;
  std::vector<uint16_t> staged_bf16;
  std::vector<float> staged_f32;
  const void* xs = isa == kAvx512Bf16
                       ? static_cast<const void*>(
                             StageBf16(x.untyped_data(), x_bf16, R, K, Kp, staged_bf16))
                       : StageF32(x.untyped_data(), x_bf16, R, K, Kp, staged_f32);
  const auto* g = static_cast<const uint16_t*>(gate.untyped_data());
  const auto* u = up ? static_cast<const uint16_t*>(up->untyped_data()) : nullptr;
  const int64_t strips = (n + 31) / 32;
  const int64_t threads = KernelThreads(pool, max_threads);
  const int64_t parts = std::min(threads, strips);
  const StripsFn run = StripsFor(isa);
  auto part = [&](int64_t p, int64_t) {
    run(xs, R, Kp, g, u, p * strips / parts, (p + 1) * strips / parts, n, y, y_bf16);
  };
  if (threads == 2 && R <= kHelperRows) {
    SpinHelper::Get().Run(parts, part);
  } else {
    ParallelFor(pool, parts, parts, part);
  }
  return ffi::Error::Success();
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer tiles, int64_t n,
                  int32_t isa, int32_t max_threads, ffi::Result<ffi::AnyBuffer> y) {
  const bool y_bf16 = y->element_type() == ffi::BF16;
  if (!Fits(x, tiles, n) || (!y_bf16 && y->element_type() != ffi::F32)) {
    return ffi::Error::InvalidArgument(
        "packed bf16 matmul: expected x [R, K] (f32 or bf16), bf16 tiles "
        "[ceil(N / 32), ceil(K / 32), 2, 16, 32] and an f32 or bf16 y");
  }
  return Run(pool, isa, max_threads, x, tiles, nullptr, n, y->untyped_data(), y_bf16);
}

ffi::Error SwiGlu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                  int64_t n, int32_t isa, int32_t max_threads, ffi::ResultBuffer<ffi::BF16> y) {
  if (!Fits(x, gate, n) || !Fits(x, up, n)) {
    return ffi::Error::InvalidArgument(
        "packed bf16 swiglu: expected x [R, K] (f32 or bf16) and two bf16 tiles "
        "[ceil(N / 32), ceil(K / 32), 2, 16, 32]");
  }
  return Run(pool, isa, max_threads, x, gate, &up, n, y->untyped_data(), true);
}

}  // namespace packed_bf16
}  // namespace jengine

JE_EXPORT XLA_FFI_Error* JenginePackedBf16Matmul(XLA_FFI_CallFrame* call_frame);
JE_EXPORT XLA_FFI_Error* JenginePackedBf16SwiGlu(XLA_FFI_CallFrame* call_frame);
JE_EXPORT int JenginePackedBf16Isa(int isa);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JenginePackedBf16Matmul, jengine::packed_bf16::Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [R, K]: bf16, or f32
                                  .Arg<ffi::AnyBuffer>()  // w's tiles [S, KS, 2, 16, 32] bf16
                                  .Attr<int64_t>("n")
                                  .Attr<int32_t>("isa")
                                  .Attr<int32_t>("max_threads")
                                  .Ret<ffi::AnyBuffer>());  // y [R, N]: f32, or bf16 sums

XLA_FFI_DEFINE_HANDLER_SYMBOL(JenginePackedBf16SwiGlu, jengine::packed_bf16::SwiGlu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [R, K]: bf16, or f32
                                  .Arg<ffi::AnyBuffer>()  // w_gate's tiles
                                  .Arg<ffi::AnyBuffer>()  // w_up's tiles, the same shape
                                  .Attr<int64_t>("n")
                                  .Attr<int32_t>("isa")
                                  .Attr<int32_t>("max_threads")
                                  .Ret<ffi::Buffer<ffi::BF16>>());  // act [R, N]

// isa 0: the code `auto` picks here (AVX-512-BF16 only where `DpBf16Pays`); else whether that
// one runs here (1 or 0).
extern "C" int JenginePackedBf16Isa(int isa) {
  if (isa == jengine::kAuto) return jengine::packed_bf16::BestHere();
  return jengine::packed_bf16::SupportsHere(isa) ? 1 : 0;
}

JE_FFI_TARGET("jengine_packed_bf16_matmul", JenginePackedBf16Matmul);
JE_FFI_TARGET("jengine_packed_bf16_swiglu", JenginePackedBf16SwiGlu);
JE_ISAS("packed_bf16", JenginePackedBf16Isa,
        {{"auto", jengine::kAuto}, {"portable", jengine::kPortable}, {"avx2", jengine::kAvx2},
         {"avx512", jengine::kAvx512}, {"avx512_bf16", jengine::packed_bf16::kAvx512Bf16}});
