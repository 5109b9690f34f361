// GPU twins of the fused outer-step kernels in kernels/cpu/outer_kernels.h, for a server (or a
// worker) that keeps the model on a CUDA device. Same element-wise formulas and aliasing rules as
// the CPU kernels; here the pointers are device pointers and each call is one kernel launch.
//
// Includable from plain C++ (no CUDA headers): a stream is passed as void* (a cudaStream_t;
// nullptr = the legacy default stream). Built only when nvcc is found; users then see
// ALOE_HAVE_CUDA=1 (kernels/CMakeLists.txt).
//
// Errors: every function returns an empty string on success and a human-readable error
// otherwise. Launches are asynchronous on `stream`, so a returned empty string means the launch
// was accepted; faults during execution surface at the caller's next synchronisation.
// Thread-safety: as the CUDA runtime (calls on distinct streams may run concurrently).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace aloe::kernels {

// Number of visible CUDA devices; 0 when the runtime reports an error (no driver, no device).
int CudaDeviceCount();

// theta_out[i] = theta_in[i] - lr * g[i]  (see SgdApply).
std::string CudaSgdApply(const float* g, const float* theta_in, float* theta_out, size_t n,
                         float lr, void* stream);

// Paper 002 Eq. 4: m[i] = beta*m[i] + g[i]; theta_out[i] = theta_in[i] - lr*(beta*m[i] + g[i])
// (see NesterovApply).
std::string CudaNesterovApply(const float* g, float* m, const float* theta_in, float* theta_out,
                              size_t n, float lr, float beta, void* stream);

// Delayed Nesterov, paper 002 Alg. 3 (see DelayedNesterovApply): d += g; on a momentum step
// (the caller's (t+1) % N == 0) m = beta*m + d/N, theta -= lr*((1 - c*N + c)*beta*m + g/N),
// d = 0; otherwise theta -= lr*(c*beta*m + g/N). buffer_size = N >= 1.
std::string CudaDelayedNesterovApply(const float* g, float* m, float* d, const float* theta_in,
                                     float* theta_out, size_t n, float lr, float beta,
                                     uint32_t buffer_size, float c, bool momentum_step,
                                     void* stream);

// Outer Adam with caller-computed bias corrections (see AdamApply).
std::string CudaAdamApply(const float* g, float* m, float* v, const float* theta_in,
                          float* theta_out, size_t n, float step_size, float beta1, float beta2,
                          float eps, float inv_sqrt_bias2, void* stream);

// acc[i] += w * x[i]  (see WeightedAccumulate).
std::string CudaWeightedAccumulate(const float* x, float w, float* acc, size_t n, void* stream);

}  // namespace aloe::kernels
