#include "common/low_rank_fsdp.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/low_rank_push.h"
#include "common/low_rank_wire.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"

namespace aloe {
namespace {

bool AllFinite(absl::Span<const float> values) {
  for (float v : values) {
    if (!std::isfinite(v)) return false;
  }
  return true;
}

// The checks every rank makes alike, before any all-reduce.
absl::Status CheckShape(const LowRankSlicePiece& piece, size_t index) {
  if (piece.rows == 0 || piece.cols == 0 || piece.rank == 0 ||
      piece.rank > std::min(piece.rows, piece.cols)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "low-rank tensor %d: rank %d of a %d x %d matrix; need 1 <= rank <= min(rows, cols)", index,
        piece.rank, piece.rows, piece.cols));
  }
  if (!piece.warm_q.empty() &&
      piece.warm_q.size() != static_cast<uint64_t>(piece.cols) * piece.rank) {
    return absl::InvalidArgumentError(
        absl::StrFormat("low-rank tensor %d: warm start q has %d values, not cols * rank = %d * %d",
                        index, piece.warm_q.size(), piece.cols, piece.rank));
  }
  if (!AllFinite(piece.warm_q)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("low-rank tensor %d: warm start q holds NaN or Inf", index));
  }
  return absl::OkStatus();
}

// Whether the piece lies within its matrix and holds finite values only.
bool Usable(const LowRankSlicePiece& piece) {
  const uint64_t elements = static_cast<uint64_t>(piece.rows) * piece.cols;
  return piece.begin <= elements && piece.m.size() <= elements - piece.begin && AllFinite(piece.m);
}

}  // namespace

absl::StatusOr<std::vector<LowRankSliceFactors>> CompressLowRankSlices(
    absl::Span<const LowRankSlicePiece> pieces, AllReduceFloats all_reduce) {
  size_t p_floats = 0;
  size_t q_floats = 0;
  for (size_t t = 0; t < pieces.size(); ++t) {
    ALOE_RETURN_IF_ERROR(CheckShape(pieces[t], t));
    p_floats += static_cast<size_t>(pieces[t].rows) * pieces[t].rank;
    q_floats += static_cast<size_t>(pieces[t].cols) * pieces[t].rank;
  }
  // The first all-reduce: every tensor's P, then per tensor ||M_s||^2 and the count of ranks
  // whose piece is unusable, so that every rank learns of a problem on any of them.
  std::vector<float> p_all(p_floats + 2 * pieces.size(), 0.0f);
  float* const stats = p_all.data() + p_floats;
  std::vector<bool> usable(pieces.size());
  size_t at = 0;
  for (size_t t = 0; t < pieces.size(); ++t) {
    const LowRankSlicePiece& piece = pieces[t];
    const absl::Span<float> p =
        absl::MakeSpan(p_all).subspan(at, static_cast<size_t>(piece.rows) * piece.rank);
    at += p.size();
    usable[t] = Usable(piece);
    if (!usable[t]) {
      stats[2 * t + 1] = 1.0f;
      continue;
    }
    stats[2 * t] = static_cast<float>(FrobeniusNormSquared(piece.m));
    if (piece.m.empty()) continue;
    const std::vector<float> q0 = LowRankStartQ(piece.warm_q, piece.cols, piece.rank, piece.seed);
    LowRankRangeTimesQ(piece.m, piece.begin, piece.cols, q0, piece.rank, p);
  }
  ALOE_RETURN_IF_ERROR(all_reduce(absl::MakeSpan(p_all)));

  std::vector<LowRankSliceFactors> out(pieces.size());
  at = 0;
  for (size_t t = 0; t < pieces.size(); ++t) {
    const LowRankSlicePiece& piece = pieces[t];
    if (stats[2 * t + 1] != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "low-rank tensor %d (%d x %d): %s holds NaN or Inf, or lies outside the matrix", t,
          piece.rows, piece.cols, usable[t] ? "another rank's piece" : "this rank's piece"));
    }
    LowRankFactors& f = out[t].factors;
    f.rows = piece.rows;
    f.cols = piece.cols;
    f.rank = piece.rank;
    f.p.assign(p_all.begin() + at,
               p_all.begin() + at + static_cast<size_t>(piece.rows) * piece.rank);
    at += f.p.size();
    if (!AllFinite(f.p)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("low-rank tensor %d: M * Q overflows float; scale the input down", t));
    }
    // Every rank orthonormalises the same bits and so holds the same P.
    OrthonormalizeLowRankColumns(absl::MakeSpan(f.p), f.rows, f.rank);
    out[t].squared_norm = stats[2 * t];
  }

  std::vector<float> q_all(q_floats, 0.0f);
  at = 0;
  for (size_t t = 0; t < pieces.size(); ++t) {
    const LowRankSlicePiece& piece = pieces[t];
    const absl::Span<float> q =
        absl::MakeSpan(q_all).subspan(at, static_cast<size_t>(piece.cols) * piece.rank);
    at += q.size();
    if (!piece.m.empty()) {
      LowRankRangeTransposedTimesP(piece.m, piece.begin, piece.cols, out[t].factors.p, piece.rank,
                                   q);
    }
  }
  ALOE_RETURN_IF_ERROR(all_reduce(absl::MakeSpan(q_all)));
  at = 0;
  for (size_t t = 0; t < pieces.size(); ++t) {
    LowRankFactors& f = out[t].factors;
    f.q.assign(q_all.begin() + at, q_all.begin() + at + static_cast<size_t>(f.cols) * f.rank);
    at += f.q.size();
    if (!AllFinite(f.q)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("low-rank tensor %d: M^T * P overflows float; scale the input down", t));
    }
  }
  return out;
}

