#include "kernels/cpu/outer_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ALOE_STREAMING_STORES 1
#endif

// Built with -O3 and OpenMP (kernels/CMakeLists.txt): `omp simd` tells the compiler the
// iterations are independent, which also holds for exact in-place aliasing because each
// iteration reads its inputs before writing element i.
//
// The build targets x86-64-v2 (SSE4.2) so the binaries run on any x86-64 host of the last decade;
// ALOE_VECTOR_CLONES also builds an AVX2 version of a kernel, which the loader picks on hosts that
// have AVX2 (GCC target_clones, an ifunc resolved once). AVX2 without FMA: every element is the
// same IEEE operations in the same order as on SSE, so the results are bit for bit those of the
// baseline build (no fused multiply-add, no reordered sums). Not on SquaredL2Norm, whose double
// sum a wider vector would add in another order. Measured on the 2-core AMD EPYC dev host
// (AVX2 and AVX-512): screening a 1 MiB piece in L2 38 -> 73 GB/s, an in-place SGD step on 16 MiB
// 18 -> 21 GB/s.

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ALOE_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define ALOE_VECTOR_CLONES
#endif

namespace aloe::kernels {
namespace {

constexpr uint32_t kExponentMask = 0x7f800000u;  // float32 exponent bits; all set = NaN or Inf

inline uint32_t NonFiniteBit(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return static_cast<uint32_t>((bits & kExponentMask) == kExponentMask);
}

}  // namespace

// The element loops of the outer steps. The public kernels below run them, or, for an
// out-of-place step on an AVX2 host, run them only on the few elements before and after the
// part of theta_out they write with streaming stores.
namespace loops {

ALOE_VECTOR_CLONES void SgdApplyLoop(const float* g, const float* theta_in, float* theta_out,
                                     size_t n, float lr) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    theta_out[i] = theta_in[i] - lr * g[i];
  }
}

ALOE_VECTOR_CLONES void NesterovApplyLoop(const float* g, float* m, const float* theta_in,
                                          float* theta_out, size_t n, float lr, float beta) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = beta * m[i] + gi;
    const float theta = theta_in[i];
    m[i] = mi;
    theta_out[i] = theta - lr * (beta * mi + gi);
  }
}

ALOE_VECTOR_CLONES void DelayedNesterovApplyLoop(const float* g, float* m, float* d,
                                                 const float* theta_in, float* theta_out, size_t n,
                                                 float lr, float beta, uint32_t buffer_size,
                                                 float c, bool momentum_step) {
  const float inv_n = 1.0f / static_cast<float>(buffer_size);
  if (momentum_step) {
    // m = beta*m + D/N; theta -= lr*((1 - cN + c)*beta*m + g/N); D = 0.
    const float coef = (1.0f - c * static_cast<float>(buffer_size) + c) * beta;
#pragma omp simd
    for (size_t i = 0; i < n; ++i) {
      const float gi = g[i];
      const float mi = beta * m[i] + (d[i] + gi) * inv_n;
      const float theta = theta_in[i];
      m[i] = mi;
      d[i] = 0.0f;
      theta_out[i] = theta - lr * (coef * mi + gi * inv_n);
    }
    return;
  }
  // D += g; theta -= lr*(c*beta*m + g/N).
  const float coef = c * beta;
  if (coef == 0.0f) {
#pragma omp simd
    for (size_t i = 0; i < n; ++i) {
      const float gi = g[i];
      const float theta = theta_in[i];
      d[i] += gi;
      theta_out[i] = theta - lr * (gi * inv_n);
    }
    return;
  }
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float theta = theta_in[i];
    d[i] += gi;
    theta_out[i] = theta - lr * (coef * m[i] + gi * inv_n);
  }
}

