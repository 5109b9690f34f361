#include "common/low_rank_wire.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "kernels/cpu/codec_kernels.h"

namespace aloe {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the wire format is little-endian");

template <typename T>
T Load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
void Store(T v, std::string* out) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}

void AppendHeader(const LowRankChunkHeader& h, std::string* out) {
  Store<uint32_t>(kLowRankWireMagic, out);
  Store<uint16_t>(kLowRankWireVersion, out);
  Store<uint16_t>(static_cast<uint16_t>(h.factor_codec), out);
  Store<uint64_t>(h.offset, out);
  Store<uint32_t>(h.rows, out);
  Store<uint32_t>(h.cols, out);
  Store<uint32_t>(h.rank, out);
  Store<uint32_t>(h.row_begin, out);
  Store<uint32_t>(h.row_end, out);
  Store<uint32_t>(h.q_bytes, out);
}

// Bytes `codec` encodes n values in.
size_t FactorBytes(v1::Codec codec, size_t n, size_t block_size) {
  switch (codec) {
    case v1::CODEC_BF16:
      return kernels::Bf16EncodedSize(n);
    case v1::CODEC_INT8_BLOCKWISE:
      return kernels::Int8EncodedSize(n, std::max<size_t>(1, block_size));
    case v1::CODEC_INT4_BLOCKWISE:
      return kernels::Int4EncodedSize(n, std::max<size_t>(2, block_size));
    default:
      return n * sizeof(float);
  }
}

// Decodes a factor section of exactly `expected` values, naming the factor on error.
absl::Status DecodeFactor(v1::Codec codec, std::string_view bytes, size_t expected,
                          const char* name, const char* shape, std::vector<float>* out) {
  absl::StatusOr<size_t> n = EncodedElementCount(codec, bytes);
  if (!n.ok()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("low-rank chunk: factor %s: %s", name, n.status().message()));
  }
  if (*n != expected) {
    return absl::InvalidArgumentError(
        absl::StrFormat("low-rank chunk: factor %s holds %d values, the header's shape %s needs %d",
                        name, *n, shape, expected));
  }
  out->resize(expected);
  if (absl::Status s = DecodeChunk(codec, bytes, absl::MakeSpan(*out)); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("low-rank chunk: factor %s: %s", name, s.message()));
  }
  return absl::OkStatus();
}

}  // namespace

bool IsLowRankFactorCodec(v1::Codec codec) {
  return codec == v1::CODEC_FP32 || codec == v1::CODEC_BF16 || codec == v1::CODEC_INT8_BLOCKWISE ||
         codec == v1::CODEC_INT4_BLOCKWISE;
}

v1::Codec LowRankFallbackCodec(v1::Codec factor_codec) {
  return factor_codec == v1::CODEC_BF16 ? v1::CODEC_BF16 : v1::CODEC_FP32;
}

std::optional<std::pair<uint32_t, uint32_t>> LowRankMatrixShape(const v1::TensorSpec& tensor) {
  if (tensor.shape_size() < 2) return std::nullopt;
  constexpr int64_t kMax = std::numeric_limits<uint32_t>::max();
  const int64_t rows = tensor.shape(0);
  int64_t cols = 1;
  for (int d = 1; d < tensor.shape_size(); ++d) {
    const int64_t dim = tensor.shape(d);
    if (dim <= 0 || dim > kMax || cols > kMax / dim) return std::nullopt;
    cols *= dim;
  }
  if (rows <= 0 || rows > kMax) return std::nullopt;
  return std::make_pair(static_cast<uint32_t>(rows), static_cast<uint32_t>(cols));
}

