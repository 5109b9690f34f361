// Tensor (de)serialisation for the wire: flat float32 buffers as little-endian bytes, split in
// chunks that keep every gRPC message under 1 MiB (gRPC's default limit is 4 MiB; a 4 MiB chunk
// fails), and the compact codecs of pushes (bf16, int8 and int4 blockwise).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/cpu/codec_kernels.h"
#include "proto/aloe.pb.h"

namespace aloe {

// Payload bytes per chunk: 1 MiB less room for the message's other fields.
inline constexpr size_t kMaxChunkBytes = (1u << 20) - 1024;
inline constexpr size_t kMaxChunkFloats = kMaxChunkBytes / sizeof(float);

// Appends values as float32 little-endian bytes to out.
void AppendFloats(absl::Span<const float> values, std::string* out);

// Decodes float32 little-endian bytes into out, which must have exactly bytes.size()/4 elements.
// kInvalidArgument when the byte count is not a multiple of 4 or does not match out.size(), or
// when a decoded value is NaN or +-Inf (the message names the first bad element). out may have
// been partly written on error; callers decode into staging memory.
absl::Status DecodeFloats(std::string_view bytes, absl::Span<float> out);

// --- Codec-aware chunks (pushes). A chunk encodes a run of elements on its own: FP32 as above,
// BF16 as 2 bytes per element, INT8_BLOCKWISE and INT4_BLOCKWISE as the self-describing
// blockwise layouts of kernels/cpu/codec_kernels.h. CODEC_UNSPECIFIED is FP32.

// Values per absmax scale of the blockwise codecs (TransportConfig's int8_block_size and
// int4_block_size).
struct BlockSizes {
  BlockSizes() = default;
  // Implicit, so that a caller that pushes no int4 names int8's block size alone.
  BlockSizes(size_t int8_block_size)  // NOLINT(google-explicit-constructor)
      : int8(int8_block_size) {}
  BlockSizes(size_t int8_block_size, size_t int4_block_size)
      : int8(int8_block_size), int4(int4_block_size) {}

  // The block size `codec` uses; 0 for the codecs without blocks.
  size_t Of(v1::Codec codec) const;

  size_t int8 = kernels::kInt8DefaultBlockSize;
  size_t int4 = kernels::kInt4DefaultBlockSize;
};

// The block sizes a worker pushes with: int8's as the config says (at least 1), int4's as it says
// or its default when 0 (a server that predates the field).
BlockSizes TransportBlockSizes(const v1::TransportConfig& transport);

// The most elements one chunk of `codec` may carry so that its payload stays <= kMaxChunkBytes;
// block_size is the codec's (BlockSizes::Of), whole blocks only.
size_t MaxChunkElements(v1::Codec codec, size_t block_size);

// kInvalidArgument naming the first NaN or +-Inf in values (what EncodeChunk refuses for FP32).
absl::Status CheckFinite(absl::Span<const float> values);

// Appends the encoding of values to out; block_size is the codec's (BlockSizes::Of; ignored by
// FP32 and BF16). When residual is not null it receives values - decode(encode(values)) (error
// feedback; zeros for FP32). kInvalidArgument for NaN/Inf in values, an unknown codec, or a block
// size the codec refuses (INT8_BLOCKWISE: outside [1, 65536]; INT4_BLOCKWISE: odd or outside
// [2, 65536]).
absl::Status EncodeChunk(v1::Codec codec, absl::Span<const float> values, size_t block_size,
                         std::string* out, float* residual);

// Elements an encoded payload holds; kInvalidArgument when its framing is malformed. For
// CODEC_LOWRANK (common/low_rank_wire.h), which EncodeChunk refuses, from the chunk's header.
absl::StatusOr<size_t> EncodedElementCount(v1::Codec codec, std::string_view payload);

// Decodes a payload of exactly out.size() elements. kInvalidArgument for malformed payloads and
// non-finite values. out may be partly written on error.
absl::Status DecodeChunk(v1::Codec codec, std::string_view payload, absl::Span<float> out);

// [begin, end) element ranges covering n elements with at most max_elements each.
std::vector<std::pair<size_t, size_t>> ChunkRanges(size_t n, size_t max_elements = kMaxChunkFloats);

}  // namespace aloe