ALOE_VECTOR_CLONES void AdamApplyLoop(const float* g, float* m, float* v, const float* theta_in,
                                      float* theta_out, size_t n, float step_size, float beta1,
                                      float beta2, float eps, float inv_sqrt_bias2) {
  const float one_minus_beta1 = 1.0f - beta1;
  const float one_minus_beta2 = 1.0f - beta2;
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = beta1 * m[i] + one_minus_beta1 * gi;
    const float vi = beta2 * v[i] + one_minus_beta2 * (gi * gi);
    const float theta = theta_in[i];
    m[i] = mi;
    v[i] = vi;
    theta_out[i] = theta - step_size * mi / (std::sqrt(vi) * inv_sqrt_bias2 + eps);
  }
}

}  // namespace loops

#ifdef ALOE_STREAMING_STORES
namespace {

// An out-of-place step (theta_out != theta_in: copy on write, because an older version still
// uses the buffer) writes a fresh buffer that nothing reads soon. Stored through the cache, each
// of its lines is first read from memory (read for ownership); streaming stores skip that read.
// Measured on the 2-core AMD EPYC dev host, an SGD step on 8 MiB of cold buffers: in place
// 14-15 GB/s of g, out of place 8-10 GB/s through the cache, 11.7-12.5 GB/s streamed. The
// streamed loops below do the same IEEE operations in the same order as the loops above (no
// FMA), so the results are bit for bit the same.
constexpr size_t kStreamMinElements = 64;  // below a few cache lines streaming buys nothing

__attribute__((target("avx2"))) void SgdApplyStream(const float* g, const float* theta_in,
                                                    float* theta_out, size_t n, float lr) {
  const __m256 vlr = _mm256_set1_ps(lr);
  for (size_t i = 0; i < n; i += 8) {
    const __m256 gi = _mm256_loadu_ps(g + i);
    const __m256 theta = _mm256_loadu_ps(theta_in + i);
    _mm256_stream_ps(theta_out + i, _mm256_sub_ps(theta, _mm256_mul_ps(vlr, gi)));
  }
}

__attribute__((target("avx2"))) void NesterovApplyStream(const float* g, float* m,
                                                         const float* theta_in, float* theta_out,
                                                         size_t n, float lr, float beta) {
  const __m256 vlr = _mm256_set1_ps(lr);
  const __m256 vbeta = _mm256_set1_ps(beta);
  for (size_t i = 0; i < n; i += 8) {
    const __m256 gi = _mm256_loadu_ps(g + i);
    const __m256 mi = _mm256_add_ps(_mm256_mul_ps(vbeta, _mm256_loadu_ps(m + i)), gi);
    const __m256 theta = _mm256_loadu_ps(theta_in + i);
    _mm256_storeu_ps(m + i, mi);
    const __m256 step = _mm256_mul_ps(vlr, _mm256_add_ps(_mm256_mul_ps(vbeta, mi), gi));
    _mm256_stream_ps(theta_out + i, _mm256_sub_ps(theta, step));
  }
}

__attribute__((target("avx2"))) void DelayedNesterovApplyStream(
    const float* g, float* m, float* d, const float* theta_in, float* theta_out, size_t n, float lr,
    float beta, uint32_t buffer_size, float c, bool momentum_step) {
  // The scalar coefficients exactly as DelayedNesterovApplyLoop forms them.
  const float inv_n = 1.0f / static_cast<float>(buffer_size);
  const __m256 vlr = _mm256_set1_ps(lr);
  const __m256 vinv = _mm256_set1_ps(inv_n);
  if (momentum_step) {
    const __m256 vbeta = _mm256_set1_ps(beta);
    const __m256 vcoef = _mm256_set1_ps((1.0f - c * static_cast<float>(buffer_size) + c) * beta);
    const __m256 zero = _mm256_setzero_ps();
    for (size_t i = 0; i < n; i += 8) {
      const __m256 gi = _mm256_loadu_ps(g + i);
      const __m256 di = _mm256_add_ps(_mm256_loadu_ps(d + i), gi);
      const __m256 mi =
          _mm256_add_ps(_mm256_mul_ps(vbeta, _mm256_loadu_ps(m + i)), _mm256_mul_ps(di, vinv));
      const __m256 theta = _mm256_loadu_ps(theta_in + i);
      _mm256_storeu_ps(m + i, mi);
      _mm256_storeu_ps(d + i, zero);
      const __m256 step =
          _mm256_mul_ps(vlr, _mm256_add_ps(_mm256_mul_ps(vcoef, mi), _mm256_mul_ps(gi, vinv)));
      _mm256_stream_ps(theta_out + i, _mm256_sub_ps(theta, step));
    }
    return;
  }
  const float coef = c * beta;
  const __m256 vcoef = _mm256_set1_ps(coef);
  for (size_t i = 0; i < n; i += 8) {
    const __m256 gi = _mm256_loadu_ps(g + i);
    const __m256 theta = _mm256_loadu_ps(theta_in + i);
    _mm256_storeu_ps(d + i, _mm256_add_ps(_mm256_loadu_ps(d + i), gi));
    // coef == 0: m is not read (the loop's shortcut; 0 * m is 0 for a finite m).
    const __m256 scaled = _mm256_mul_ps(gi, vinv);
    const __m256 inner =
        coef == 0.0f ? scaled : _mm256_add_ps(_mm256_mul_ps(vcoef, _mm256_loadu_ps(m + i)), scaled);
    _mm256_stream_ps(theta_out + i, _mm256_sub_ps(theta, _mm256_mul_ps(vlr, inner)));
  }
}

__attribute__((target("avx2"))) void AdamApplyStream(const float* g, float* m, float* v,
                                                     const float* theta_in, float* theta_out,
                                                     size_t n, float step_size, float beta1,
                                                     float beta2, float eps, float inv_sqrt_bias2) {
  const __m256 vbeta1 = _mm256_set1_ps(beta1);
  const __m256 vbeta2 = _mm256_set1_ps(beta2);
  const __m256 vomb1 = _mm256_set1_ps(1.0f - beta1);
  const __m256 vomb2 = _mm256_set1_ps(1.0f - beta2);
  const __m256 vstep = _mm256_set1_ps(step_size);
  const __m256 veps = _mm256_set1_ps(eps);
  const __m256 vbias = _mm256_set1_ps(inv_sqrt_bias2);
  for (size_t i = 0; i < n; i += 8) {
    const __m256 gi = _mm256_loadu_ps(g + i);
    const __m256 mi =
        _mm256_add_ps(_mm256_mul_ps(vbeta1, _mm256_loadu_ps(m + i)), _mm256_mul_ps(vomb1, gi));
    const __m256 vi = _mm256_add_ps(_mm256_mul_ps(vbeta2, _mm256_loadu_ps(v + i)),
                                    _mm256_mul_ps(vomb2, _mm256_mul_ps(gi, gi)));
    const __m256 theta = _mm256_loadu_ps(theta_in + i);
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vi), vbias), veps);
    const __m256 step = _mm256_div_ps(_mm256_mul_ps(vstep, mi), denom);
    _mm256_stream_ps(theta_out + i, _mm256_sub_ps(theta, step));
  }
}

}  // namespace
#endif

