// Compiles a kernel body once per instruction set: the includer defines JE_IMPL_HEADER (the
// body's quoted file name) and includes this file inside its own namespace; the body lands in
// the namespaces portable / avx2 / avx512 with JE_SIMD 0 / 1 / 2 under the matching target
// pragma (the SIMD copies on x86 only). isa.h says which of them runs here. No include guard on
// purpose.

namespace portable {
#define JE_SIMD 0
#include JE_IMPL_HEADER
#undef JE_SIMD
}  // namespace portable

#if defined(__x86_64__) || defined(__i386__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
namespace avx2 {
#define JE_SIMD 1
#include JE_IMPL_HEADER
#undef JE_SIMD
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
#endif
namespace avx512 {
#define JE_SIMD 2
#include JE_IMPL_HEADER
#undef JE_SIMD
}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
