#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/cuda/outer_kernels_cuda.h"

// Grid-stride loops: one launch covers any n with a bounded grid. The loops are memory-bound, so
// a few waves of 256-thread blocks per SM are enough to saturate HBM. No __restrict__: outputs
// may alias inputs exactly, as on the CPU. nvcc contracts a*b+c into FMAs, so results agree with
// the CPU kernels to rounding, not bit for bit.

namespace aloe::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

__global__ void SgdKernel(const float* g, const float* theta_in, float* theta_out, int64_t n,
                          float lr) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    theta_out[i] = theta_in[i] - lr * g[i];
  }
}

__global__ void NesterovKernel(const float* g, float* m, const float* theta_in, float* theta_out,
                               int64_t n, float lr, float beta) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float gi = g[i];
    const float mi = beta * m[i] + gi;
    const float theta = theta_in[i];
    m[i] = mi;
    theta_out[i] = theta - lr * (beta * mi + gi);
  }
}

// coef = (1 - c*N + c)*beta on a momentum step, c*beta otherwise; inv_n = 1/N (as on the CPU).
__global__ void DelayedNesterovKernel(const float* g, float* m, float* d, const float* theta_in,
                                      float* theta_out, int64_t n, float lr, float beta,
                                      float inv_n, float coef, bool momentum_step) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float gi = g[i];
    const float theta = theta_in[i];
    if (momentum_step) {
      const float mi = beta * m[i] + (d[i] + gi) * inv_n;
      m[i] = mi;
      d[i] = 0.0f;
      theta_out[i] = theta - lr * (coef * mi + gi * inv_n);
    } else {
      d[i] += gi;
      // Skip the read of m when its coefficient is 0 (c = 0, the paper's default).
      const float momentum_term = coef == 0.0f ? 0.0f : coef * m[i];
      theta_out[i] = theta - lr * (momentum_term + gi * inv_n);
    }
  }
}

__global__ void AdamKernel(const float* g, float* m, float* v, const float* theta_in,
                           float* theta_out, int64_t n, float step_size, float beta1, float beta2,
                           float eps, float inv_sqrt_bias2) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float gi = g[i];
    const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
    const float vi = beta2 * v[i] + (1.0f - beta2) * (gi * gi);
    const float theta = theta_in[i];
    m[i] = mi;
    v[i] = vi;
    theta_out[i] = theta - step_size * mi / (sqrtf(vi) * inv_sqrt_bias2 + eps);
  }
}

__global__ void WeightedAccumulateKernel(const float* x, float w, float* acc, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    acc[i] += w * x[i];
  }
}

unsigned int NumBlocks(size_t n) {
  const int64_t blocks = (static_cast<int64_t>(n) + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(std::min(blocks, kMaxBlocks));
}

std::string LaunchError(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return std::string();
  return std::string(kernel) + " launch failed: " + cudaGetErrorName(err) + ": " +
         cudaGetErrorString(err);
}

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the error so a later cudaGetLastError does not report it
    return 0;
  }
  return count;
}

std::string CudaSgdApply(const float* g, const float* theta_in, float* theta_out, size_t n,
                         float lr, void* stream) {
  if (n == 0) return std::string();
  SgdKernel<<<NumBlocks(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      g, theta_in, theta_out, static_cast<int64_t>(n), lr);
  return LaunchError("SgdKernel");
}

std::string CudaNesterovApply(const float* g, float* m, const float* theta_in, float* theta_out,
                              size_t n, float lr, float beta, void* stream) {
  if (n == 0) return std::string();
  NesterovKernel<<<NumBlocks(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      g, m, theta_in, theta_out, static_cast<int64_t>(n), lr, beta);
  return LaunchError("NesterovKernel");
}

std::string CudaDelayedNesterovApply(const float* g, float* m, float* d, const float* theta_in,
                                     float* theta_out, size_t n, float lr, float beta,
                                     uint32_t buffer_size, float c, bool momentum_step,
                                     void* stream) {
  if (n == 0) return std::string();
  const float big_n = static_cast<float>(buffer_size);
  const float coef = momentum_step ? (1.0f - c * big_n + c) * beta : c * beta;
  DelayedNesterovKernel<<<NumBlocks(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      g, m, d, theta_in, theta_out, static_cast<int64_t>(n), lr, beta, 1.0f / big_n, coef,
      momentum_step);
  return LaunchError("DelayedNesterovKernel");
}

std::string CudaAdamApply(const float* g, float* m, float* v, const float* theta_in,
                          float* theta_out, size_t n, float step_size, float beta1, float beta2,
                          float eps, float inv_sqrt_bias2, void* stream) {
  if (n == 0) return std::string();
  AdamKernel<<<NumBlocks(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      g, m, v, theta_in, theta_out, static_cast<int64_t>(n), step_size, beta1, beta2, eps,
      inv_sqrt_bias2);
  return LaunchError("AdamKernel");
}

std::string CudaWeightedAccumulate(const float* x, float w, float* acc, size_t n, void* stream) {
  if (n == 0) return std::string();
  WeightedAccumulateKernel<<<NumBlocks(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      x, w, acc, static_cast<int64_t>(n));
  return LaunchError("WeightedAccumulateKernel");
}

}  // namespace aloe::kernels
