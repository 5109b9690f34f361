// GPU twins of the wire codecs in kernels/cpu/codec_kernels.h, for a worker or server that keeps
// tensors on a CUDA device: the same byte layouts (bf16; int8 and int4 blockwise absmax with
// their 16-byte headers) and, for finite input, the same bytes and the same decoded floats as the
// CPU kernels, bit for bit (every float operation is an explicitly rounded IEEE op, no FMA
// contraction).
//
// Includable from plain C++ (no CUDA headers): a stream is passed as void* (a cudaStream_t;
// nullptr = the legacy default stream). Built only when nvcc is found; users then see
// ALOE_HAVE_CUDA=1 (kernels/CMakeLists.txt).
//
// All pointers are device pointers. Encoded buffers must be 4-byte aligned (cudaMalloc's are);
// float buffers as for any float array. `residual` may be nullptr or exactly x, as on the CPU.
//
// Differences from the CPU kernels, because a launch cannot return a per-element status:
//   - Encoders do not reject NaN/Inf; they make the buffer invalid instead, so that every decoder
//     with validation rejects it: bf16 keeps NaN as a quiet NaN and +-Inf as +-Inf; an int8 or
//     int4 block containing NaN/Inf gets a NaN scale (its levels and residuals are unspecified).
//   - Decoders do not validate. Buffers that arrive from the network are checked on the host
//     first (Int8BlockwiseInspect, Int4BlockwiseInspect, or Bf16Decode into staging), then copied
//     to the device; the header is not read on the device (the caller passes n and block_size).
//
// Errors: every function returns an empty string on success and a human-readable error
// otherwise (bad arguments, launch failure). Launches are asynchronous on `stream`; faults during
// execution surface at the caller's next synchronisation.
// Thread-safety: as the CUDA runtime (calls on distinct streams may run concurrently).
#pragma once

#include <cstddef>
#include <string>

namespace aloe::kernels {

// Encodes x[0, n) into out[0, Bf16EncodedSize(n)) (see Bf16Encode); residual[i] = x[i] -
// decode(out)[i] when residual is not null.
std::string CudaBf16Encode(const float* x, size_t n, void* out, float* residual, void* stream);

// Decodes in[0, Bf16EncodedSize(n)) into out[0, n) (see Bf16Decode).
std::string CudaBf16Decode(const void* in, size_t n, float* out, void* stream);

// Encodes x[0, n) in blocks of block_size into out[0, Int8EncodedSize(n, block_size)), header
// included (see Int8BlockwiseEncode). Error when block_size is outside
// [kInt8MinBlockSize, kInt8MaxBlockSize].
std::string CudaInt8BlockwiseEncode(const float* x, size_t n, size_t block_size, void* out,
                                    float* residual, void* stream);

// Decodes the int8 buffer at in (Int8EncodedSize(n, block_size) bytes, already validated) into
// out[0, n) (see Int8BlockwiseDecode).
std::string CudaInt8BlockwiseDecode(const void* in, size_t n, size_t block_size, float* out,
                                    void* stream);

// acc[i] += w * decode(in)[i], rounded as the CPU Int8BlockwiseDecodeAccumulate.
std::string CudaInt8BlockwiseDecodeAccumulate(const void* in, size_t n, size_t block_size, float w,
                                              float* acc, void* stream);

// Encodes x[0, n) in blocks of block_size into out[0, Int4EncodedSize(n, block_size)), header
// included (see Int4BlockwiseEncode). Error when block_size is odd or outside
// [kInt4MinBlockSize, kInt4MaxBlockSize].
std::string CudaInt4BlockwiseEncode(const float* x, size_t n, size_t block_size, void* out,
                                    float* residual, void* stream);

// Decodes the int4 buffer at in (Int4EncodedSize(n, block_size) bytes, already validated) into
// out[0, n) (see Int4BlockwiseDecode).
std::string CudaInt4BlockwiseDecode(const void* in, size_t n, size_t block_size, float* out,
                                    void* stream);

// acc[i] += w * decode(in)[i], rounded as the CPU Int4BlockwiseDecodeAccumulate.
std::string CudaInt4BlockwiseDecodeAccumulate(const void* in, size_t n, size_t block_size, float w,
                                              float* acc, void* stream);

}  // namespace aloe::kernels
