// CODEC_LOWRANK on the wire: the low-rank factors of one 2-D tensor of a layer (paper 001,
// common/low_rank.h), encoded by the worker and decoded by the server straight into its
// staging buffer. A chunk carries rows [a, b) of one tensor:
//
//   bytes [0, 4)    uint32 magic kLowRankWireMagic ("ALRK")
//   bytes [4, 6)    uint16 version kLowRankWireVersion
//   bytes [6, 8)    uint16 factor codec (v1::Codec: FP32, BF16, INT8_BLOCKWISE, INT4_BLOCKWISE)
//   bytes [8, 16)   uint64 offset: the tensor's first element in the layer
//   bytes [16, 20)  uint32 rows
//   bytes [20, 24)  uint32 cols
//   bytes [24, 28)  uint32 rank, 1 <= rank <= min(rows, cols, kMaxLowRank)
//   bytes [28, 32)  uint32 a (first row), a < b
//   bytes [32, 36)  uint32 b (end row), b <= rows
//   bytes [36, 40)  uint32 q_bytes: the size of the Q section
//   then Q (cols x rank, row-major) encoded with the factor codec in q_bytes bytes,
//   then P rows [a, b) ((b - a) x rank, row-major) encoded with the factor codec (the rest).
//
// All little-endian. The chunk decodes to the elements [offset + a * cols, offset + b * cols)
// of the layer: (P[a:b] Q^T) row-major. Every chunk repeats Q, so each one decodes on its own
// and the server holds only Q transposed and the chunk's P rows besides its staging buffer.
// A tensor with more dimensions is the matrix (shape[0], product of the others).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/low_rank.h"
#include "proto/aloe.pb.h"

namespace aloe {

inline constexpr uint32_t kLowRankWireMagic = 0x4B524C41;  // "ALRK" little-endian
inline constexpr uint16_t kLowRankWireVersion = 1;
inline constexpr size_t kLowRankHeaderBytes = 40;
// The largest rank a config or a chunk may name.
inline constexpr uint32_t kMaxLowRank = 4096;

struct LowRankChunkHeader {
  v1::Codec factor_codec = v1::CODEC_FP32;
  uint64_t offset = 0;
  uint32_t rows = 0;
  uint32_t cols = 0;
  uint32_t rank = 0;
  uint32_t row_begin = 0;
  uint32_t row_end = 0;
  uint32_t q_bytes = 0;
};

// Whether `codec` may encode low-rank factors: FP32, BF16, INT8_BLOCKWISE, INT4_BLOCKWISE.
bool IsLowRankFactorCodec(v1::Codec codec);

// The codec of the tensors of a low-rank layer that are not compressed (1-D tensors, and 2-D
// ones whose factors would not be smaller): BF16 when the factors are BF16, else FP32.
v1::Codec LowRankFallbackCodec(v1::Codec factor_codec);

// The matrix a tensor is compressed as: (shape[0], product of the other dimensions) for two or
// more dimensions; nullopt for fewer, or when a dimension does not fit in uint32.
std::optional<std::pair<uint32_t, uint32_t>> LowRankMatrixShape(const v1::TensorSpec& tensor);

// The rank a tensor of a low-rank layer of rank `layer_rank` is compressed at: min(layer_rank,
// rows, cols) of its matrix when the factors ((rows + cols) * rank floats) are fewer than its
// elements, else 0: the tensor goes whole at the fallback codec (1-D tensors too).
uint32_t LowRankTensorRank(const v1::TensorSpec& tensor, uint32_t layer_rank);

// Bytes of the smallest chunk EncodeLowRankFactors makes for a matrix of `cols` columns at
// `rank`: the header, Q (cols x rank) and one row of P at the factor codec; block_size is the
// factor codec's (BlockSizes::Of). The encoder refuses the tensor when this exceeds its
// max_chunk_bytes.
uint64_t LowRankMinChunkBytes(uint32_t cols, uint32_t rank, v1::Codec factor_codec,
                              size_t block_size);

// The largest rank in [0, kMaxLowRank] whose LowRankMinChunkBytes fits in max_chunk_bytes.
uint32_t LowRankMaxChunkRank(uint32_t cols, v1::Codec factor_codec, size_t block_size,
                             size_t max_chunk_bytes);

// Parses and checks the header: size, magic, version, factor codec, rank within
// [1, min(rows, cols, kMaxLowRank)], a < b <= rows, and q_bytes within the payload.
// kInvalidArgument naming the problem.
absl::StatusOr<LowRankChunkHeader> ParseLowRankHeader(std::string_view payload);

// The elements a chunk decodes to: (b - a) * cols, from its header.
absl::StatusOr<size_t> LowRankChunkElements(std::string_view payload);

// Decodes a chunk into out, which holds exactly (b - a) * cols elements: out = P[a:b] Q^T, as
// DecompressLowRank of the decoded factors gives them, bit for bit. Q and P are decoded and
// checked (shapes against the header, finite values) before out is written: on error out is
// untouched. kInvalidArgument naming the problem.
absl::Status DecodeLowRankChunk(std::string_view payload, absl::Span<float> out);

// Checks that a chunk fits `layer` where it is placed: its elements begin at `offset` in the
// layer (= header offset + a * cols), and a tensor of the layer begins at the header's offset
// with the matrix shape (rows, cols). kInvalidArgument naming the problem.
absl::Status CheckLowRankChunkInLayer(const v1::LayerSpec& layer, uint64_t offset,
                                      std::string_view payload);

// One encoded chunk: its first element in the layer, and its payload.
struct LowRankChunk {
  uint64_t offset = 0;
  std::string payload;
};

// The chunks of one tensor and the factors the server will decode them to.
struct LowRankEncoding {
  std::vector<LowRankChunk> chunks;
  // P and Q as decoded from the chunks (quantised by the factor codec): what error feedback
  // subtracts.
  LowRankFactors decoded;
};

// Encodes the factors of the tensor that begins at `tensor_offset` in its layer, in chunks of at
// most max_chunk_bytes: Q in every chunk, P's rows split across them. block_size is the factor
// codec's (BlockSizes::Of). kInvalidArgument when the factors are malformed, the codec cannot
// encode factors, or one chunk cannot hold Q and a row of P (the message names the rank and
// the limit).
absl::StatusOr<LowRankEncoding> EncodeLowRankFactors(const LowRankFactors& factors,
                                                     uint64_t tensor_offset, v1::Codec factor_codec,
                                                     size_t block_size, size_t max_chunk_bytes);

}  // namespace aloe