absl::StatusOr<LowRankChunkHeader> ParseLowRankHeader(std::string_view payload) {
  if (payload.size() < kLowRankHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("low-rank chunk of %d bytes is truncated: the header alone has %d",
                        payload.size(), kLowRankHeaderBytes));
  }
  const char* p = payload.data();
  if (Load<uint32_t>(p) != kLowRankWireMagic) {
    return absl::InvalidArgumentError("low-rank chunk: bad magic");
  }
  if (const uint16_t version = Load<uint16_t>(p + 4); version != kLowRankWireVersion) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "low-rank chunk: version %d, this build reads %d", version, kLowRankWireVersion));
  }
  LowRankChunkHeader h;
  const uint16_t codec = Load<uint16_t>(p + 6);
  if (!v1::Codec_IsValid(codec) || !IsLowRankFactorCodec(static_cast<v1::Codec>(codec))) {
    return absl::InvalidArgumentError(
        absl::StrFormat("low-rank chunk: codec %d cannot encode factors", codec));
  }
  h.factor_codec = static_cast<v1::Codec>(codec);
  h.offset = Load<uint64_t>(p + 8);
  h.rows = Load<uint32_t>(p + 16);
  h.cols = Load<uint32_t>(p + 20);
  h.rank = Load<uint32_t>(p + 24);
  h.row_begin = Load<uint32_t>(p + 28);
  h.row_end = Load<uint32_t>(p + 32);
  h.q_bytes = Load<uint32_t>(p + 36);
  if (h.rows == 0 || h.cols == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("low-rank chunk: empty matrix %d x %d", h.rows, h.cols));
  }
  if (h.rank == 0 || h.rank > std::min({h.rows, h.cols, kMaxLowRank})) {
    return absl::InvalidArgumentError(
        absl::StrFormat("low-rank chunk: wrong rank %d for a %d x %d matrix (1 to min(rows, "
                        "cols, %d))",
                        h.rank, h.rows, h.cols, kMaxLowRank));
  }
  if (h.row_begin >= h.row_end || h.row_end > h.rows) {
    return absl::InvalidArgumentError(
        absl::StrFormat("low-rank chunk: rows [%d, %d) are not a non-empty range of the %d rows",
                        h.row_begin, h.row_end, h.rows));
  }
  if (h.q_bytes > payload.size() - kLowRankHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("low-rank chunk is truncated: Q of %d bytes, %d bytes after the header",
                        h.q_bytes, payload.size() - kLowRankHeaderBytes));
  }
  return h;
}

absl::StatusOr<size_t> LowRankChunkElements(std::string_view payload) {
  ALOE_ASSIGN_OR_RETURN(const LowRankChunkHeader h, ParseLowRankHeader(payload));
  return static_cast<size_t>(h.row_end - h.row_begin) * h.cols;
}

absl::Status DecodeLowRankChunk(std::string_view payload, absl::Span<float> out) {
  ALOE_ASSIGN_OR_RETURN(const LowRankChunkHeader h, ParseLowRankHeader(payload));
  const uint32_t n = h.row_end - h.row_begin;
  if (out.size() != static_cast<uint64_t>(n) * h.cols) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "low-rank chunk decodes to %d x %d values, expected %d", n, h.cols, out.size()));
  }
  const std::string_view q_bytes = payload.substr(kLowRankHeaderBytes, h.q_bytes);
  const std::string_view p_bytes = payload.substr(kLowRankHeaderBytes + h.q_bytes);
  std::vector<float> q;
  std::vector<float> p;
  ALOE_RETURN_IF_ERROR(DecodeFactor(h.factor_codec, q_bytes, static_cast<size_t>(h.cols) * h.rank,
                                    "Q", "cols x rank", &q));
  ALOE_RETURN_IF_ERROR(DecodeFactor(h.factor_codec, p_bytes, static_cast<size_t>(n) * h.rank, "P",
                                    "(b - a) x rank", &p));
  ALOE_ASSIGN_OR_RETURN(const LowRankRowDecoder decoder,
                        LowRankRowDecoder::Create(q, h.rows, h.cols, h.rank));
  // Checked here too (the factor codecs refuse non-finite values already) so that out is
  // written only by a decode that succeeds.
  if (absl::Status s = CheckFinite(p); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("low-rank chunk: factor P: ", s.message()));
  }
  // -0 + x is x for every x (+0 + -0 is +0), so accumulating into -0 copies exactly.
  std::fill(out.begin(), out.end(), -0.0f);
  return decoder.AccumulateRows(h.row_begin, p, 1.0f, out);
}

absl::Status CheckLowRankChunkInLayer(const v1::LayerSpec& layer, uint64_t offset,
                                      std::string_view payload) {
  ALOE_ASSIGN_OR_RETURN(const LowRankChunkHeader h, ParseLowRankHeader(payload));
  const uint64_t first = h.offset + static_cast<uint64_t>(h.row_begin) * h.cols;
  if (first < h.offset || first != offset) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "low-rank chunk at offset %d says it holds rows [%d, %d) of the tensor at offset %d, "
        "which begin at element %d",
        offset, h.row_begin, h.row_end, h.offset, first));
  }
  uint64_t at = 0;
  for (const v1::TensorSpec& tensor : layer.tensors()) {
    uint64_t size = 1;
    for (int64_t d : tensor.shape()) size *= static_cast<uint64_t>(std::max<int64_t>(d, 0));
    if (at == h.offset) {
      const auto shape = LowRankMatrixShape(tensor);
      if (!shape || shape->first != h.rows || shape->second != h.cols) {
        return absl::InvalidArgumentError(
            absl::StrFormat("low-rank chunk: the tensor at offset %d (%s) is not a %d x %d matrix",
                            h.offset, tensor.name(), h.rows, h.cols));
      }
      return absl::OkStatus();
    }
    if (at > h.offset) break;
    at += size;
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("low-rank chunk: no tensor of the layer begins at offset %d", h.offset));
}

