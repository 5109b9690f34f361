// Tensor (de)serialisation for the wire: flat float32 buffers as little-endian bytes, split in
// chunks that keep every gRPC message under 1 MiB (gRPC's default limit is 4 MiB; a 4 MiB chunk
// fails). Compact codecs (bf16, int8 blockwise) plug in here later.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
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
// BF16 as 2 bytes per element, INT8_BLOCKWISE as the self-describing blockwise layout of
// kernels/cpu/codec_kernels.h. CODEC_UNSPECIFIED is FP32.

// The most elements one chunk of `codec` may carry so that its payload stays <= kMaxChunkBytes.
size_t MaxChunkElements(v1::Codec codec, size_t int8_block_size);

// kInvalidArgument naming the first NaN or +-Inf in values (what EncodeChunk refuses for FP32).
absl::Status CheckFinite(absl::Span<const float> values);

// Appends the encoding of values to out. When residual is not null it receives
// values - decode(encode(values)) (error feedback; zeros for FP32). kInvalidArgument for NaN/Inf
// in values, an unknown codec, or (INT8_BLOCKWISE) a block size outside [1, 65536].
absl::Status EncodeChunk(v1::Codec codec, absl::Span<const float> values, size_t int8_block_size,
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
