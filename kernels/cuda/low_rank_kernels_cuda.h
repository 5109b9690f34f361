// GPU twins of the low-rank decode kernels in kernels/cpu/low_rank_kernels.h: the same layout
// (P row-major, Q transposed, output rows of stride cols starting at column j0) and the same
// bits (each element summed in k order, every multiply and add an explicitly rounded IEEE op,
// no FMA contraction), for a server that keeps its staging buffers on a CUDA device.
//
// Includable from plain C++ (no CUDA headers): a stream is passed as void* (a cudaStream_t;
// nullptr = the legacy default stream). Built only when nvcc is found (ALOE_HAVE_CUDA=1). All
// pointers are device pointers; base may be null (decode) or exactly out (accumulate in place).
// No validation of values: factors that arrive from the network are checked on the host first
// (LowRankRowDecoder). Errors: an empty string on success, else a human-readable error (bad
// arguments, launch failure); launches are asynchronous on `stream`.
#pragma once

#include <cstddef>
#include <string>

namespace aloe::kernels {

// out(i, t) = sum_k P[i,k] Qt[k, j0 + t] for i < rows, t < len (see LowRankDecodeRows).
std::string CudaLowRankDecodeRows(const float* p, size_t rows, size_t rank, const float* qt,
                                  size_t cols, size_t j0, size_t len, float* out, void* stream);

// out(i, t) = base(i, t) + scale * sum_k P[i,k] Qt[k, j0 + t] (see LowRankDecodeAccumulateRows).
std::string CudaLowRankDecodeAccumulateRows(const float* p, size_t rows, size_t rank,
                                            const float* qt, size_t cols, size_t j0, size_t len,
                                            float scale, const float* base, float* out,
                                            void* stream);

}  // namespace aloe::kernels
