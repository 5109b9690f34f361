// Fused single-pass CPU loops for the server's outer step and the codecs: the outer optimizers
// (docs/algorithms.md, "Outer optimizers"), pseudo-gradient averaging, norms and finiteness checks.
//
// Why fused: on the target hosts one OpenMP-SIMD pass over raw float pointers runs at 35-41 GB/s
// while a chain of separate element-wise ops is 2-8x slower, so every kernel reads each input
// once and writes each output once.
//
// Contract shared by all kernels:
//   - Single-threaded, no allocation, no synchronisation. Callers that want parallelism split a
//     tensor into disjoint chunks and call the kernel on each chunk from its own thread.
//   - n may be 0 (then the pointers may be null and nothing is touched).
//   - An output may be the very same pointer as an input of the same length (in-place update);
//     partially overlapping buffers are not allowed.
//   - No checks for NaN/Inf: non-finite inputs propagate (use AllFinite to screen inputs).
//   - The outer steps (SgdApply, NesterovApply, DelayedNesterovApply, AdamApply) out of place
//     (theta_out != theta_in: a copy-on-write step) write theta_out with streaming stores on
//     AVX2 hosts, bypassing the cache; the result is bit for bit the in-place step's.
//
// Every kernel has a plain scalar twin of the same signature in aloe::kernels::reference, used by
// tests as the definition of the result.
#pragma once

#include <cstddef>
#include <cstdint>