// The streamed twin of an outer step's loop; without streaming stores the loop itself, which
// OuterStep then never runs as the twin.
#ifdef ALOE_STREAMING_STORES
#define ALOE_STREAMED(kernel) kernel##Stream
#else
#define ALOE_STREAMED(kernel) loops::kernel##Loop
#endif

namespace {

// Runs an outer step as step(kernel, offset, count): `kernel` (a loop or its streamed twin, of
// the same signature) on elements [offset, offset + count). Out of place (theta_out !=
// theta_in) on an AVX2 host the twin writes the groups of 8 from theta_out's first 32-byte
// boundary on, and the loop the elements before and after them; otherwise the loop does all.
template <typename Kernel, typename Step>
void OuterStep(const float* theta_in, const float* theta_out, size_t n, Kernel loop,
               Kernel streamed, Step step) {
#ifdef ALOE_STREAMING_STORES
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2 && theta_out != theta_in && n >= kStreamMinElements) {
    const size_t head =
        std::min(n, ((32 - (reinterpret_cast<uintptr_t>(theta_out) & 31)) & 31) / sizeof(float));
    const size_t body = (n - head) / 8 * 8;
    step(loop, 0, head);
    step(streamed, head, body);
    step(loop, head + body, n - head - body);
    _mm_sfence();  // the streamed lines are visible before the caller publishes the buffer
    return;
  }
#else
  (void)streamed;
#endif
  step(loop, 0, n);
}

}  // namespace

