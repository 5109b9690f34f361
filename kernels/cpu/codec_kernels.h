// Wire codecs for pseudo-gradients and parameters (docs/algorithms.md, "Compression", paper 001):
// bf16 casts and int8 and int4 blockwise absmax quantization, with optional error feedback (the
// quantization residual is produced in the same pass, for the caller to add to its next update)
// and a fused decode-and-accumulate so the server can aggregate pushes straight from the wire.
//
// Contract shared by all functions (as in outer_kernels.h):
//   - Single-threaded, no allocation. Callers that want parallelism split a tensor into chunks
//     (one wire message each) and encode/decode each chunk from its own thread.
//   - n may be 0 (then float pointers may be null).
//   - `residual` may be nullptr (no error feedback) or exactly `x` (x is replaced by its
//     residual); encoded byte buffers must not overlap float buffers.
//   - Encoded buffers are plain bytes with no alignment requirement (e.g. std::string::data()).
//   - All multi-byte fields are little-endian (the only hosts we build for; static_assert'ed).
//
// Errors (absl::Status, kInvalidArgument only):
//   - Encoders reject NaN, +Inf and -Inf input; the message names the first bad index and its
//     value, e.g. "Int8BlockwiseEncode: x[1234] is +Inf". On error the output buffers (out,
//     residual) hold unspecified bytes.
//   - Decoders reject a wrong buffer length, a bad header and data that would decode to NaN/Inf
//     (a bf16 NaN/Inf; an int8 scale that is NaN, Inf, negative or above FLT_MAX / 127; an int4
//     scale likewise with FLT_MAX / 7). Decode leaves `out` unspecified on error;
//     DecodeAccumulate validates the whole buffer first and leaves `acc` unchanged on error.
//
// ---------------------------------------------------------------------------------------------
// bf16 wire layout (no header; n is bytes / 2):
//   bytes [2i, 2i+2): value i as a bfloat16 (the upper 16 bits of its float32), little-endian.
// Encode rounds float32 to nearest, ties to even on the 16 dropped bits (the same bits as
// torch's c10::BFloat16 for finite values). Finite values that round past the largest bf16
// (|x| >= 0x7F7F8000 as float32 bits, ~3.3961e38) saturate to +-0x7F7F (~3.3895e38) instead of
// becoming Inf. Subnormals are kept (no flush to zero). Decode is exact (bits << 16).
// Round-trip error per element: |decode(encode(x)) - x| <= 2^-8 |x| when |x| >= 2^-126
// (FLT_MIN); <= 2^-134 (half a bf16 subnormal step) below that.
//
// ---------------------------------------------------------------------------------------------
// int8 blockwise absmax wire layout, for n values in blocks of B (nb = ceil(n / B) blocks; the
// last block may be short), Int8EncodedSize(n, B) = 16 + 4 * nb + n bytes:
//   bytes [0, 4)            magic "AQ8" followed by the format version byte 0x01
//   bytes [4, 8)            uint32 block size B, kInt8MinBlockSize <= B <= kInt8MaxBlockSize
//   bytes [8, 16)           uint64 n, the number of values
//   bytes [16, 16 + 4 nb)   nb float32 scales; scale k covers values [k B, min((k + 1) B, n))
//   bytes [16 + 4 nb, end)  n int8 values q (two's complement), in order
// A buffer is self-describing: a decoder needs no configuration, only the destination size.
// Encode, per block with m = max |x| over the block (exact float ops, in this order):
//   m == 0: scale = 0 and every q = 0.
//   else:   scale = m / 127 rounded to nearest, except
//             - when that is subnormal (m < 127 * 2^-126): rounded up instead (the smallest
//               float >= m / 127, at least 2^-149), so that rounding cannot push |x| / scale
//               past 127 where a subnormal keeps only a few bits;
//             - when 127 * scale would overflow (only m = FLT_MAX): one float step lower.
//           q = clamp(rint(x * (1 / scale)), -127, 127) when scale >= 2^-126,
//           q = clamp(rint(x / scale), -127, 127)       when scale is subnormal (1 / scale
//                                                        would overflow),
//           where rint rounds to nearest, ties to even.
// Valid scales are finite, have the sign bit clear and satisfy 127 * scale <= FLT_MAX.
// Decode: x' = float(q) * scale (one float multiply). The encoder never writes q = -128; a
// decoder reads it as -127, so decoding any buffer with valid scales yields finite values.
// Round-trip error per element, with m the block's max |x|:
//   |x' - x| <= m / 254 * (1 + 2^-12) + 2^-149,
// i.e. half a quantization step; the 2^-12 covers float rounding of x * (1 / scale) and of
// q * scale, the 2^-149 (one float32 subnormal step) only matters when m < 127 * 2^-126.
//
// ---------------------------------------------------------------------------------------------
// int4 blockwise absmax wire layout, for n values in blocks of an even B (nb = ceil(n / B); the
// last block may be short), Int4EncodedSize(n, B) = 16 + 4 * nb + ceil(n / 2) bytes:
//   bytes [0, 4)            magic "AQ4" followed by the format version byte 0x01
//   bytes [4, 8)            uint32 block size B, even, kInt4MinBlockSize <= B <= kInt4MaxBlockSize
//   bytes [8, 16)           uint64 n, the number of values
//   bytes [16, 16 + 4 nb)   nb float32 scales; scale k covers values [k B, min((k + 1) B, n))
//   bytes [16 + 4 nb, end)  ceil(n / 2) bytes of 4-bit levels q (two's complement): byte j holds
//                           value 2j in its low nibble (bits 0-3) and value 2j + 1 in its high
//                           nibble (bits 4-7). When n is odd the last high nibble is padding, 0.
// B is even so that every block starts on a byte (block k's levels are bytes [k B / 2, ...)).
// Encode is int8's with 7 in place of 127, per block with m = max |x| over the block:
//   m == 0: scale = 0 and every q = 0.
//   else:   scale = m / 7 rounded to nearest, except
//             - when that is subnormal (m < 7 * 2^-126): rounded up instead (the smallest
//               float >= m / 7), so that rounding cannot push |x| / scale past 7;
//             - when 7 * scale would overflow (m near FLT_MAX): one float step lower.
//           q = clamp(rint(x * (1 / scale)), -7, 7) when scale >= 2^-126,
//           q = clamp(rint(x / scale), -7, 7)       when scale is subnormal,
//           where rint rounds to nearest, ties to even.
// Valid scales are finite, have the sign bit clear and satisfy 7 * scale <= FLT_MAX. A buffer
// with odd n whose padding nibble is not 0 is invalid (every value list has one encoding).
// Decode: x' = float(q) * scale (one float multiply). The encoder never writes q = -8 (the
// levels are symmetric, as int8's); a decoder reads it as -7, so decoding any buffer with
// valid scales yields finite values.
// Round-trip error per element, with m the block's max |x|:
//   |x' - x| <= m / 14 * (1 + 2^-16) + 2^-149,
// i.e. half a quantization step; the 2^-16 covers float rounding of the scale, of x * (1 / scale)
// and of q * scale, the 2^-149 only matters when m < 7 * 2^-126.
//
// Every kernel has a plain scalar twin of the same signature and contract in
// aloe::kernels::reference; tests hold the fused versions to them bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace aloe::kernels {

