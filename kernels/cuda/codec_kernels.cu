#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <string>

#include "kernels/cuda/codec_kernels_cuda.h"

// Layout and arithmetic follow kernels/cpu/codec_kernels.h exactly; the GPU test compares bytes
// and floats with the CPU reference. Every multiply, divide and subtract that feeds a stored
// value is an explicit __f*_rn intrinsic so nvcc cannot contract it into an FMA (which would
// round differently from the CPU). -ftz is off (nvcc's default), so subnormals behave as on
// the CPU.
//
// int8: one thread block per quantisation block (grid-stride over blocks): a max-abs reduction
// over the sign-cleared bits (warp __reduce_max_sync, then shared memory), thread 0 derives the
// scale, then the block's threads quantise. bf16: grid-stride element-wise loops.

namespace aloe::kernels {
namespace {

// Mirrors codec_kernels.h (kept free of Abseil so nvcc never sees it).
constexpr int64_t kHeaderBytes = 16;
constexpr size_t kMinBlockSize = 1;
constexpr size_t kMaxBlockSize = size_t{1} << 16;
constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kExponentMask = 0x7f800000u;
constexpr uint32_t kQuietNanBits = 0x7fc00000u;
constexpr float kSmallestNormal = 1.17549435e-38f;  // 2^-126

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 65535;

__device__ __forceinline__ uint16_t Bf16FromFloat(float v) {
  const uint32_t bits = __float_as_uint(v);
  if ((bits & kExponentMask) == kExponentMask) {
    // NaN stays NaN (quiet bit set, sign kept); +-Inf stays +-Inf: decoders reject both.
    return static_cast<uint16_t>((bits & kAbsMask) > kExponentMask ? (bits >> 16) | 0x40u
                                                                   : bits >> 16);
  }
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((rounded & 0x7f80u) == 0x7f80u ? (rounded & 0x8000u) | 0x7f7fu
                                                              : rounded);
}

__device__ __forceinline__ float FloatFromBf16(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

__global__ void Bf16EncodeKernel(const float* x, int64_t n, uint16_t* out, float* residual) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = x[i];
    const uint16_t b = Bf16FromFloat(v);
    out[i] = b;
    if (residual != nullptr) residual[i] = __fsub_rn(v, FloatFromBf16(b));
  }
}

__global__ void Bf16DecodeKernel(const uint16_t* in, int64_t n, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = FloatFromBf16(in[i]);
  }
}

__device__ __forceinline__ float ClampLevel(float t) {
  return fminf(fmaxf(rintf(t), -127.0f), 127.0f);
}

// One thread block per quantisation block k (grid-stride over k). `out` is the whole encoded
// buffer; block 0 also writes the header.
__global__ void Int8EncodeKernel(const float* x, int64_t n, int64_t block_size, int64_t blocks,
                                 uint8_t* out, float* residual) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    out[0] = 'A';
    out[1] = 'Q';
    out[2] = '8';
    out[3] = 0x01;
    *reinterpret_cast<uint32_t*>(out + 4) = static_cast<uint32_t>(block_size);
    // 4-byte aligned only: write the uint64 n as two little-endian halves.
    *reinterpret_cast<uint32_t*>(out + 8) = static_cast<uint32_t>(n);
    *reinterpret_cast<uint32_t*>(out + 12) = static_cast<uint32_t>(static_cast<uint64_t>(n) >> 32);
  }
  float* scales = reinterpret_cast<float*>(out + kHeaderBytes);
  int8_t* q = reinterpret_cast<int8_t*>(out + kHeaderBytes + 4 * blocks);
  __shared__ uint32_t warp_max[kThreads / 32];
  __shared__ float block_scale;
  __shared__ float block_inv;
  // 0: all-zero block, 1: multiply by inv, 2: divide (subnormal scale), 3: NaN/Inf in the block.
  __shared__ int block_mode;
  for (int64_t k = blockIdx.x; k < blocks; k += gridDim.x) {
    const int64_t begin = k * block_size;
    const int64_t len = min(block_size, n - begin);
    uint32_t m = 0;
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      m = max(m, __float_as_uint(x[begin + i]) & kAbsMask);
    }
    m = __reduce_max_sync(0xffffffffu, m);
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (unsigned w = 1; w < blockDim.x / 32; ++w) m = max(m, warp_max[w]);
      float scale = 0.0f;
      float inv = 0.0f;
      int mode = 0;
      if (m >= kExponentMask) {
        scale = __uint_as_float(kQuietNanBits);
        mode = 3;
      } else if (m != 0) {
        // As EncoderScale on the CPU: subnormal scales round up, m = FLT_MAX steps down.
        const float max_abs = __uint_as_float(m);
        scale = __fdiv_rn(max_abs, 127.0f);
        if (scale < kSmallestNormal) {
          if (__dmul_rn(static_cast<double>(scale), 127.0) < static_cast<double>(max_abs)) {
            scale = nextafterf(scale, FLT_MAX);
          }
        } else if (!(__fmul_rn(scale, 127.0f) <= FLT_MAX)) {
          scale = nextafterf(scale, 0.0f);
        }
        if (scale < kSmallestNormal) {
          mode = 2;
        } else {
          inv = __fdiv_rn(1.0f, scale);
          mode = 1;
        }
      }
      scales[k] = scale;
      block_scale = scale;
      block_inv = inv;
      block_mode = mode;
    }
    __syncthreads();
    const float scale = block_scale;
    const float inv = block_inv;
    const int mode = block_mode;
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      const float v = x[begin + i];
      float level = 0.0f;
      if (mode == 1) {
        level = ClampLevel(__fmul_rn(v, inv));
      } else if (mode == 2) {
        level = ClampLevel(__fdiv_rn(v, scale));
      }
      const int level_int = static_cast<int>(level);
      q[begin + i] = static_cast<int8_t>(level_int);
      if (residual != nullptr) {
        residual[begin + i] = __fsub_rn(v, __fmul_rn(static_cast<float>(level_int), scale));
      }
    }
    __syncthreads();  // the shared scale is rewritten for the next block
  }
}

