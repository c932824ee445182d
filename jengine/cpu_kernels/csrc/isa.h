// The instruction sets the native CPU kernels are compiled for (per_isa.h), and which of them
// this CPU runs: the `isa` attribute of each FFI handler takes these codes.

#ifndef JENGINE_ISA_H_
#define JENGINE_ISA_H_

#include <cstdint>
#include <initializer_list>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define JE_X86 1
#endif

// Only the symbols marked so leave a library (each is built with -fvisibility=hidden).
#define JE_EXPORT extern "C" __attribute__((visibility("default")))

namespace jengine {

// kAmx (attention only): AVX-512F, with prefill blocks of a bf16 cache on the AMX tiles.
enum Isa : int32_t { kAuto = 0, kPortable = 1, kAvx2 = 2, kAvx512 = 3, kAmx = 4 };

inline bool Supports(int32_t isa) {
#if JE_X86
  if (isa == kAvx512) return __builtin_cpu_supports("avx512f");
  if (isa == kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return isa == kPortable;
}

// What `auto` runs here: AVX-512F, else AVX2+FMA, else portable C++.
inline int32_t BestIsa() {
  for (int32_t isa : {kAvx512, kAvx2}) {
    if (Supports(isa)) return isa;
  }
  return kPortable;
}

}  // namespace jengine

#endif  // JENGINE_ISA_H_
