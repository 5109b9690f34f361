#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/cuda/low_rank_kernels_cuda.h"

// One thread per output element, adjacent threads on adjacent columns (coalesced loads of Qt and
// stores of out), grid-stride. Each element is the CPU kernels' sum: s = 0, then
// s = s + P[i,k] * Qt[k,j] in k order with __fmul_rn and __fadd_rn, so that nvcc cannot contract
// a multiply and an add into an FMA; -ftz is off (nvcc's default), so subnormals behave as on
// the CPU.

namespace aloe::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 65535;

__global__ void LowRankDecodeKernel(const float* p, int64_t rows, int64_t rank, const float* qt,
                                    int64_t cols, int64_t j0, int64_t len, float scale,
                                    const float* base, float* out) {
  const int64_t total = rows * len;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e / len;
    const int64_t t = e - i * len;
    const float* pi = p + i * rank;
    const float* q = qt + j0 + t;
    float s = 0.0f;
    for (int64_t k = 0; k < rank; ++k) s = __fadd_rn(s, __fmul_rn(pi[k], q[k * cols]));
    const int64_t o = i * cols + t;
    out[o] = base == nullptr ? s : __fadd_rn(base[o], __fmul_rn(scale, s));
  }
}

std::string Launch(const char* what, const float* p, size_t rows, size_t rank, const float* qt,
                   size_t cols, size_t j0, size_t len, float scale, const float* base, float* out,
                   void* stream) {
  if (j0 > cols || len > cols - j0) {
    return std::string(what) + ": columns [" + std::to_string(j0) + ", " +
           std::to_string(j0 + len) + ") end past " + std::to_string(cols);
  }
  const int64_t total = static_cast<int64_t>(rows) * static_cast<int64_t>(len);
  if (total == 0) return std::string();
  const int64_t grid = std::min<int64_t>((total + kThreads - 1) / kThreads, kMaxGrid);
  LowRankDecodeKernel<<<static_cast<unsigned int>(grid), kThreads, 0,
                        static_cast<cudaStream_t>(stream)>>>(
      p, static_cast<int64_t>(rows), static_cast<int64_t>(rank), qt, static_cast<int64_t>(cols),
      static_cast<int64_t>(j0), static_cast<int64_t>(len), scale, base, out);
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return std::string();
  return std::string(what) + " launch failed: " + cudaGetErrorName(err) + ": " +
         cudaGetErrorString(err);
}

}  // namespace

std::string CudaLowRankDecodeRows(const float* p, size_t rows, size_t rank, const float* qt,
                                  size_t cols, size_t j0, size_t len, float* out, void* stream) {
  return Launch("CudaLowRankDecodeRows", p, rows, rank, qt, cols, j0, len, 1.0f, nullptr, out,
                stream);
}

std::string CudaLowRankDecodeAccumulateRows(const float* p, size_t rows, size_t rank,
                                            const float* qt, size_t cols, size_t j0, size_t len,
                                            float scale, const float* base, float* out,
                                            void* stream) {
  return Launch("CudaLowRankDecodeAccumulateRows", p, rows, rank, qt, cols, j0, len, scale, base,
                out, stream);
}

}  // namespace aloe::kernels
