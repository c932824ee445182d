// W4A16 matmul for XLA:CPU, through the XLA FFI: y[R, N] = x[R, K] @ w[K, N] for a 4-bit weight
// with a float32 scale and min per group of 32 k and column, w[k, n] = s[k / 32, n] * q[k, n] +
// m[k / 32, n], q in 0..15 (GGUF Q4_0 / Q4_1 / Q4_K and AWQ / GPTQ int4 all take this form).
//
// Why: a decode step streams every weight once, so its time is the weight bytes; 4-bit values
// plus two f32 per 32 are 0.75 bytes a weight against 4 (f32) or 2 (bf16). The weight stays in
// its packed form in memory and is widened to f32 in registers only.
//
// Layout (jengine/cpu_kernels/w4_matmul.py packs it once at load time): columns in tiles of
// kW4Cols; q uint8 [N / kW4Cols, K / 32, 16, kW4Cols]: per tile and group of 32 k, for each
// vector v of 16 columns 4 runs p of 64 bytes, byte 4 l + b of run p holding q[32 g + 4 p + b]
// in its low nibble and q[32 g + 16 + 4 p + b] in its high one, for column 16 v + l; s and m
// f32 [N / kW4Cols, K / 32, kW4Cols]. N is padded to whole tiles (zero q, s, m); a thread's
// tiles are one contiguous run of memory.
//
// Two schemes: W4A16 (float activations, f32 FMA over the widened nibbles; AVX-512F, AVX2+FMA
// or portable C++, one body per ISA) and W4A8 (`avx512_vnni`, or `avx_vnni` on CPUs with the
// 256-bit form only: activations rounded to int8 per group of 32, VPDPBUSD; w4_vnni.h). `auto`
// picks W4A8 where the CPU has either VNNI, else the best float path; the `isa` attribute
// forces one.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"
#include "parallel_for.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jengine {
namespace {

constexpr int64_t kW4Cols = 64;  // columns per tile: 64-byte rows of packed nibbles

#define JE_IMPL_HEADER "w4_matmul_impl.h"
#include "per_isa.h"
#undef JE_IMPL_HEADER

#include "w4_vnni.h"

constexpr int32_t kW4Vnni = 5;  // W4A8 on AVX-512 VNNI (beside isa.h's codes)
constexpr int32_t kW4AvxVnni = 6;  // W4A8 on AVX-VNNI (256-bit)

bool VnniSupported() {
#if JE_X86
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

bool AvxVnniSupported() {
#if JE_X86
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("avxvnni");
#else
  return false;
#endif
}

int32_t W4BestIsa() {
  return VnniSupported() ? kW4Vnni : AvxVnniSupported() ? kW4AvxVnni : BestIsa();
}

using TilesFn = void (*)(const float*, const float*, const uint8_t*, const float*, const float*,
                         float*, int64_t, int64_t, int64_t, int64_t, int64_t);

int W4Isa(int isa) {
  if (isa == kAuto) return W4BestIsa();
  if (isa == kW4Vnni) return VnniSupported();
  if (isa == kW4AvxVnni) return AvxVnniSupported();
  return isa <= kAvx512 && Supports(isa) ? 1 : 0;
}

// The W4A8 product: x quantized per group (rows split over the threads), then the tiles (by
// the AVX-512 or the 256-bit body, as `isa` says).
void VnniMatmul(ffi::ThreadPool& pool, int32_t max_threads, int32_t isa, const float* xp,
                const uint8_t* qp, const float* sp, const float* mp, float* out, int64_t R,
                int64_t K, int64_t N, int64_t tiles) {
#if JE_X86
  const int64_t G = K / 32;
  std::vector<int8_t> xq(R * K);
  std::vector<float> d(R * G), xs(R * G);
  const int64_t threads = KernelThreads(pool, max_threads);
  const int64_t qparts = std::min(threads, R);
  ParallelFor(pool, qparts, qparts, [&](int64_t i, int64_t) {
    QuantizeGroups(xp, K, i * R / qparts, (i + 1) * R / qparts, xq.data(), d.data(), xs.data());
  });
  const VnniActs acts{xq.data(), d.data(), xs.data()};
  const int64_t parts = std::min(threads, tiles);
  ParallelFor(pool, parts, parts, [&](int64_t i, int64_t) {
    const int64_t t0 = i * tiles / parts, t1 = (i + 1) * tiles / parts;
    if (isa == kW4Vnni) {
      VnniTiles(acts, qp, sp, mp, out, R, K, N, t0, t1);
    } else {
      AvxVnniTiles(acts, qp, sp, mp, out, R, K, N, t0, t1);
    }
  });
#endif
}

ffi::Error W4Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                    ffi::Buffer<ffi::F32> s, ffi::Buffer<ffi::F32> m, int64_t n, int32_t isa,
                    int32_t max_threads, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto qd = q.dimensions();
  const auto sd = s.dimensions();
  if (xd.size() != 2 || qd.size() != 4 || sd.size() != 3 || xd[1] % 32 != 0 ||
      qd[1] != xd[1] / 32 || qd[2] != 16 || qd[3] != kW4Cols || qd[0] * kW4Cols < n ||
      (qd[0] - 1) * kW4Cols >= std::max<int64_t>(n, 1) || sd[0] != qd[0] || sd[1] != qd[1] ||
      sd[2] != kW4Cols || m.element_count() != s.element_count()) {
    return ffi::Error::InvalidArgument(
        "w4 matmul: expected x [R, K] (K a multiple of 32), q [ceil(N / 64), K / 32, 16, 64] "
        "uint8 and s, m [ceil(N / 64), K / 32, 64] float32");
  }
  if (isa == kAuto) isa = W4BestIsa();
  if (!W4Isa(isa)) {
    return ffi::Error::InvalidArgument("w4 matmul: the forced instruction set is unsupported");
  }
  const int64_t R = xd[0], K = xd[1], G = K / 32, N = n;
  float* out = y->typed_data();
  if (R == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::memset(out, 0, R * N * sizeof(float));
    return ffi::Error::Success();
  }
  const float* xp = x.typed_data();
  const int64_t tiles = qd[0];
  if (isa == kW4Vnni || isa == kW4AvxVnni) {
    VnniMatmul(pool, max_threads, isa, xp, q.typed_data(), s.typed_data(), m.typed_data(), out,
               R, K, N, tiles);
    return ffi::Error::Success();
  }
  std::vector<float> xs(R * G);  // each row's sum over each group, for the min term
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.0f;
      for (int64_t k = 0; k < 32; ++k) sum += xp[r * K + g * 32 + k];
      xs[r * G + g] = sum;
    }
  }
  TilesFn tiles_fn = portable::Tiles;