uint32_t LowRankTensorRank(const v1::TensorSpec& tensor, uint32_t layer_rank) {
  const auto shape = LowRankMatrixShape(tensor);
  if (!shape) return 0;
  const uint32_t rank = std::min({layer_rank, shape->first, shape->second});
  const uint64_t elements = static_cast<uint64_t>(shape->first) * shape->second;
  return (static_cast<uint64_t>(shape->first) + shape->second) * rank < elements ? rank : 0;
}

uint64_t LowRankMinChunkBytes(uint32_t cols, uint32_t rank, v1::Codec factor_codec,
                              size_t block_size) {
  return kLowRankHeaderBytes +
         FactorBytes(factor_codec, static_cast<size_t>(cols) * rank, block_size) +
         FactorBytes(factor_codec, rank, block_size);
}

uint32_t LowRankMaxChunkRank(uint32_t cols, v1::Codec factor_codec, size_t block_size,
                             size_t max_chunk_bytes) {
  // The bytes grow with the rank: the largest rank that fits, by bisection.
  uint32_t lo = 0;
  uint32_t hi = kMaxLowRank;
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo + 1) / 2;
    if (LowRankMinChunkBytes(cols, mid, factor_codec, block_size) <= max_chunk_bytes) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

absl::StatusOr<LowRankEncoding> EncodeLowRankFactors(const LowRankFactors& factors,
                                                     uint64_t tensor_offset, v1::Codec factor_codec,
                                                     size_t block_size, size_t max_chunk_bytes) {
  ALOE_RETURN_IF_ERROR(ValidateLowRankFactors(factors));
  if (!IsLowRankFactorCodec(factor_codec)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("low-rank: %s cannot encode factors", v1::Codec_Name(factor_codec)));
  }
  if (factors.rank > kMaxLowRank) {
    return absl::InvalidArgumentError(
        absl::StrFormat("low-rank: rank %d above %d", factors.rank, kMaxLowRank));
  }
  LowRankEncoding encoding;
  LowRankFactors& decoded = encoding.decoded;
  decoded.rows = factors.rows;
  decoded.cols = factors.cols;
  decoded.rank = factors.rank;
  std::string q_bytes;
  ALOE_RETURN_IF_ERROR(EncodeChunk(factor_codec, factors.q, block_size, &q_bytes, nullptr));
  decoded.q.resize(factors.q.size());
  ALOE_RETURN_IF_ERROR(DecodeChunk(factor_codec, q_bytes, absl::MakeSpan(decoded.q)));
  const size_t rank = factors.rank;
  const size_t fixed = kLowRankHeaderBytes + q_bytes.size();
  if (fixed + FactorBytes(factor_codec, rank, block_size) > max_chunk_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "low-rank: Q of a %d x %d matrix at rank %d takes %d bytes in %s: with the header and one "
        "row of P that exceeds the chunk limit of %d bytes; lower the rank",
        factors.rows, factors.cols, factors.rank, q_bytes.size(), v1::Codec_Name(factor_codec),
        max_chunk_bytes));
  }
  // The most rows of P after Q: FactorBytes grows with n, so search the largest that fits.
  uint32_t lo = 1;
  uint32_t hi = factors.rows;
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo + 1) / 2;
    if (fixed + FactorBytes(factor_codec, mid * rank, block_size) <= max_chunk_bytes) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const uint32_t rows_per_chunk = lo;
  decoded.p.resize(factors.p.size());
  for (uint32_t a = 0; a < factors.rows; a += rows_per_chunk) {
    const uint32_t b = std::min(factors.rows, a + rows_per_chunk);
    LowRankChunk& chunk = encoding.chunks.emplace_back();
    chunk.offset = tensor_offset + static_cast<uint64_t>(a) * factors.cols;
    LowRankChunkHeader h;
    h.factor_codec = factor_codec;
    h.offset = tensor_offset;
    h.rows = factors.rows;
    h.cols = factors.cols;
    h.rank = factors.rank;
    h.row_begin = a;
    h.row_end = b;
    h.q_bytes = static_cast<uint32_t>(q_bytes.size());
    AppendHeader(h, &chunk.payload);
    chunk.payload.append(q_bytes);
    const size_t p_begin = chunk.payload.size();
    const absl::Span<const float> p_rows =
        absl::MakeConstSpan(factors.p).subspan(a * rank, (b - a) * rank);
    ALOE_RETURN_IF_ERROR(EncodeChunk(factor_codec, p_rows, block_size, &chunk.payload, nullptr));
    ALOE_RETURN_IF_ERROR(DecodeChunk(factor_codec, std::string_view(chunk.payload).substr(p_begin),
                                     absl::MakeSpan(decoded.p).subspan(a * rank, p_rows.size())));
  }
  return encoding;
}

}  // namespace aloe