// ---- bf16 -----------------------------------------------------------------------------------

// Bytes of a bf16-encoded buffer of n values: 2 n.
inline constexpr size_t Bf16EncodedSize(size_t n) { return 2 * n; }

// Encodes x[0, n) into out[0, Bf16EncodedSize(n)). When residual is not null, also writes
// residual[i] = x[i] - decode(out)[i] (error feedback). kInvalidArgument on NaN/Inf input.
absl::Status Bf16Encode(const float* x, size_t n, void* out, float* residual);

// Decodes in[0, in_bytes) into out[0, n). kInvalidArgument when in_bytes != Bf16EncodedSize(n)
// or when an encoded value is NaN/Inf (names the first such index).
absl::Status Bf16Decode(const void* in, size_t in_bytes, float* out, size_t n);

// acc[i] += w * decode(in)[i], rounded exactly as Bf16Decode followed by WeightedAccumulate
// (outer_kernels.h). Validates the whole buffer first: acc is unchanged on error.
absl::Status Bf16DecodeAccumulate(const void* in, size_t in_bytes, float w, float* acc, size_t n);

// ---- int8 blockwise absmax ------------------------------------------------------------------

inline constexpr size_t kInt8DefaultBlockSize = 256;
inline constexpr size_t kInt8MinBlockSize = 1;
inline constexpr size_t kInt8MaxBlockSize = size_t{1} << 16;
inline constexpr size_t kInt8HeaderBytes = 16;
inline constexpr unsigned char kInt8Magic[4] = {'A', 'Q', '8', 0x01};

// Number of blocks (and of scales) for n values in blocks of block_size (>= 1).
inline constexpr size_t Int8BlockCount(size_t n, size_t block_size) {
  return (n + block_size - 1) / block_size;
}

// Bytes of an int8-encoded buffer: header + 4 bytes per block + 1 byte per value.
inline constexpr size_t Int8EncodedSize(size_t n, size_t block_size) {
  return kInt8HeaderBytes + 4 * Int8BlockCount(n, block_size) + n;
}

// What the header of a well-formed int8 or int4 buffer says.
struct BlockwiseEncodedInfo {
  size_t n = 0;
  size_t block_size = 0;
};
using Int8EncodedInfo = BlockwiseEncodedInfo;

// Validates an int8 buffer without decoding its values: magic, block size in range, in_bytes ==
// Int8EncodedSize(n, B), every scale valid (see the layout above). Returns the header's n and B, or
// kInvalidArgument naming the first problem. Cost: O(n / B).
absl::StatusOr<Int8EncodedInfo> Int8BlockwiseInspect(const void* in, size_t in_bytes);