// acc == nullptr: out[i] = level * scale; else acc[i] += w * (level * scale).
__global__ void Int8DecodeKernel(const uint8_t* in, int64_t n, int64_t block_size, int64_t blocks,
                                 float* out, float w, float* acc) {
  const float* scales = reinterpret_cast<const float*>(in + kHeaderBytes);
  const int8_t* q = reinterpret_cast<const int8_t*>(in + kHeaderBytes + 4 * blocks);
  for (int64_t k = blockIdx.x; k < blocks; k += gridDim.x) {
    const int64_t begin = k * block_size;
    const int64_t len = min(block_size, n - begin);
    const float scale = scales[k];
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      const int level = max(static_cast<int>(q[begin + i]), -127);
      const float v = __fmul_rn(static_cast<float>(level), scale);
      if (acc == nullptr) {
        out[begin + i] = v;
      } else {
        acc[begin + i] = __fadd_rn(acc[begin + i], __fmul_rn(w, v));
      }
    }
  }
}

unsigned int ElementGrid(size_t n) {
  const int64_t blocks = (static_cast<int64_t>(n) + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min(blocks, kMaxGrid)));
}

// Threads per quantisation block: the block size rounded up to a warp, at most kThreads.
unsigned int Int8Threads(size_t block_size) {
  const size_t warps = (std::min<size_t>(block_size, kThreads) + 31) / 32;
  return static_cast<unsigned int>(warps * 32);
}

std::string LaunchError(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return std::string();
  return std::string(kernel) + " launch failed: " + cudaGetErrorName(err) + ": " +
         cudaGetErrorString(err);
}

std::string CheckBlockSize(const char* what, size_t block_size) {
  if (block_size < kMinBlockSize || block_size > kMaxBlockSize) {
    return std::string(what) + ": block size " + std::to_string(block_size) + " outside [" +
           std::to_string(kMinBlockSize) + ", " + std::to_string(kMaxBlockSize) + "]";
  }
  return std::string();
}

}  // namespace

std::string CudaBf16Encode(const float* x, size_t n, void* out, float* residual, void* stream) {
  if (n == 0) return std::string();
  Bf16EncodeKernel<<<ElementGrid(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      x, static_cast<int64_t>(n), static_cast<uint16_t*>(out), residual);
  return LaunchError("Bf16EncodeKernel");
}

std::string CudaBf16Decode(const void* in, size_t n, float* out, void* stream) {
  if (n == 0) return std::string();
  Bf16DecodeKernel<<<ElementGrid(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint16_t*>(in), static_cast<int64_t>(n), out);
  return LaunchError("Bf16DecodeKernel");
}

std::string CudaInt8BlockwiseEncode(const float* x, size_t n, size_t block_size, void* out,
                                    float* residual, void* stream) {
  std::string error = CheckBlockSize("CudaInt8BlockwiseEncode", block_size);
  if (!error.empty()) return error;
  const int64_t blocks = static_cast<int64_t>((n + block_size - 1) / block_size);
  // At least one thread block, so that the header is written even for n == 0.
  const unsigned int grid =
      static_cast<unsigned int>(std::max<int64_t>(1, std::min(blocks, kMaxGrid)));
  Int8EncodeKernel<<<grid, Int8Threads(block_size), 0, static_cast<cudaStream_t>(stream)>>>(
      x, static_cast<int64_t>(n), static_cast<int64_t>(block_size), blocks,
      static_cast<uint8_t*>(out), residual);
  return LaunchError("Int8EncodeKernel");
}

std::string CudaInt8BlockwiseDecode(const void* in, size_t n, size_t block_size, float* out,
                                    void* stream) {
  std::string error = CheckBlockSize("CudaInt8BlockwiseDecode", block_size);
  if (!error.empty() || n == 0) return error;
  const int64_t blocks = static_cast<int64_t>((n + block_size - 1) / block_size);
  Int8DecodeKernel<<<static_cast<unsigned int>(std::min(blocks, kMaxGrid)), Int8Threads(block_size),
                     0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint8_t*>(in), static_cast<int64_t>(n), static_cast<int64_t>(block_size),
      blocks, out, 0.0f, nullptr);
  return LaunchError("Int8DecodeKernel");
}

std::string CudaInt8BlockwiseDecodeAccumulate(const void* in, size_t n, size_t block_size, float w,
                                              float* acc, void* stream) {
  std::string error = CheckBlockSize("CudaInt8BlockwiseDecodeAccumulate", block_size);
  if (!error.empty() || n == 0) return error;
  const int64_t blocks = static_cast<int64_t>((n + block_size - 1) / block_size);
  Int8DecodeKernel<<<static_cast<unsigned int>(std::min(blocks, kMaxGrid)), Int8Threads(block_size),
                     0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint8_t*>(in), static_cast<int64_t>(n), static_cast<int64_t>(block_size),
      blocks, nullptr, w, acc);
  return LaunchError("Int8DecodeKernel");
}

}  // namespace aloe::kernels