void SgdApply(const float* g, const float* theta_in, float* theta_out, size_t n, float lr) {
  OuterStep(
      theta_in, theta_out, n, loops::SgdApplyLoop, ALOE_STREAMED(SgdApply),
      [&](auto kernel, size_t o, size_t k) { kernel(g + o, theta_in + o, theta_out + o, k, lr); });
}

void NesterovApply(const float* g, float* m, const float* theta_in, float* theta_out, size_t n,
                   float lr, float beta) {
  OuterStep(theta_in, theta_out, n, loops::NesterovApplyLoop, ALOE_STREAMED(NesterovApply),
            [&](auto kernel, size_t o, size_t k) {
              kernel(g + o, m + o, theta_in + o, theta_out + o, k, lr, beta);
            });
}

void DelayedNesterovApply(const float* g, float* m, float* d, const float* theta_in,
                          float* theta_out, size_t n, float lr, float beta, uint32_t buffer_size,
                          float c, bool momentum_step) {
  OuterStep(theta_in, theta_out, n, loops::DelayedNesterovApplyLoop,
            ALOE_STREAMED(DelayedNesterovApply), [&](auto kernel, size_t o, size_t k) {
              kernel(g + o, m + o, d + o, theta_in + o, theta_out + o, k, lr, beta, buffer_size, c,
                     momentum_step);
            });
}

void AdamApply(const float* g, float* m, float* v, const float* theta_in, float* theta_out,
               size_t n, float step_size, float beta1, float beta2, float eps,
               float inv_sqrt_bias2) {
  OuterStep(theta_in, theta_out, n, loops::AdamApplyLoop, ALOE_STREAMED(AdamApply),
            [&](auto kernel, size_t o, size_t k) {
              kernel(g + o, m + o, v + o, theta_in + o, theta_out + o, k, step_size, beta1, beta2,
                     eps, inv_sqrt_bias2);
            });
}

#undef ALOE_STREAMED

ALOE_VECTOR_CLONES void WeightedAccumulate(const float* x, float w, float* acc, size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    acc[i] += w * x[i];
  }
}

ALOE_VECTOR_CLONES void Scale(float* x, size_t n, float s) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    x[i] *= s;
  }
}

