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
// int8 and int4: one thread block per quantisation block (grid-stride over blocks): a max-abs
// reduction over the sign-cleared bits (warp __reduce_max_sync, then shared memory), thread 0
// derives the scale, then the block's threads quantise (int4: one thread per pair of values,
// which writes their byte). bf16: grid-stride element-wise loops.

namespace aloe::kernels {
namespace {

// Mirrors codec_kernels.h (kept free of Abseil so nvcc never sees it).
constexpr int64_t kHeaderBytes = 16;
constexpr size_t kMinBlockSize = 1;
constexpr size_t kMaxBlockSize = size_t{1} << 16;
constexpr size_t kInt4MinBlockSize = 2;
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

__device__ __forceinline__ float ClampLevel(float t, float max_level) {
  return fminf(fmaxf(rintf(t), -max_level), max_level);
}

// The scale of one quantisation block and how its values are quantised.
struct BlockScale {
  float scale;
  float inv;
  // 0: all-zero block, 1: multiply by inv, 2: divide (subnormal scale), 3: NaN/Inf in the block.
  int mode;
};

// Writes the 16-byte header of an int8 or int4 buffer (magic digit '8' or '4').
__device__ void WriteHeader(uint8_t* out, char digit, int64_t n, int64_t block_size) {
  out[0] = 'A';
  out[1] = 'Q';
  out[2] = static_cast<uint8_t>(digit);
  out[3] = 0x01;
  *reinterpret_cast<uint32_t*>(out + 4) = static_cast<uint32_t>(block_size);
  // 4-byte aligned only: write the uint64 n as two little-endian halves.
  *reinterpret_cast<uint32_t*>(out + 8) = static_cast<uint32_t>(n);
  *reinterpret_cast<uint32_t*>(out + 12) = static_cast<uint32_t>(static_cast<uint64_t>(n) >> 32);
}

// The max-abs reduction of x[begin, begin + len) over the thread block and, from thread 0, the
// block's scale as EncoderScale on the CPU (subnormal scales round up, a scale whose max_level
// multiple overflows steps down), stored to *scale_out. Every thread gets the result.
__device__ BlockScale ReduceBlockScale(const float* x, int64_t begin, int64_t len, float max_level,
                                       float* scale_out) {
  __shared__ uint32_t warp_max[kThreads / 32];
  __shared__ BlockScale shared;
  uint32_t m = 0;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    m = max(m, __float_as_uint(x[begin + i]) & kAbsMask);
  }
  m = __reduce_max_sync(0xffffffffu, m);
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (unsigned w = 1; w < blockDim.x / 32; ++w) m = max(m, warp_max[w]);
    BlockScale bs = {0.0f, 0.0f, 0};
    if (m >= kExponentMask) {
      bs = {__uint_as_float(kQuietNanBits), 0.0f, 3};
    } else if (m != 0) {
      const float max_abs = __uint_as_float(m);
      float scale = __fdiv_rn(max_abs, max_level);
      if (scale < kSmallestNormal) {
        if (__dmul_rn(static_cast<double>(scale), static_cast<double>(max_level)) <
            static_cast<double>(max_abs)) {
          scale = nextafterf(scale, FLT_MAX);
        }
      } else if (!(__fmul_rn(scale, max_level) <= FLT_MAX)) {
        scale = nextafterf(scale, 0.0f);
      }
      bs = scale < kSmallestNormal ? BlockScale{scale, 0.0f, 2}
                                   : BlockScale{scale, __fdiv_rn(1.0f, scale), 1};
    }
    *scale_out = bs.scale;
    shared = bs;
  }
  __syncthreads();
  const BlockScale bs = shared;
  __syncthreads();  // the shared scale is rewritten for the next block
  return bs;
}

// The level of v in a block with scale bs (0 in all-zero and NaN/Inf blocks).
__device__ __forceinline__ int LevelOf(float v, const BlockScale& bs, float max_level) {
  if (bs.mode == 1) return static_cast<int>(ClampLevel(__fmul_rn(v, bs.inv), max_level));
  if (bs.mode == 2) return static_cast<int>(ClampLevel(__fdiv_rn(v, bs.scale), max_level));
  return 0;
}

