// Low-rank compression (paper 001) on a multi-rank (FSDP) node: each rank holds one slice of
// every layer's flat buffer, and no rank ever holds a whole pseudo-gradient matrix. Per 2-D
// tensor M, with M_s the rank's elements of M and zeros elsewhere:
//
//   P = sum over the ranks of M_s Q0     (all-reduce)
//   P = orthonormalise(P)                (on every rank, from the same bits)
//   Q = sum over the ranks of M_s^T P    (all-reduce; also the next round's Q0)
//
// which is CompressLowRank of the whole M up to the order in which the all-reduce sums. Then
// each rank sends its own elements of P Q^T and keeps its own error-feedback residual
// (EncodeLowRankSlicePiece). docs/algorithms.md, "Low-rank compression (paper 001)", "FSDP
// ranks", has the costs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/low_rank.h"
#include "proto/aloe.pb.h"

namespace aloe {

struct EncodedChunk;  // common/low_rank_push.h

// Sums `values` element-wise over the ranks of the node, in place, leaving the same bits on
// every rank. Every rank calls it at the same point with the same length.
using AllReduceFloats = absl::FunctionRef<absl::Status(absl::Span<float>)>;

// One rank's part of a 2-D tensor: the elements [begin, begin + m.size()) of the row-major
// rows x cols matrix. m may be empty: the rank holds none of the tensor but joins the
// all-reduces. A rank whose own input is unusable still joins them, with begin past rows * cols:
// every rank then refuses the compression.
struct LowRankSlicePiece {
  absl::Span<const float> m;
  uint64_t begin = 0;
  uint32_t rows = 0;
  uint32_t cols = 0;
  uint32_t rank = 0;
  // cols x rank: last round's Q of the tensor (the same on every rank); empty: the seeded init.
  absl::Span<const float> warm_q;
  uint64_t seed = 0;
};

// The compression of one tensor, the same on every rank.
struct LowRankSliceFactors {
  LowRankFactors factors;
  // ||M||_F^2 of the whole tensor: each rank's part in double, summed over the ranks in float.
  double squared_norm = 0;
};

// Compresses every tensor of `pieces` with two calls of all_reduce in all: one for the P of
// every tensor (rows x rank floats each, and two per tensor more), one for every Q (cols x rank
// each). Every rank of the node passes the same tensors (shapes, ranks, warm starts, seeds) in
// the same order, each with its own piece; the factors are CompressLowRank's of the whole
// matrices up to the order of the all-reduce's sums. kInvalidArgument, naming the tensor, for a
// bad shape or warm start (as CompressLowRank; before any all-reduce, on every rank alike) and,
// after the first all-reduce on every rank (none makes the second call), for NaN or Inf in any
// rank's piece, a piece past the end of its matrix, or products that overflow float.
// all_reduce's errors as it returns them.
absl::StatusOr<std::vector<LowRankSliceFactors>> CompressLowRankSlices(
    absl::Span<const LowRankSlicePiece> pieces, AllReduceFloats all_reduce);

// Encodes one rank's piece of a tensor compressed by CompressLowRankSlices: its elements
// [begin, begin + m.size()) of the matrix, which begins at tensor_offset in its layer. Appends
// chunks in offset order that cover exactly the layer elements [tensor_offset + begin,
// tensor_offset + begin + m.size()):
//   - P's rows wholly inside the piece, with Q, as CODEC_LOWRANK chunks in factor_codec
//     (EncodeLowRankFactorRows: the server's decode as for a whole tensor);
//   - the partial rows at either end of the piece as the fallback codec
//     (LowRankFallbackCodec(factor_codec)) of P Q^T there;
//   - or, when that is not fewer bytes, the whole piece as the fallback codec of P Q^T.
// When residual is not null it receives m.size() floats: m minus what the chunks decode to.
// kInvalidArgument, with nothing appended, for malformed factors, a piece past the matrix's
// end, or a Q that does not fit in one chunk (as EncodeLowRankFactors).
absl::Status EncodeLowRankSlicePiece(const LowRankFactors& factors, uint64_t tensor_offset,
                                     uint64_t begin, absl::Span<const float> m,
                                     v1::Codec factor_codec, size_t block_size,
                                     size_t max_chunk_bytes, float* residual,
                                     std::vector<EncodedChunk>* chunks);

}  // namespace aloe
