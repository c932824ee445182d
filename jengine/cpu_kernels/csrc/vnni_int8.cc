// W8A8 over packed int8 weights with VPDPBUSD (AVX-512 VNNI), for CPUs without AMX-INT8:
//   y[R, N] = float(xq[R, K] @ w[K, N]) * sx[R] * sw[N]
// reading the weight in the AMX-INT8 tiles' layout (amx_int8.h: [ceil(N / 32), ceil(K / 64),
// 2, 16, 64], a tile row p holding, for 16 columns, the 4 k of quad p: a VPDPBUSD operand as
// it is), so one packing at load time serves both kernels. Exact int32 sums and the f32 rescale
// in quant._rescale's order, so y equals XLA's int8 dot and rescale to the bit (or that rounded
// to bf16, round to nearest even).
//
// Why: XLA:CPU's int8 dot off AMX repacks the weight on every call and runs each dot on one
// thread; at decode sizes `--quantization int8` ran 0.78x f32's speed on a Zen 5
// (docs/quantization.md). VPDPBUSD multiplies unsigned bytes by signed ones: the weight bytes
// are flipped to u8 (w + 128, an XOR per 64 weights, shared by every row) and 128 * sum_k xq
// is taken off each row's sums again.
//
// Work: units of 16 columns (a strip's half) split over the threads; per unit, blocks of up to
// kRowsI8 rows, each row's 16 sums in two accumulators (even and odd k quads) so that a single
// row is not one chain of dependent instructions.

#include <algorithm>
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

enum VnniInt8Isa : int32_t { kVnniI8Auto = 0, kVnniI8Avx512 = 4 };

bool VnniInt8Supported() {
#if JE_X86
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

int VnniInt8Runs(int isa) {
  if (isa == kVnniI8Auto) return VnniInt8Supported() ? kVnniI8Avx512 : 0;
  return isa == kVnniI8Avx512 && VnniInt8Supported();
}

#if JE_X86
#define JE_VNNI_I8 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

constexpr int kRowsI8 = 8;

struct PackedProblem {
  const int8_t* x;      // [R, Kp] zero-padded
  const int32_t* xsum;  // [R] sum_k x
  const float* sx;      // [R]
  const int8_t* tiles;  // [S, KS, 2, 16, 64]
  const float* sw;      // [N]
  void* y;              // [R, N] f32 or bf16
  bool y_bf16;
  int64_t R, Kp, N;
};

// f32 -> bf16 bits, round to nearest even (XLA's convert for finite values; no AVX-512-BF16
// needed, which VNNI CPUs such as Ice Lake lack).
JE_VNNI_I8 inline __m256i ToBf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// Rows [r0, r0 + RB) of unit u (strip u / 2, half u % 2: columns 16 u .. 16 u + 15).
template <int RB>
JE_VNNI_I8 void UnitRows(const PackedProblem& p, int64_t u, int64_t r0) {
  const int64_t KS = p.Kp / 64;
  const int8_t* unit = p.tiles + (u / 2) * KS * 2048 + (u % 2) * 1024;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i even[RB], odd[RB];
  for (int r = 0; r < RB; ++r) even[r] = odd[r] = _mm512_setzero_si512();
  for (int64_t ks = 0; ks < KS; ++ks) {
    const int8_t* t = unit + ks * 2048;
    const int8_t* xk = p.x + r0 * p.Kp + ks * 64;
#pragma GCC unroll 2
    for (int q = 0; q < 16; q += 2) {
      const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(t + q * 64), flip);
      const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(t + (q + 1) * 64), flip);
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        const int32_t* xr = reinterpret_cast<const int32_t*>(xk + r * p.Kp);
        even[r] = _mm512_dpbusd_epi32(even[r], w0, _mm512_set1_epi32(xr[q]));
        odd[r] = _mm512_dpbusd_epi32(odd[r], w1, _mm512_set1_epi32(xr[q + 1]));
      }
    }
  }
  const int64_t c = 16 * u, cols = std::min<int64_t>(16, p.N - c);
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  const __m512 sw = _mm512_maskz_loadu_ps(keep, p.sw + c);
  for (int r = 0; r < RB; ++r) {
    const int64_t row = r0 + r;
    const __m512i sums = _mm512_sub_epi32(_mm512_add_epi32(even[r], odd[r]),
                                          _mm512_set1_epi32(128 * p.xsum[row]));
    const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums),
                                                 _mm512_set1_ps(p.sx[row])), sw);
    if (p.y_bf16) {
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.y) + row * p.N + c, keep, ToBf16(v));
    } else {
      _mm512_mask_storeu_ps(static_cast<float*>(p.y) + row * p.N + c, keep, v);
    }
  }
}