// Encodes x[0, n) in blocks of block_size into out[0, Int8EncodedSize(n, block_size)).
// When residual is not null, also writes residual[i] = x[i] - decode(out)[i] (error feedback).
// kInvalidArgument on a block size outside [kInt8MinBlockSize, kInt8MaxBlockSize] or on
// NaN/Inf input.
absl::Status Int8BlockwiseEncode(const float* x, size_t n, size_t block_size, void* out,
                                 float* residual);

// Decodes in[0, in_bytes) into out[0, n). kInvalidArgument when Int8BlockwiseInspect fails or
// the header's n differs from n; out is not written then.
absl::Status Int8BlockwiseDecode(const void* in, size_t in_bytes, float* out, size_t n);

// acc[i] += w * decode(in)[i], rounded exactly as Int8BlockwiseDecode followed by
// WeightedAccumulate. Validates first (as Int8BlockwiseDecode): acc is unchanged on error.
absl::Status Int8BlockwiseDecodeAccumulate(const void* in, size_t in_bytes, float w, float* acc,
                                           size_t n);

// ---- int4 blockwise absmax ------------------------------------------------------------------

inline constexpr size_t kInt4DefaultBlockSize = 64;
inline constexpr size_t kInt4MinBlockSize = 2;
inline constexpr size_t kInt4MaxBlockSize = size_t{1} << 16;
inline constexpr size_t kInt4HeaderBytes = 16;
inline constexpr unsigned char kInt4Magic[4] = {'A', 'Q', '4', 0x01};

// Number of blocks (and of scales) for n values in blocks of block_size (>= 1).
inline constexpr size_t Int4BlockCount(size_t n, size_t block_size) {
  return (n + block_size - 1) / block_size;
}

// Bytes of an int4-encoded buffer: header + 4 bytes per block + half a byte per value.
inline constexpr size_t Int4EncodedSize(size_t n, size_t block_size) {
  return kInt4HeaderBytes + 4 * Int4BlockCount(n, block_size) + (n + 1) / 2;
}

// True for the block sizes int4 accepts: even, in [kInt4MinBlockSize, kInt4MaxBlockSize].
inline constexpr bool Int4BlockSizeValid(size_t block_size) {
  return block_size >= kInt4MinBlockSize && block_size <= kInt4MaxBlockSize && block_size % 2 == 0;
}

using Int4EncodedInfo = BlockwiseEncodedInfo;

// Validates an int4 buffer without decoding its values: magic, block size valid, in_bytes ==
// Int4EncodedSize(n, B), every scale valid and the padding nibble 0 (see the layout above).
// Returns the header's n and B, or kInvalidArgument naming the first problem. Cost: O(n / B).
absl::StatusOr<Int4EncodedInfo> Int4BlockwiseInspect(const void* in, size_t in_bytes);

// Encodes x[0, n) in blocks of block_size into out[0, Int4EncodedSize(n, block_size)).
// When residual is not null, also writes residual[i] = x[i] - decode(out)[i] (error feedback).
// kInvalidArgument on a block size that Int4BlockSizeValid refuses or on NaN/Inf input.
absl::Status Int4BlockwiseEncode(const float* x, size_t n, size_t block_size, void* out,
                                 float* residual);

// Decodes in[0, in_bytes) into out[0, n). kInvalidArgument when Int4BlockwiseInspect fails or
// the header's n differs from n; out is not written then.
absl::Status Int4BlockwiseDecode(const void* in, size_t in_bytes, float* out, size_t n);

// acc[i] += w * decode(in)[i], rounded exactly as Int4BlockwiseDecode followed by
// WeightedAccumulate. Validates first (as Int4BlockwiseDecode): acc is unchanged on error.
absl::Status Int4BlockwiseDecodeAccumulate(const void* in, size_t in_bytes, float w, float* acc,
                                           size_t n);

namespace reference {

// Plain scalar loops with the same contracts and results as above; the definition of the
// results in tests.
absl::Status Bf16Encode(const float* x, size_t n, void* out, float* residual);
absl::Status Bf16Decode(const void* in, size_t in_bytes, float* out, size_t n);
absl::Status Bf16DecodeAccumulate(const void* in, size_t in_bytes, float w, float* acc, size_t n);
absl::Status Int8BlockwiseEncode(const float* x, size_t n, size_t block_size, void* out,
                                 float* residual);
absl::Status Int8BlockwiseDecode(const void* in, size_t in_bytes, float* out, size_t n);
absl::Status Int8BlockwiseDecodeAccumulate(const void* in, size_t in_bytes, float w, float* acc,
                                           size_t n);
absl::Status Int4BlockwiseEncode(const float* x, size_t n, size_t block_size, void* out,
                                 float* residual);
absl::Status Int4BlockwiseDecode(const void* in, size_t in_bytes, float* out, size_t n);
absl::Status Int4BlockwiseDecodeAccumulate(const void* in, size_t in_bytes, float w, float* acc,
                                           size_t n);

}  // namespace reference
}  // namespace aloe::kernels
