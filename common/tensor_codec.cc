#include "common/tensor_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_format.h"
#include "common/low_rank_wire.h"
#include "kernels/cpu/codec_kernels.h"
#include "kernels/cpu/outer_kernels.h"

namespace aloe {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the wire format is little-endian");

void AppendFloats(absl::Span<const float> values, std::string* out) {
  // append, not resize + memcpy: one pass over the bytes instead of a zero-fill and a copy.
  out->append(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

absl::Status DecodeFloats(std::string_view bytes, absl::Span<float> out) {
  if (bytes.size() % sizeof(float) != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("float32 payload of %d bytes is not a multiple of 4", bytes.size()));
  }
  if (bytes.size() / sizeof(float) != out.size()) {
    return absl::InvalidArgumentError(absl::StrFormat("payload holds %d floats, expected %d",
                                                      bytes.size() / sizeof(float), out.size()));
  }
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  if (!kernels::AllFinite(out.data(), out.size())) {
    for (size_t i = 0; i < out.size(); ++i) {
      if (!std::isfinite(out[i])) {
        return absl::InvalidArgumentError(
            absl::StrFormat("non-finite value %f at element %d", out[i], i));
      }
    }
  }
  return absl::OkStatus();
}

size_t BlockSizes::Of(v1::Codec codec) const {
  switch (codec) {
    case v1::CODEC_INT8_BLOCKWISE:
      return int8;
    case v1::CODEC_INT4_BLOCKWISE:
      return int4;
    default:
      return 0;
  }
}

BlockSizes TransportBlockSizes(const v1::TransportConfig& transport) {
  return BlockSizes(std::max<uint32_t>(1, transport.int8_block_size()),
                    transport.int4_block_size() == 0 ? kernels::kInt4DefaultBlockSize
                                                     : transport.int4_block_size());
}

size_t MaxChunkElements(v1::Codec codec, size_t block_size) {
  switch (codec) {
    case v1::CODEC_BF16:
      return kMaxChunkBytes / 2;
    case v1::CODEC_INT8_BLOCKWISE: {
      // 1 byte per value + 4 bytes per block + the header; whole blocks only.
      const size_t b = std::max<size_t>(1, block_size);
      const size_t blocks = (kMaxChunkBytes - kernels::kInt8HeaderBytes) / (b + 4);
      return std::max<size_t>(1, blocks) * b;
    }
    case v1::CODEC_INT4_BLOCKWISE: {
      // Half a byte per value (b is even) + 4 bytes per block + the header; whole blocks only.
      const size_t b = std::max<size_t>(2, block_size);
      const size_t blocks = (kMaxChunkBytes - kernels::kInt4HeaderBytes) / (b / 2 + 4);
      return std::max<size_t>(1, blocks) * b;
    }
    default:
      return kMaxChunkFloats;
  }
}

absl::Status CheckFinite(absl::Span<const float> values) {
  if (kernels::AllFinite(values.data(), values.size())) return absl::OkStatus();
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(
          absl::StrFormat("non-finite value %f at element %d", values[i], i));
    }
  }
  return absl::OkStatus();
}

