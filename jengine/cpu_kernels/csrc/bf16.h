// bfloat16 <-> float32, one scalar at a time, for the native kernels: a bf16 is the upper 16
// bits of the f32 it stands for, so widening is a shift, and narrowing rounds to nearest even as
// XLA's convert does (a NaN stays a NaN, made quiet). The vector loads are each kernel's own.
//
// ToF32 widens every element type the kernels read (f32, int8, bf16) and all its overloads are
// here, in namespace jengine: the per-instruction-set code (per_isa.h) calls it unqualified, and
// an overload declared in a nearer namespace (as small_matmul.cc's int8 one was, in its
// anonymous namespace) would hide the others for a float argument, which would then convert.

#ifndef JENGINE_BF16_H_
#define JENGINE_BF16_H_

#include <cstdint>
#include <cstring>

namespace jengine {

struct Bf16 {  // a bfloat16 as stored: the upper 16 bits of the f32 it stands for
  uint16_t bits;
};

inline float Bf16ToF32(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// f rounded to bf16, as the f32 bits of the rounded value (the low 16 bits zero).
inline uint32_t Bf16RoundedBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const uint32_t quiet = (u | 0x00400000u) & 0xffff0000u;
  return (u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded;
}

inline uint16_t F32ToBf16(float f) { return static_cast<uint16_t>(Bf16RoundedBits(f) >> 16); }

inline float ToF32(float v) { return v; }
inline float ToF32(int8_t v) { return static_cast<float>(v); }
inline float ToF32(Bf16 v) { return Bf16ToF32(v.bits); }

}  // namespace jengine

#endif  // JENGINE_BF16_H_