ALOE_VECTOR_CLONES void ScaledCopy(const float* x, float w, float* out, size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    out[i] = w * x[i];
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

double SquaredL2NormOfBytes(const void* in, size_t n) {
  // 16 lanes (lane k adds the values i with i % 16 == k), each squaring and adding blocks of 64
  // of its values in float before it adds the block's sum to its double total. SquaredL2Norm's
  // loop, bound by converting every value to double, managed about one value a cycle (10-13
  // GB/s on values in L2: 16% of a single-process server's time under full-speed ingest); this
  // one 31 GB/s (Intel Xeon VM). The SSE2 loop and the portable one add in the same order: the
  // same result on every host.
  constexpr size_t kLanes = 16;
  constexpr size_t kBlock = kLanes * 64;
  const auto* bytes = static_cast<const unsigned char*>(in);
  double total[kLanes] = {};
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    float block[kLanes];
#if defined(__x86_64__) && defined(__GNUC__)  // SSE2 (immintrin.h above)
    __m128 acc[kLanes / 4];
    for (__m128& a : acc) a = _mm_setzero_ps();
    for (size_t j = 0; j < kBlock; j += kLanes) {
      for (size_t q = 0; q < kLanes / 4; ++q) {
        const __m128 v =
            _mm_loadu_ps(reinterpret_cast<const float*>(bytes + (i + j + 4 * q) * sizeof(float)));
        acc[q] = _mm_add_ps(acc[q], _mm_mul_ps(v, v));
      }
    }
    for (size_t q = 0; q < kLanes / 4; ++q) _mm_storeu_ps(block + 4 * q, acc[q]);
#else
    for (float& b : block) b = 0.0f;
    for (size_t j = 0; j < kBlock; j += kLanes) {
      for (size_t k = 0; k < kLanes; ++k) {
        float x;
        std::memcpy(&x, bytes + (i + j + k) * sizeof(float), sizeof(x));
        block[k] += x * x;
      }
    }
#endif
    for (size_t k = 0; k < kLanes; ++k) total[k] += block[k];
  }
  for (size_t k = 0; i < n; ++i, k = (k + 1) % kLanes) {
    float x;
    std::memcpy(&x, bytes + i * sizeof(float), sizeof(x));
    total[k] += static_cast<double>(x) * x;
  }
  double sum = 0.0;
  for (double t : total) sum += t;
  return sum;
}

ALOE_VECTOR_CLONES bool AllFinite(const float* x, size_t n) {
  // Bit test rather than std::isfinite or x*0 tricks: stays correct under -ffast-math.
  uint32_t non_finite = 0;
#pragma omp simd reduction(| : non_finite)
  for (size_t i = 0; i < n; ++i) {
    non_finite |= NonFiniteBit(x[i]);
  }
  return non_finite == 0;
}

ALOE_VECTOR_CLONES bool CopyWithinMagnitude(const void* in, float* out, size_t n, float limit) {
  // |x| <= limit as an integer compare of the magnitude bits: IEEE-754 orders non-negative
  // floats like their bit patterns, and NaN/Inf patterns lie above every finite limit's.
  // The bits of |limit|: limit -0.0f admits the zeros, as 0.0f does (its sign bit would
  // otherwise put every pattern, NaN included, below it).
  uint32_t limit_bits;
  std::memcpy(&limit_bits, &limit, sizeof(limit_bits));
  limit_bits &= 0x7fffffffu;
  const auto* bytes = static_cast<const unsigned char*>(in);
  uint32_t over = 0;
#pragma omp simd reduction(| : over)
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, bytes + i * sizeof(float), sizeof(bits));
    std::memcpy(out + i, &bits, sizeof(bits));
    over |= static_cast<uint32_t>((bits & 0x7fffffffu) > limit_bits);
  }
  return over == 0;
}

#ifdef ALOE_STREAMING_STORES
namespace {

// StreamWithinMagnitude on AVX2: CopyWithinMagnitude up to a 32-byte boundary of out, then 8
// floats per aligned streaming store, then CopyWithinMagnitude for the tail. The magnitude bits
// of a float are non-negative as int32, so the signed compare orders them as the unsigned one
// (CopyWithinMagnitude's) does.
__attribute__((target("avx2"))) bool StreamWithinMagnitudeAvx2(const unsigned char* in, float* out,
                                                               size_t n, float limit) {
  const size_t head =
      std::min(n, ((32 - (reinterpret_cast<uintptr_t>(out) & 31)) & 31) / sizeof(float));
  bool ok = CopyWithinMagnitude(in, out, head, limit);
  uint32_t limit_bits;
  std::memcpy(&limit_bits, &limit, sizeof(limit_bits));
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  const __m256i limit_lanes = _mm256_set1_epi32(static_cast<int>(limit_bits & 0x7fffffffu));
  __m256i over = _mm256_setzero_si256();
  size_t i = head;
  for (; i + 8 <= n; i += 8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i * sizeof(float)));
    over = _mm256_or_si256(over, _mm256_cmpgt_epi32(_mm256_and_si256(v, magnitude), limit_lanes));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i), v);
  }
  ok &= CopyWithinMagnitude(in + i * sizeof(float), out + i, n - i, limit);
  _mm_sfence();  // the streamed lines are visible before anyone is told the copy is done
  return ok && _mm256_testz_si256(over, over);
}

}  // namespace
#endif

