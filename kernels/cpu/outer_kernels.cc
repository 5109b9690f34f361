#include "kernels/cpu/outer_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>

// Built with -O3 and OpenMP (kernels/CMakeLists.txt): `omp simd` tells the compiler the
// iterations are independent, which also holds for exact in-place aliasing because each
// iteration reads its inputs before writing element i.

namespace aloe::kernels {
namespace {

constexpr uint32_t kExponentMask = 0x7f800000u;  // float32 exponent bits; all set = NaN or Inf

inline uint32_t NonFiniteBit(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return static_cast<uint32_t>((bits & kExponentMask) == kExponentMask);
}

}  // namespace

void SgdApply(const float* g, const float* theta_in, float* theta_out, size_t n, float lr) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    theta_out[i] = theta_in[i] - lr * g[i];
  }
}

void NesterovApply(const float* g, float* m, const float* theta_in, float* theta_out, size_t n,
                   float lr, float beta) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = beta * m[i] + gi;
    const float theta = theta_in[i];
    m[i] = mi;
    theta_out[i] = theta - lr * (beta * mi + gi);
  }
}

void WeightedAccumulate(const float* x, float w, float* acc, size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    acc[i] += w * x[i];
  }
}

void Scale(float* x, size_t n, float s) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    x[i] *= s;
  }
}

double SquaredL2Norm(const float* x, size_t n) {
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (size_t i = 0; i < n; ++i) {
    const double v = x[i];
    sum += v * v;
  }
  return sum;
}

bool AllFinite(const float* x, size_t n) {
  // Bit test rather than std::isfinite or x*0 tricks: stays correct under -ffast-math.
  uint32_t non_finite = 0;
#pragma omp simd reduction(| : non_finite)
  for (size_t i = 0; i < n; ++i) {
    non_finite |= NonFiniteBit(x[i]);
  }
  return non_finite == 0;
}

namespace reference {

void SgdApply(const float* g, const float* theta_in, float* theta_out, size_t n, float lr) {
  for (size_t i = 0; i < n; ++i) theta_out[i] = theta_in[i] - lr * g[i];
}

void NesterovApply(const float* g, float* m, const float* theta_in, float* theta_out, size_t n,
                   float lr, float beta) {
  for (size_t i = 0; i < n; ++i) {
    m[i] = beta * m[i] + g[i];
    // theta_out may be theta_in: theta_in[i] is read before theta_out[i] is written.
    theta_out[i] = theta_in[i] - lr * (beta * m[i] + g[i]);
  }
}

void WeightedAccumulate(const float* x, float w, float* acc, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += w * x[i];
}

void Scale(float* x, size_t n, float s) {
  for (size_t i = 0; i < n; ++i) x[i] *= s;
}

double SquaredL2Norm(const float* x, size_t n) {
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return sum;
}

bool AllFinite(const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return false;
  }
  return true;
}

}  // namespace reference
}  // namespace aloe::kernels