namespace aloe::kernels {

// Outer SGD: theta_out[i] = theta_in[i] - lr * g[i].
void SgdApply(const float* g, const float* theta_in, float* theta_out, size_t n, float lr);

// Outer Nesterov, paper 002 Eq. 4 (DiLoCo's outer optimizer), in one pass:
//   m[i] = beta * m[i] + g[i];  theta_out[i] = theta_in[i] - lr * (beta * m[i] + g[i])
// where the second line uses the already-updated m. m is read and written in place.
void NesterovApply(const float* g, float* m, const float* theta_in, float* theta_out, size_t n,
                   float lr, float beta);

// Delayed Nesterov (DN), paper 002 Alg. 3, one received pseudo-gradient g in one pass over
// theta, g, m (momentum) and d (the buffer Delta), N = buffer_size >= 1, c in [0, 1/N]:
//   d[i] += g[i]
//   if momentum_step (the caller's (t+1) % N == 0, t = updates applied before this one):
//     m[i] = beta * m[i] + d[i] / N
//     theta_out[i] = theta_in[i] - lr * ((1 - c*N + c) * beta * m[i] + g[i] / N)   (new m)
//     d[i] = 0
//   else (m unchanged):
//     theta_out[i] = theta_in[i] - lr * (c * beta * m[i] + g[i] / N)
// The divisions by N are multiplications by the float 1/N (exact for N a power of two, else
// within an ulp); the scalar coefficients ((1 - c*N + c) * beta, c * beta) are formed once in
// float. With N = 1 and c = 0 every call is a momentum step and the result is bit for bit
// NesterovApply. When c * beta == 0 on a non-momentum step, m is not read (c*beta*m is 0 for the
// finite m an optimizer keeps), so that step moves 20 bytes per element instead of 24.
// m and d are updated in place and must not alias each other, g or theta.
void DelayedNesterovApply(const float* g, float* m, float* d, const float* theta_in,
                          float* theta_out, size_t n, float lr, float beta, uint32_t buffer_size,
                          float c, bool momentum_step);

// Outer Adam (Kingma & Ba, Alg. 1, without weight decay), one pass; used only for comparison
// with the Nesterov family. step_size = lr / (1 - beta1^t) and inv_sqrt_bias2 =
// 1 / sqrt(1 - beta2^t) are the bias corrections of step t >= 1, computed by the caller:
//   m[i] = beta1 * m[i] + (1 - beta1) * g[i]
//   v[i] = beta2 * v[i] + (1 - beta2) * g[i]^2
//   theta_out[i] = theta_in[i] - step_size * m[i] / (sqrt(v[i]) * inv_sqrt_bias2 + eps)
// i.e. theta -= lr * m_hat / (sqrt(v_hat) + eps) with m_hat = m / (1 - beta1^t),
// v_hat = v / (1 - beta2^t). m and v are updated in place and must not alias anything else.
void AdamApply(const float* g, float* m, float* v, const float* theta_in, float* theta_out,
               size_t n, float step_size, float beta1, float beta2, float eps,
               float inv_sqrt_bias2);

// acc[i] += w * x[i]  (weighted average of pseudo-gradients, one update at a time).
void WeightedAccumulate(const float* x, float w, float* acc, size_t n);

// x[i] *= s.
void Scale(float* x, size_t n, float s);

// out[i] = w * x[i] (the first term of a weighted sum, written without zero-filling out first).
void ScaledCopy(const float* x, float w, float* out, size_t n);

// sum_i x[i]^2, accumulated in double (EDiT norms, paper 000 Alg. 2). The vectorised summation
// order differs from a sequential loop, so results agree with it to rounding, not bit for bit.
double SquaredL2Norm(const float* x, size_t n);

// sum_i x[i]^2 of n float32 values given as little-endian bytes at any alignment (a received
// payload, or a piece of it still in cache while it is streamed on), for the norm metric: 3x
// SquaredL2Norm's speed on values in cache, because each of 16 lanes adds blocks of 64 squares
// in float before it adds them to its double total. So it agrees with SquaredL2Norm to about
// 64 float roundings (relative 1e-5), not to double rounding; meant for pushed values (|x| <=
// 1e6: no float overflow). The same result on every host.
double SquaredL2NormOfBytes(const void* in, size_t n);

// True when no element is NaN, +Inf or -Inf. Scans all n elements (no early exit) so the loop
// stays branch-free and vectorised; it is meant for the common all-finite case.
bool AllFinite(const float* x, size_t n);

// Copies n float32 values from `in` (little-endian bytes, any alignment) to out and returns true
// when every value has |x| <= limit (limit finite and >= 0); NaN and +-Inf always fail. One
// branch-free pass: decoding and screening a pushed chunk without re-reading it. out is fully
// written either way; which element failed is for the caller's slow path to find.
bool CopyWithinMagnitude(const void* in, float* out, size_t n, float limit);

// CopyWithinMagnitude with stores that bypass the cache (non-temporal) where the host has AVX2:
// for a destination nobody reads soon, such as a pushed update staged until its commit. Writing
// cold memory through the cache first reads every line of it (read for ownership): streaming
// skips that read and leaves the cache to the data in use (the parameters, the next pieces of
// the socket). Same results and contract as CopyWithinMagnitude, bit for bit; the stores are
// fenced before it returns. Elsewhere it is CopyWithinMagnitude. Measured on the dev host (AMD
// EPYC, 2 cores): 1 MiB pieces from L2 into 16 MiB of cold memory, 16 -> 23 GB/s.
bool StreamWithinMagnitude(const void* in, float* out, size_t n, float limit);

// CopyWithinMagnitude's screen alone, of values already in place: true when every element has
// |x| <= limit (limit finite; its sign is ignored); NaN and +-Inf always fail. Branch-free.
bool AllWithinMagnitude(const float* x, size_t n, float limit);

namespace reference {

// Plain scalar loops with the same contracts as above; the definition of the results in tests.
void SgdApply(const float* g, const float* theta_in, float* theta_out, size_t n, float lr);
void NesterovApply(const float* g, float* m, const float* theta_in, float* theta_out, size_t n,
                   float lr, float beta);
// The reference DN spells out Alg. 3 literally (divides by N, forms the coefficient per element)
// and always reads m, so it agrees with the fused loop to rounding, not bit for bit.
void DelayedNesterovApply(const float* g, float* m, float* d, const float* theta_in,
                          float* theta_out, size_t n, float lr, float beta, uint32_t buffer_size,
                          float c, bool momentum_step);
void AdamApply(const float* g, float* m, float* v, const float* theta_in, float* theta_out,
               size_t n, float step_size, float beta1, float beta2, float eps,
               float inv_sqrt_bias2);
void WeightedAccumulate(const float* x, float w, float* acc, size_t n);
void Scale(float* x, size_t n, float s);
void ScaledCopy(const float* x, float w, float* out, size_t n);
double SquaredL2Norm(const float* x, size_t n);
bool AllFinite(const float* x, size_t n);
bool CopyWithinMagnitude(const void* in, float* out, size_t n, float limit);
bool AllWithinMagnitude(const float* x, size_t n, float limit);

}  // namespace reference
}  // namespace aloe::kernels
