// The row kernel of rms_norm.cc, compiled once per instruction set (per_isa.h includes it in
// the namespaces portable / avx2 / avx512). Plain loops the compiler vectorises at each
// target's width; a row's order of additions is the same at every width (sixteen running sums,
// then a fixed tree). No include guard on purpose.

// ToF32, Bf16RoundedBits and F32ToBf16 are bf16.h's.
inline void Store(float* p, float f) { *p = f; }
inline void Store(Bf16* p, float f) { p->bits = F32ToBf16(f); }

inline float Round(float f, float) { return f; }
inline float Round(float f, Bf16) {
  const uint32_t u = Bf16RoundedBits(f);
  float r;
  std::memcpy(&r, &u, sizeof(r));
  return r;
}

constexpr int kLanes = 16;  // running sums of a row's squares

// y [n] = the norm of x [n] (see RmsNorm); buf holds n floats.
template <typename X, typename W, typename Y>
void NormRow(const X* x, const W* w, Y* y, int64_t n, float eps, float offset, float* buf) {
  for (int64_t i = 0; i < n; ++i) buf[i] = ToF32(x[i]);
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += buf[i + j] * buf[i + j];
  }
  for (int j = 0; i < n; ++i, ++j) acc[j] += buf[i] * buf[i];
  for (int width = kLanes / 2; width > 0; width /= 2) {  // a fixed tree
    for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
  }
  const float scale = 1.0f / std::sqrt(acc[0] / static_cast<float>(n) + eps);
  if (offset != 0.0f) {  // Gemma: normed * (offset + w), rounded once
    for (int64_t k = 0; k < n; ++k) Store(y + k, buf[k] * scale * (offset + ToF32(w[k])));
  } else {  // w * normed rounded to x's dtype first, as torch's `weight * x.to(dtype)`
    for (int64_t k = 0; k < n; ++k) Store(y + k, ToF32(w[k]) * Round(buf[k] * scale, X{}));
  }
}

template <typename X, typename W, typename Y>
void NormRows(const void* xp, const void* wp, void* yp, int64_t rows, int64_t n, float eps,
              float offset) {
  std::vector<float> buf(n);
  for (int64_t r = 0; r < rows; ++r) {
    NormRow(static_cast<const X*>(xp) + r * n, static_cast<const W*>(wp),
            static_cast<Y*>(yp) + r * n, n, eps, offset, buf.data());
  }
}

