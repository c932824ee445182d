// RMSNorm of rows for XLA:CPU, through the XLA FFI: y[r] = x[r] * rsqrt(mean(x[r]^2) + eps)
// times the weight (or 1 + weight: Gemma's `offset`), f32 arithmetic, x and y f32 or bf16.
//
// Why a kernel for so small an op: in XLA a row's sum of squares changes its order with the
// number of rows (it vectorises across them from 8 rows on), so the model builds its own
// order-fixed tree of elementwise adds (layers.row_sum), five small fusions a norm. On the
// 2-core Xeon a 16-row step spent 2.0 ms of its ~29 in those fusions against 0.26 ms at one
// row: XLA splits the last one over its intra-op pool from ~16 rows on and waits ~25 us for a
// pool thread to wake (docs/engine.md, "A verification's small ops"). Here each row is summed
// by the same code whatever the batch: sixteen running sums over the row, then a fixed tree,
// so a row normalises to the same bits alone or among any others.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "isa.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jengine {
namespace {

#define JE_IMPL_HEADER "rms_norm_impl.h"
#include "per_isa.h"
#undef JE_IMPL_HEADER

template <typename X, typename W, typename Y>
void NormRowsAt(int32_t isa, const void* x, const void* w, void* y, int64_t rows, int64_t n,
                float eps, float offset) {
#if JE_X86
  if (isa == kAvx512) return avx512::NormRows<X, W, Y>(x, w, y, rows, n, eps, offset);
  if (isa == kAvx2) return avx2::NormRows<X, W, Y>(x, w, y, rows, n, eps, offset);
#endif
  portable::NormRows<X, W, Y>(x, w, y, rows, n, eps, offset);
}

template <typename X, typename W>
void NormRowsTo(int32_t isa, bool y_bf16, const void* x, const void* w, void* y, int64_t rows,
                int64_t n, float eps, float offset) {
  if (y_bf16) {
    NormRowsAt<X, W, Bf16>(isa, x, w, y, rows, n, eps, offset);
  } else {
    NormRowsAt<X, W, float>(isa, x, w, y, rows, n, eps, offset);
  }
}

// isa 0: the instruction set `auto` picks here; else whether that one runs here (1 or 0).
int RmsNormIsa(int isa) { return isa == kAuto ? BestIsa() : Supports(isa) ? 1 : 0; }

ffi::Error RmsNorm(ffi::AnyBuffer x, ffi::AnyBuffer weight, float eps, float offset,
                   int32_t isa, ffi::Result<ffi::AnyBuffer> y) {
  static const int32_t best = BestIsa();
  if (isa == kAuto) isa = best;
  if (isa < kPortable || isa > kAvx512 || !Supports(isa)) {
    return ffi::Error::InvalidArgument("rms norm: instruction set not supported here");
  }
  const auto xd = x.dimensions();
  const auto float_type = [](ffi::DataType t) { return t == ffi::F32 || t == ffi::BF16; };
  if (xd.size() != 2 || weight.element_count() != xd[1] || !float_type(x.element_type()) ||
      !float_type(weight.element_type()) || !float_type(y->element_type()) ||
      y->element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument(
        "rms norm: expected x [R, E] and weight [E], f32 or bf16, and y of x's shape");
  }
  const bool x_bf16 = x.element_type() == ffi::BF16, w_bf16 = weight.element_type() == ffi::BF16;
  const bool y_bf16 = y->element_type() == ffi::BF16;
  const void *xp = x.untyped_data(), *wp = weight.untyped_data();
  void* yp = y->untyped_data();
  if (x_bf16 && w_bf16) NormRowsTo<Bf16, Bf16>(isa, y_bf16, xp, wp, yp, xd[0], xd[1], eps, offset);
  if (x_bf16 && !w_bf16) NormRowsTo<Bf16, float>(isa, y_bf16, xp, wp, yp, xd[0], xd[1], eps, offset);
  if (!x_bf16 && w_bf16) NormRowsTo<float, Bf16>(isa, y_bf16, xp, wp, yp, xd[0], xd[1], eps, offset);
  if (!x_bf16 && !w_bf16) NormRowsTo<float, float>(isa, y_bf16, xp, wp, yp, xd[0], xd[1], eps, offset);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jengine

JE_EXPORT XLA_FFI_Error* JengineRmsNorm(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JengineRmsNorm, jengine::RmsNorm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x [R, E]: f32 or bf16
                                  .Arg<ffi::AnyBuffer>()  // weight [E]: f32 or bf16
                                  .Attr<float>("eps")
                                  .Attr<float>("offset")
                                  .Attr<int32_t>("isa")  // 0 auto, 1 portable, 2 AVX2, 3 AVX-512
                                  .Ret<ffi::AnyBuffer>());  // y [R, E]

JE_FFI_TARGET("jengine_rms_norm", JengineRmsNorm);
JE_ISAS("rms_norm", jengine::RmsNormIsa,
        {{"auto", jengine::kAuto}, {"portable", jengine::kPortable}, {"avx2", jengine::kAvx2},
         {"avx512", jengine::kAvx512}});