// One thread block per quantisation block k (grid-stride over k). `out` is the whole encoded
// buffer; block 0 also writes the header.
__global__ void Int8EncodeKernel(const float* x, int64_t n, int64_t block_size, int64_t blocks,
                                 uint8_t* out, float* residual) {
  if (blockIdx.x == 0 && threadIdx.x == 0) WriteHeader(out, '8', n, block_size);
  float* scales = reinterpret_cast<float*>(out + kHeaderBytes);
  int8_t* q = reinterpret_cast<int8_t*>(out + kHeaderBytes + 4 * blocks);
  for (int64_t k = blockIdx.x; k < blocks; k += gridDim.x) {
    const int64_t begin = k * block_size;
    const int64_t len = min(block_size, n - begin);
    const BlockScale bs = ReduceBlockScale(x, begin, len, 127.0f, &scales[k]);
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      const float v = x[begin + i];
      const int level = LevelOf(v, bs, 127.0f);
      q[begin + i] = static_cast<int8_t>(level);
      if (residual != nullptr) {
        residual[begin + i] = __fsub_rn(v, __fmul_rn(static_cast<float>(level), bs.scale));
      }
    }
  }
}

// As Int8EncodeKernel for int4 (block_size even): thread t of a block quantises the pair of
// values 2t, 2t + 1 and writes their byte (value 2t in the low nibble; a missing second value of
// an odd n leaves the high nibble 0).
__global__ void Int4EncodeKernel(const float* x, int64_t n, int64_t block_size, int64_t blocks,
                                 uint8_t* out, float* residual) {
  if (blockIdx.x == 0 && threadIdx.x == 0) WriteHeader(out, '4', n, block_size);
  float* scales = reinterpret_cast<float*>(out + kHeaderBytes);
  uint8_t* q = out + kHeaderBytes + 4 * blocks;
  for (int64_t k = blockIdx.x; k < blocks; k += gridDim.x) {
    const int64_t begin = k * block_size;
    const int64_t len = min(block_size, n - begin);
    const BlockScale bs = ReduceBlockScale(x, begin, len, 7.0f, &scales[k]);
    for (int64_t i = 2 * threadIdx.x; i < len; i += 2 * blockDim.x) {
      const int first = LevelOf(x[begin + i], bs, 7.0f);
      const bool pair = i + 1 < len;
      const int second = pair ? LevelOf(x[begin + i + 1], bs, 7.0f) : 0;
      q[(begin + i) / 2] = static_cast<uint8_t>((first & 0xf) | ((second & 0xf) << 4));
      if (residual != nullptr) {
        residual[begin + i] =
            __fsub_rn(x[begin + i], __fmul_rn(static_cast<float>(first), bs.scale));
        if (pair) {
          residual[begin + i + 1] =
              __fsub_rn(x[begin + i + 1], __fmul_rn(static_cast<float>(second), bs.scale));
        }
      }
    }
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

// acc == nullptr: out[i] = level * scale; else acc[i] += w * (level * scale). The level of a
// nibble is its two's complement value, -8 read as -7.
__global__ void Int4DecodeKernel(const uint8_t* in, int64_t n, int64_t block_size, int64_t blocks,
                                 float* out, float w, float* acc) {
  const float* scales = reinterpret_cast<const float*>(in + kHeaderBytes);
  const uint8_t* q = in + kHeaderBytes + 4 * blocks;
  for (int64_t k = blockIdx.x; k < blocks; k += gridDim.x) {
    const int64_t begin = k * block_size;
    const int64_t len = min(block_size, n - begin);
    const float scale = scales[k];
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      const int64_t j = begin + i;
      const int nibble = (j % 2 == 0 ? q[j / 2] : q[j / 2] >> 4) & 0xf;
      const int level = max(nibble >= 8 ? nibble - 16 : nibble, -7);
      const float v = __fmul_rn(static_cast<float>(level), scale);
      if (acc == nullptr) {
        out[j] = v;
      } else {
        acc[j] = __fadd_rn(acc[j], __fmul_rn(w, v));
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

// The grid of a blockwise kernel: one thread block per quantisation block, at most kMaxGrid, at
// least one (so that an encoder writes the header even for n == 0).
unsigned int BlockGrid(int64_t blocks) {
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min(blocks, kMaxGrid)));
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

std::string CheckInt4BlockSize(const char* what, size_t block_size) {
  if (block_size < kInt4MinBlockSize || block_size > kMaxBlockSize || block_size % 2 != 0) {
    return std::string(what) + ": block size " + std::to_string(block_size) +
           " is not an even number in [" + std::to_string(kInt4MinBlockSize) + ", " +
           std::to_string(kMaxBlockSize) + "]";
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
  Int8EncodeKernel<<<BlockGrid(blocks), Int8Threads(block_size), 0,
                     static_cast<cudaStream_t>(stream)>>>(x, static_cast<int64_t>(n),
                                                          static_cast<int64_t>(block_size), blocks,
                                                          static_cast<uint8_t*>(out), residual);
  return LaunchError("Int8EncodeKernel");
}

std::string CudaInt8BlockwiseDecode(const void* in, size_t n, size_t block_size, float* out,
                                    void* stream) {
  std::string error = CheckBlockSize("CudaInt8BlockwiseDecode", block_size);
  if (!error.empty() || n == 0) return error;
  const int64_t blocks = static_cast<int64_t>((n + block_size - 1) / block_size);
  Int8DecodeKernel<<<BlockGrid(blocks), Int8Threads(block_size), 0,
                     static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint8_t*>(in), static_cast<int64_t>(n), static_cast<int64_t>(block_size),
      blocks, out, 0.0f, nullptr);
  return LaunchError("Int8DecodeKernel");
}

std::string CudaInt8BlockwiseDecodeAccumulate(const void* in, size_t n, size_t block_size, float w,
                                              float* acc, void* stream) {
  std::string error = CheckBlockSize("CudaInt8BlockwiseDecodeAccumulate", block_size);
  if (!error.empty() || n == 0) return error;
  const int64_t blocks = static_cast<int64_t>((n + block_size - 1) / block_size);
  Int8DecodeKernel<<<BlockGrid(blocks), Int8Threads(block_size), 0,
                     static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint8_t*>(in), static_cast<int64_t>(n), static_cast<int64_t>(block_size),
      blocks, nullptr, w, acc);
  return LaunchError("Int8DecodeKernel");
}

std::string CudaInt4BlockwiseEncode(const float* x, size_t n, size_t block_size, void* out,
                                    float* residual, void* stream) {
  std::string error = CheckInt4BlockSize("CudaInt4BlockwiseEncode", block_size);
  if (!error.empty()) return error;
  const int64_t blocks = static_cast<int64_t>((n + block_size - 1) / block_size);
  // Threads for the block's pairs (at most kThreads).
  Int4EncodeKernel<<<BlockGrid(blocks), Int8Threads(block_size / 2), 0,
                     static_cast<cudaStream_t>(stream)>>>(x, static_cast<int64_t>(n),
                                                          static_cast<int64_t>(block_size), blocks,
                                                          static_cast<uint8_t*>(out), residual);
  return LaunchError("Int4EncodeKernel");
}

std::string CudaInt4BlockwiseDecode(const void* in, size_t n, size_t block_size, float* out,
                                    void* stream) {
  std::string error = CheckInt4BlockSize("CudaInt4BlockwiseDecode", block_size);
  if (!error.empty() || n == 0) return error;
  const int64_t blocks = static_cast<int64_t>((n + block_size - 1) / block_size);
  Int4DecodeKernel<<<BlockGrid(blocks), Int8Threads(block_size), 0,
                     static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint8_t*>(in), static_cast<int64_t>(n), static_cast<int64_t>(block_size),
      blocks, out, 0.0f, nullptr);
  return LaunchError("Int4DecodeKernel");
}

std::string CudaInt4BlockwiseDecodeAccumulate(const void* in, size_t n, size_t block_size, float w,
                                              float* acc, void* stream) {
  std::string error = CheckInt4BlockSize("CudaInt4BlockwiseDecodeAccumulate", block_size);
  if (!error.empty() || n == 0) return error;
  const int64_t blocks = static_cast<int64_t>((n + block_size - 1) / block_size);
  Int4DecodeKernel<<<BlockGrid(blocks), Int8Threads(block_size), 0,
                     static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint8_t*>(in), static_cast<int64_t>(n), static_cast<int64_t>(block_size),
      blocks, nullptr, w, acc);
  return LaunchError("Int4DecodeKernel");
}

}  // namespace aloe::kernels
