// Fused single-pass CPU loops for the server's outer step and the codecs: the outer optimizers
// (ALGORITHMS.md "Outer optimizers"), pseudo-gradient averaging, norms and finiteness checks.
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
//
// Every kernel has a plain scalar twin of the same signature in aloe::kernels::reference, used by
// tests as the definition of the result.
#pragma once

#include <cstddef>

namespace aloe::kernels {

// Outer SGD: theta_out[i] = theta_in[i] - lr * g[i].
void SgdApply(const float* g, const float* theta_in, float* theta_out, size_t n, float lr);

// Outer Nesterov, paper 002 Eq. 4 (DiLoCo's outer optimizer), in one pass:
//   m[i] = beta * m[i] + g[i];  theta_out[i] = theta_in[i] - lr * (beta * m[i] + g[i])
// where the second line uses the already-updated m. m is read and written in place.
void NesterovApply(const float* g, float* m, const float* theta_in, float* theta_out, size_t n,
                   float lr, float beta);

// acc[i] += w * x[i]  (weighted average of pseudo-gradients, one update at a time).
void WeightedAccumulate(const float* x, float w, float* acc, size_t n);

// x[i] *= s.
void Scale(float* x, size_t n, float s);

// sum_i x[i]^2, accumulated in double (EDiT norms, paper 000 Alg. 2). The vectorised summation
// order differs from a sequential loop, so results agree with it to rounding, not bit for bit.
double SquaredL2Norm(const float* x, size_t n);

// True when no element is NaN, +Inf or -Inf. Scans all n elements (no early exit) so the loop
// stays branch-free and vectorised; it is meant for the common all-finite case.
bool AllFinite(const float* x, size_t n);

namespace reference {

// Plain scalar loops with the same contracts as above; the definition of the results in tests.
void SgdApply(const float* g, const float* theta_in, float* theta_out, size_t n, float lr);
void NesterovApply(const float* g, float* m, const float* theta_in, float* theta_out, size_t n,
                   float lr, float beta);
void WeightedAccumulate(const float* x, float w, float* acc, size_t n);
void Scale(float* x, size_t n, float s);
double SquaredL2Norm(const float* x, size_t n);
bool AllFinite(const float* x, size_t n);

}  // namespace reference
}  // namespace aloe::kernels