bool StreamWithinMagnitude(const void* in, float* out, size_t n, float limit) {
#ifdef ALOE_STREAMING_STORES
  // Below a few cache lines streaming buys nothing.
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2 && n >= 64) {
    return StreamWithinMagnitudeAvx2(static_cast<const unsigned char*>(in), out, n, limit);
  }
#endif
  return CopyWithinMagnitude(in, out, n, limit);
}

ALOE_VECTOR_CLONES bool AllWithinMagnitude(const float* x, size_t n, float limit) {
  // As CopyWithinMagnitude: an integer compare of the magnitude bits.
  uint32_t limit_bits;
  std::memcpy(&limit_bits, &limit, sizeof(limit_bits));
  limit_bits &= 0x7fffffffu;
  uint32_t over = 0;
#pragma omp simd reduction(| : over)
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    over |= static_cast<uint32_t>((bits & 0x7fffffffu) > limit_bits);
  }
  return over == 0;
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

void DelayedNesterovApply(const float* g, float* m, float* d, const float* theta_in,
                          float* theta_out, size_t n, float lr, float beta, uint32_t buffer_size,
                          float c, bool momentum_step) {
  const float big_n = static_cast<float>(buffer_size);
  for (size_t i = 0; i < n; ++i) {
    d[i] += g[i];
    if (momentum_step) {
      m[i] = beta * m[i] + d[i] / big_n;
      theta_out[i] = theta_in[i] - lr * ((1.0f - c * big_n + c) * beta * m[i] + g[i] / big_n);
      d[i] = 0.0f;
    } else {
      theta_out[i] = theta_in[i] - lr * (c * beta * m[i] + g[i] / big_n);
    }
  }
}

void AdamApply(const float* g, float* m, float* v, const float* theta_in, float* theta_out,
               size_t n, float step_size, float beta1, float beta2, float eps,
               float inv_sqrt_bias2) {
  for (size_t i = 0; i < n; ++i) {
    m[i] = beta1 * m[i] + (1.0f - beta1) * g[i];
    v[i] = beta2 * v[i] + (1.0f - beta2) * g[i] * g[i];
    theta_out[i] = theta_in[i] - step_size * m[i] / (std::sqrt(v[i]) * inv_sqrt_bias2 + eps);
  }
}

void WeightedAccumulate(const float* x, float w, float* acc, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += w * x[i];
}

void Scale(float* x, size_t n, float s) {
  for (size_t i = 0; i < n; ++i) x[i] *= s;
}

void ScaledCopy(const float* x, float w, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = w * x[i];
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

bool CopyWithinMagnitude(const void* in, float* out, size_t n, float limit) {
  bool ok = true;
  for (size_t i = 0; i < n; ++i) {
    std::memcpy(out + i, static_cast<const char*>(in) + i * sizeof(float), sizeof(float));
    if (!(std::fabs(out[i]) <= limit)) ok = false;
  }
  return ok;
}

bool AllWithinMagnitude(const float* x, size_t n, float limit) {
  bool ok = true;
  for (size_t i = 0; i < n; ++i) {
    if (!(std::fabs(x[i]) <= std::fabs(limit))) ok = false;
  }
  return ok;
}

}  // namespace reference
}  // namespace aloe::kernels