JE_VNNI_I8 void Units(const PackedProblem& p, int64_t u0, int64_t u1) {
  for (int64_t u = u0; u < u1; ++u) {
    int64_t r0 = 0;
    for (; r0 + kRowsI8 <= p.R; r0 += kRowsI8) UnitRows<kRowsI8>(p, u, r0);
    switch (p.R - r0) {  // the rows left, one body each so that every loop unrolls
      case 7: UnitRows<7>(p, u, r0); break;
      case 6: UnitRows<6>(p, u, r0); break;
      case 5: UnitRows<5>(p, u, r0); break;
      case 4: UnitRows<4>(p, u, r0); break;
      case 3: UnitRows<3>(p, u, r0); break;
      case 2: UnitRows<2>(p, u, r0); break;
      case 1: UnitRows<1>(p, u, r0); break;
      default: break;
    }
  }
}
#endif  // JE_X86

ffi::Error VnniInt8Packed(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::F32> sx,
                          ffi::Buffer<ffi::S8> tiles, ffi::Buffer<ffi::F32> sw, int64_t n,
                          int32_t isa, int32_t max_threads, ffi::Result<ffi::AnyBuffer> y) {
  const auto xd = x.dimensions();
  const auto td = tiles.dimensions();
  if (xd.size() != 2 || td.size() != 5 || td[2] != 2 || td[3] != 16 || td[4] != 64 ||
      td[0] != (n + 31) / 32 || td[1] != (xd[1] + 63) / 64 ||
      sx.element_count() != xd[0] || sw.element_count() != n) {
    return ffi::Error::InvalidArgument(
        "vnni int8 matmul: expected xq [R, K] int8, sx [R], the amx_int8_tiles of a w [K, N] "
        "([ceil(N / 32), ceil(K / 64), 2, 16, 64] int8) and sw [N]");
  }
  if (y->element_type() != ffi::F32 && y->element_type() != ffi::BF16) {
    return ffi::Error::InvalidArgument("vnni int8 matmul: the result is f32 or bf16");
  }
  if (VnniInt8Runs(isa) == 0) {
    return ffi::Error::InvalidArgument("vnni int8 matmul: the CPU lacks AVX-512 VNNI");
  }
#if JE_X86
  const int64_t R = xd[0], K = xd[1], Kp = td[1] * 64, N = n;
  if (R == 0 || N == 0) return ffi::Error::Success();
  std::vector<int8_t> staged(R * Kp, 0);
  std::vector<int32_t> xsum(R, 0);
  const int8_t* xp = x.typed_data();
  for (int64_t r = 0; r < R; ++r) {
    std::memcpy(staged.data() + r * Kp, xp + r * K, K);
    int32_t sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += xp[r * K + k];
    xsum[r] = sum;
  }
  const PackedProblem p{staged.data(), xsum.data(), sx.typed_data(), tiles.typed_data(),
                        sw.typed_data(), y->untyped_data(), y->element_type() == ffi::BF16,
                        R, Kp, N};
  const int64_t units = (N + 15) / 16;
  const int64_t parts = std::min(KernelThreads(pool, max_threads), units);
  ParallelFor(pool, parts, parts, [&](int64_t i, int64_t) {
    Units(p, i * units / parts, (i + 1) * units / parts);
  });
#endif
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jengine

JE_EXPORT XLA_FFI_Error* JengineVnniInt8Packed(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JengineVnniInt8Packed, jengine::VnniInt8Packed,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()   // xq [R, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sx [R]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // tiles [S, KS, 2, 16, 64]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sw [N]
                                  .Attr<int64_t>("n")
                                  .Attr<int32_t>("isa")
                                  .Attr<int32_t>("max_threads")
                                  .Ret<ffi::AnyBuffer>());  // y [R, N] f32 or bf16

JE_FFI_TARGET("jengine_vnni_int8_packed", JengineVnniInt8Packed);
JE_ISAS("vnni_int8_packed", jengine::VnniInt8Runs,
        {{"auto", jengine::kVnniI8Auto}, {"avx512_vnni", jengine::kVnniI8Avx512}});