#if JE_X86
  if (isa == kAvx512) tiles_fn = avx512::Tiles;
  if (isa == kAvx2) tiles_fn = avx2::Tiles;
#endif
  const int64_t parts = std::min(KernelThreads(pool, max_threads), tiles);
  const uint8_t* qp = q.typed_data();
  const float *sp = s.typed_data(), *mp = m.typed_data();
  ParallelFor(pool, parts, parts, [&](int64_t i, int64_t) {
    tiles_fn(xp, xs.data(), qp, sp, mp, out, R, K, N, i * tiles / parts,
             (i + 1) * tiles / parts);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jengine

JE_EXPORT XLA_FFI_Error* JengineW4Matmul(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JengineW4Matmul, jengine::W4Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [R, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()  // q [Nt, K / 32, 16, 64]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // s [Nt, K / 32, 64]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // m [Nt, K / 32, 64]
                                  .Attr<int64_t>("n")
                                  .Attr<int32_t>("isa")  // 0 auto, 1 portable, 2 AVX2, 3 AVX-512, 5 VNNI, 6 AVX-VNNI
                                  .Attr<int32_t>("max_threads")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [R, N]

JE_FFI_TARGET("jengine_w4_matmul", JengineW4Matmul);
JE_ISAS("w4_matmul", jengine::W4Isa,
        {{"auto", jengine::kAuto}, {"portable", jengine::kPortable}, {"avx2", jengine::kAvx2},
         {"avx512", jengine::kAvx512}, {"avx512_vnni", jengine::kW4Vnni},
         {"avx_vnni", jengine::kW4AvxVnni}});