absl::Status EncodeChunk(v1::Codec codec, absl::Span<const float> values, size_t block_size,
                         std::string* out, float* residual) {
  const size_t old = out->size();
  switch (codec) {
    case v1::CODEC_UNSPECIFIED:
    case v1::CODEC_FP32:
      if (absl::Status s = CheckFinite(values); !s.ok()) return s;
      AppendFloats(values, out);
      if (residual != nullptr) std::fill(residual, residual + values.size(), 0.0f);
      return absl::OkStatus();
    case v1::CODEC_BF16:
      out->resize(old + kernels::Bf16EncodedSize(values.size()));
      return kernels::Bf16Encode(values.data(), values.size(), out->data() + old, residual);
    case v1::CODEC_INT8_BLOCKWISE:
      // Checked before sizing the output: Int8EncodedSize divides by the block size.
      if (block_size < kernels::kInt8MinBlockSize || block_size > kernels::kInt8MaxBlockSize) {
        return absl::InvalidArgumentError(absl::StrFormat("int8 block size %d outside [%d, %d]",
                                                          block_size, kernels::kInt8MinBlockSize,
                                                          kernels::kInt8MaxBlockSize));
      }
      out->resize(old + kernels::Int8EncodedSize(values.size(), block_size));
      return kernels::Int8BlockwiseEncode(values.data(), values.size(), block_size,
                                          out->data() + old, residual);
    case v1::CODEC_INT4_BLOCKWISE:
      if (!kernels::Int4BlockSizeValid(block_size)) {
        return absl::InvalidArgumentError(
            absl::StrFormat("int4 block size %d is not an even number in [%d, %d]", block_size,
                            kernels::kInt4MinBlockSize, kernels::kInt4MaxBlockSize));
      }
      out->resize(old + kernels::Int4EncodedSize(values.size(), block_size));
      return kernels::Int4BlockwiseEncode(values.data(), values.size(), block_size,
                                          out->data() + old, residual);
    case v1::CODEC_LOWRANK:
      return absl::InvalidArgumentError(
          "CODEC_LOWRANK encodes the factors of a whole 2-D tensor (EncodeLowRankFactors), not a "
          "run of values");
    default:
      return absl::InvalidArgumentError(absl::StrFormat("unknown codec %d", codec));
  }
}

absl::StatusOr<size_t> EncodedElementCount(v1::Codec codec, std::string_view payload) {
  switch (codec) {
    case v1::CODEC_UNSPECIFIED:
    case v1::CODEC_FP32:
      if (payload.size() % 4 != 0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("payload of %d bytes is not float32", payload.size()));
      }
      return payload.size() / 4;
    case v1::CODEC_BF16:
      if (payload.size() % 2 != 0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("payload of %d bytes is not bf16", payload.size()));
      }
      return payload.size() / 2;
    case v1::CODEC_INT8_BLOCKWISE:
    case v1::CODEC_INT4_BLOCKWISE: {
      absl::StatusOr<kernels::BlockwiseEncodedInfo> info =
          codec == v1::CODEC_INT8_BLOCKWISE
              ? kernels::Int8BlockwiseInspect(payload.data(), payload.size())
              : kernels::Int4BlockwiseInspect(payload.data(), payload.size());
      if (!info.ok()) return info.status();
      return info->n;
    }
    case v1::CODEC_LOWRANK:
      return LowRankChunkElements(payload);
    default:
      return absl::InvalidArgumentError(absl::StrFormat("unknown codec %d", codec));
  }
}

absl::Status DecodeChunk(v1::Codec codec, std::string_view payload, absl::Span<float> out) {
  switch (codec) {
    case v1::CODEC_UNSPECIFIED:
    case v1::CODEC_FP32:
      return DecodeFloats(payload, out);
    case v1::CODEC_BF16:
      return kernels::Bf16Decode(payload.data(), payload.size(), out.data(), out.size());
    case v1::CODEC_INT8_BLOCKWISE:
      return kernels::Int8BlockwiseDecode(payload.data(), payload.size(), out.data(), out.size());
    case v1::CODEC_INT4_BLOCKWISE:
      return kernels::Int4BlockwiseDecode(payload.data(), payload.size(), out.data(), out.size());
    case v1::CODEC_LOWRANK:
      return DecodeLowRankChunk(payload, out);
    default:
      return absl::InvalidArgumentError(absl::StrFormat("unknown codec %d", codec));
  }
}

std::vector<std::pair<size_t, size_t>> ChunkRanges(size_t n, size_t max_elements) {
  std::vector<std::pair<size_t, size_t>> ranges;
  if (max_elements == 0) max_elements = 1;
  for (size_t b = 0; b < n; b += max_elements)
    ranges.emplace_back(b, std::min(n, b + max_elements));
  return ranges;
}

}  // namespace aloe