absl::Status EncodeLowRankSlicePiece(const LowRankFactors& factors, uint64_t tensor_offset,
                                     uint64_t begin, absl::Span<const float> m,
                                     v1::Codec factor_codec, size_t block_size,
                                     size_t max_chunk_bytes, float* residual,
                                     std::vector<EncodedChunk>* chunks) {
  ALOE_RETURN_IF_ERROR(ValidateLowRankFactors(factors));
  const uint64_t cols = factors.cols;
  const uint64_t elements = static_cast<uint64_t>(factors.rows) * cols;
  if (begin > elements || m.size() > elements - begin) {
    return absl::InvalidArgumentError(
        absl::StrFormat("low-rank: piece [%d, %d) ends past the %d x %d matrix", begin,
                        begin + m.size(), factors.rows, factors.cols));
  }
  if (m.empty()) return absl::OkStatus();
  const uint64_t end = begin + m.size();
  const v1::Codec fallback = LowRankFallbackCodec(factor_codec);
  const size_t value_bytes = fallback == v1::CODEC_BF16 ? 2 : sizeof(float);
  const size_t fallback_elements = std::max<size_t>(1, max_chunk_bytes / value_bytes);
  std::vector<EncodedChunk> out;
  // Elements [from, to) of the matrix as the fallback codec of P Q^T.
  auto dense = [&](uint64_t from, uint64_t to) -> absl::Status {
    std::vector<float> values(to - from, 0.0f);
    ALOE_RETURN_IF_ERROR(AccumulateLowRankRange(factors, from, 1.0f, absl::MakeSpan(values)));
    for (auto [b, e] : ChunkRanges(values.size(), fallback_elements)) {
      EncodedChunk& chunk = out.emplace_back();
      chunk.offset = tensor_offset + from + b;
      chunk.codec = fallback;
      ALOE_RETURN_IF_ERROR(EncodeChunk(fallback, absl::MakeConstSpan(values).subspan(b, e - b), 0,
                                       &chunk.payload, nullptr));
    }
    return absl::OkStatus();
  };
  // P's rows [first_row, end_row) lie wholly inside the piece.
  const uint64_t first_row = (begin + cols - 1) / cols;
  const uint64_t end_row = end / cols;
  uint64_t bytes = 0;
  if (first_row < end_row) {
    if (begin < first_row * cols) ALOE_RETURN_IF_ERROR(dense(begin, first_row * cols));
    ALOE_ASSIGN_OR_RETURN(
        LowRankEncoding encoding,
        EncodeLowRankFactorRows(factors, tensor_offset, static_cast<uint32_t>(first_row),
                                static_cast<uint32_t>(end_row), factor_codec, block_size,
                                max_chunk_bytes));
    for (LowRankChunk& c : encoding.chunks) {
      EncodedChunk& chunk = out.emplace_back();
      chunk.offset = c.offset;
      chunk.codec = v1::CODEC_LOWRANK;
      chunk.payload = std::move(c.payload);
    }
    if (end_row * cols < end) ALOE_RETURN_IF_ERROR(dense(end_row * cols, end));
    for (const EncodedChunk& chunk : out) bytes += chunk.payload.size();
  }
  if (first_row >= end_row || bytes >= m.size() * value_bytes) {
    out.clear();
    ALOE_RETURN_IF_ERROR(dense(begin, end));
  }
  if (residual != nullptr) {
    // What the server decodes, chunk by chunk.
    std::vector<float> decoded(m.size());
    for (const EncodedChunk& chunk : out) {
      ALOE_ASSIGN_OR_RETURN(const size_t n, EncodedElementCount(chunk.codec, chunk.payload));
      ALOE_RETURN_IF_ERROR(
          DecodeChunk(chunk.codec, chunk.payload,
                      absl::MakeSpan(decoded).subspan(chunk.offset - tensor_offset - begin, n)));
    }
    for (size_t i = 0; i < m.size(); ++i) residual[i] = m[i] - decoded[i];
  }
  for (EncodedChunk& chunk : out) chunks->push_back(std::move(chunk));
  return absl::OkStatus();
}

}  // namespace aloe
