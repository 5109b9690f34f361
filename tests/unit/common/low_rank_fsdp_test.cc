// Low-rank compression across the ranks of a multi-rank (FSDP) node, ranks as threads over an
// in-process all-reduce: the factors are one rank's on the whole matrix (bit for bit with one
// rank, up to the all-reduce's summation order with several), the chunks of each rank cover its
// slice, each rank's residual is what its own chunks lose, and the warm start carries over.
#include "common/low_rank_fsdp.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/low_rank.h"
#include "common/low_rank_push.h"
#include "common/low_rank_wire.h"
#include "common/model_spec.h"
#include "common/status_matchers.h"
#include "common/tensor_codec.h"
#include "tests/testing/in_process_all_reduce.h"
#include "tests/testing/low_rank_testing.h"

namespace aloe {
namespace {

using ::aloe::testing::AddTensor;
using ::aloe::testing::InProcessAllReduce;
using ::aloe::testing::IsOk;
using ::aloe::testing::RunRankThreads;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

// Sliced factors against one rank's on the whole matrix: the all-reduce sums each element of P
// and Q in another order (a float rounding of the partial sums), which orthonormalisation
// carries into P. Measured: at most 3e-7 of max |P Q^T| for these matrices.
constexpr double kSummationOrderTolerance = 1e-6;

// A rows x cols matrix with singular values decay^k (k = 0, 1, ...) and random singular
// vectors, plus N(0, noise^2) per element: the shape of trained layers' pseudo-gradients.
std::vector<float> DecayingMatrix(uint32_t rows, uint32_t cols, uint32_t seed, float decay,
                                  float noise) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0, 1);
  std::vector<float> m(static_cast<size_t>(rows) * cols, 0.0f);
  float s = 1.0f;
  for (uint32_t k = 0; k < std::min(rows, cols); ++k, s *= decay) {
    std::vector<float> u(rows), v(cols);
    for (float& x : u) x = normal(rng) / std::sqrt(static_cast<float>(rows));
    for (float& x : v) x = normal(rng) / std::sqrt(static_cast<float>(cols));
    for (uint32_t i = 0; i < rows; ++i) {
      for (uint32_t j = 0; j < cols; ++j) m[i * cols + j] += s * u[i] * v[j];
    }
  }
  for (float& x : m) x += noise * normal(rng);
  return m;
}

struct Matrix {
  uint32_t rows;
  uint32_t cols;
  uint32_t rank;
  std::vector<float> m;
};

std::vector<Matrix> Matrices() {
  return {{64, 48, 4, DecayingMatrix(64, 48, 1, 0.6f, 0.002f)},
          {37, 29, 5, DecayingMatrix(37, 29, 2, 0.5f, 0.001f)},
          {5, 100, 3, DecayingMatrix(5, 100, 3, 0.4f, 0.001f)}};
}

// Rank r of a node holds elements [cuts[r], cuts[r + 1]) of every matrix, cuts in fractions of
// its elements.
std::vector<LowRankSlicePiece> Pieces(const std::vector<Matrix>& matrices,
                                      const std::vector<double>& cuts, int r,
                                      const std::vector<std::vector<float>>& warm) {
  std::vector<LowRankSlicePiece> pieces;
  for (size_t t = 0; t < matrices.size(); ++t) {
    const Matrix& matrix = matrices[t];
    const uint64_t n = matrix.m.size();
    const uint64_t b = static_cast<uint64_t>(cuts[r] * n);
    const uint64_t e = static_cast<uint64_t>(cuts[r + 1] * n);
    LowRankSlicePiece& piece = pieces.emplace_back();
    piece.m = absl::MakeConstSpan(matrix.m).subspan(b, e - b);
    piece.begin = b;
    piece.rows = matrix.rows;
    piece.cols = matrix.cols;
    piece.rank = matrix.rank;
    piece.warm_q = warm.empty() ? absl::Span<const float>() : absl::MakeConstSpan(warm[t]);
    piece.seed = 100 + t;
  }
  return pieces;
}

// Every rank's factors from CompressLowRankSlices over `cuts` (one more cut than ranks).
std::vector<std::vector<LowRankSliceFactors>> CompressOnRanks(
    const std::vector<Matrix>& matrices, const std::vector<double>& cuts,
    const std::vector<std::vector<float>>& warm, int* all_reduces = nullptr) {
  const int ranks = static_cast<int>(cuts.size()) - 1;
  InProcessAllReduce node(ranks);
  std::vector<std::vector<LowRankSliceFactors>> out(ranks);
  RunRankThreads(ranks, [&](int r) {
    const std::vector<LowRankSlicePiece> pieces = Pieces(matrices, cuts, r, warm);
    auto factors = CompressLowRankSlices(
        pieces, [&](absl::Span<float> values) { return node.AllReduce(r, values); });
    ASSERT_THAT(factors, IsOk());
    out[r] = *std::move(factors);
  });
  if (all_reduces != nullptr) *all_reduces = node.calls();
  return out;
}

std::vector<float> Decompress(const LowRankFactors& f) {
  std::vector<float> out(static_cast<size_t>(f.rows) * f.cols);
  EXPECT_THAT(DecompressLowRank(f, absl::MakeSpan(out)), IsOk());
  return out;
}

// max |a - b| / max |b|.
double RelativeMaxError(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(CompressLowRankSlicesTest, OneRankGivesCompressLowRankBitForBit) {
  const std::vector<Matrix> matrices = Matrices();
  std::vector<std::vector<float>> warm;
  for (int round = 0; round < 2; ++round) {
    int all_reduces = 0;
    const auto node = CompressOnRanks(matrices, {0.0, 1.0}, warm, &all_reduces);
    EXPECT_EQ(all_reduces, 2);
    std::vector<std::vector<float>> next;
    for (size_t t = 0; t < matrices.size(); ++t) {
      const Matrix& matrix = matrices[t];
      auto one = CompressLowRank(matrix.m, matrix.rows, matrix.cols, matrix.rank,
                                 round == 0 ? absl::Span<const float>() : warm[t], 100 + t);
      ASSERT_THAT(one, IsOk());
      EXPECT_TRUE(SameBits(node[0][t].factors.p, one->p)) << "round " << round << " tensor " << t;
      EXPECT_TRUE(SameBits(node[0][t].factors.q, one->q)) << "round " << round << " tensor " << t;
      EXPECT_NEAR(node[0][t].squared_norm, FrobeniusNormSquared(matrix.m),
                  1e-6 * FrobeniusNormSquared(matrix.m));
      next.push_back(one->q);
    }
    warm = next;
  }
}

TEST(CompressLowRankSlicesTest, SlicesGiveOneRanksFactorsUpToSummationOrder) {
  const std::vector<Matrix> matrices = Matrices();
  // Cuts mid-row (0.5 of 64 x 48 is a row boundary, of 37 x 29 and 5 x 100 mid-row), at a
  // third, and a rank with nothing (0.6 to 0.6).
  for (const std::vector<double>& cuts : std::vector<std::vector<double>>{
           {0.0, 0.5, 1.0}, {0.0, 0.3333, 0.6667, 1.0}, {0.0, 0.6, 0.6, 1.0}}) {
    SCOPED_TRACE(::testing::PrintToString(cuts));
    const int ranks = static_cast<int>(cuts.size()) - 1;
    int all_reduces = 0;
    const auto node = CompressOnRanks(matrices, cuts, {}, &all_reduces);
    EXPECT_EQ(all_reduces, 2);
    for (size_t t = 0; t < matrices.size(); ++t) {
      const Matrix& matrix = matrices[t];
      // Every rank holds the same bits.
      for (int r = 1; r < ranks; ++r) {
        EXPECT_TRUE(SameBits(node[r][t].factors.p, node[0][t].factors.p)) << r;
        EXPECT_TRUE(SameBits(node[r][t].factors.q, node[0][t].factors.q)) << r;
      }
      auto one = CompressLowRank(matrix.m, matrix.rows, matrix.cols, matrix.rank, {}, 100 + t);
      ASSERT_THAT(one, IsOk());
      const double error = RelativeMaxError(Decompress(node[0][t].factors), Decompress(*one));
      std::printf("%d ranks, %d x %d at rank %d: max |P Q^T - one rank's| / max = %.3g\n", ranks,
                  matrix.rows, matrix.cols, matrix.rank, error);
      EXPECT_LE(error, kSummationOrderTolerance) << t;
      EXPECT_LE(RelativeMaxError(node[0][t].factors.q, one->q), kSummationOrderTolerance) << t;
      EXPECT_NEAR(node[0][t].squared_norm, FrobeniusNormSquared(matrix.m),
                  1e-6 * FrobeniusNormSquared(matrix.m));
    }
  }
}

TEST(CompressLowRankSlicesTest, TheWarmStartCarriesOverRounds) {
  const std::vector<Matrix> matrices = Matrices();
  const std::vector<double> cuts = {0.0, 0.3333, 0.6667, 1.0};
  std::vector<std::vector<float>> node_warm, one_warm;
  double previous_error = 1e30;
  for (int round = 0; round < 4; ++round) {
    const auto node = CompressOnRanks(matrices, cuts, node_warm);
    std::vector<std::vector<float>> node_next, one_next;
    double error = 0;  // of the 64 x 48 matrix's approximation
    for (size_t t = 0; t < matrices.size(); ++t) {
      const Matrix& matrix = matrices[t];
      // One rank over the same rounds, each warm-started from its own last Q.
      auto one = CompressLowRank(matrix.m, matrix.rows, matrix.cols, matrix.rank,
                                 round == 0 ? absl::Span<const float>() : one_warm[t], 100 + t);
      ASSERT_THAT(one, IsOk());
      const std::vector<float> decoded = Decompress(node[0][t].factors);
      EXPECT_LE(RelativeMaxError(decoded, Decompress(*one)), kSummationOrderTolerance)
          << "round " << round << " tensor " << t;
      if (t == 0) {
        for (size_t i = 0; i < decoded.size(); ++i) {
          error += std::pow(static_cast<double>(matrix.m[i]) - decoded[i], 2);
        }
      }
      node_next.push_back(node[0][t].factors.q);
      one_next.push_back(one->q);
    }
    // Each round is one more power iteration on the same matrix, from the last round's Q.
    EXPECT_LE(error, previous_error * 1.0001) << "round " << round;
    if (round == 1) {
      // The seeded start again would give round 0's factors, not these.
      const auto seeded = CompressOnRanks(matrices, cuts, {});
      EXPECT_FALSE(SameBits(seeded[0][0].factors.p, node[0][0].factors.p));
      EXPECT_LT(error, 0.9 * previous_error);
    }
    previous_error = error;
    node_warm = node_next;
    one_warm = one_next;
  }
}

TEST(CompressLowRankSlicesTest, AnUnusablePieceOnAnyRankFailsEveryRankAfterOneAllReduce) {
  std::vector<Matrix> matrices = Matrices();
  matrices[1].m[900] = std::nanf("");  // in rank 1's piece (0.5 to 1.0 of 1073 elements)
  InProcessAllReduce node(2);
  std::vector<absl::Status> status(2);
  RunRankThreads(2, [&](int r) {
    const std::vector<LowRankSlicePiece> pieces = Pieces(matrices, {0.0, 0.5, 1.0}, r, {});
    status[r] = CompressLowRankSlices(pieces, [&](absl::Span<float> values) {
                  return node.AllReduce(r, values);
                }).status();
  });
  EXPECT_EQ(node.calls(), 1);
  EXPECT_THAT(status[0], StatusIs(absl::StatusCode::kInvalidArgument,
                                  HasSubstr("low-rank tensor 1 (37 x 29): another rank's piece")));
  EXPECT_THAT(status[1], StatusIs(absl::StatusCode::kInvalidArgument,
                                  HasSubstr("low-rank tensor 1 (37 x 29): this rank's piece")));

  // A shape every rank shares is refused before any all-reduce.
  int calls = 0;
  std::vector<LowRankSlicePiece> pieces = Pieces(Matrices(), {0.0, 1.0}, 0, {});
  pieces[2].rank = 6;
  EXPECT_THAT(CompressLowRankSlices(pieces,
                                    [&](absl::Span<float>) {
                                      ++calls;
                                      return absl::OkStatus();
                                    }),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("low-rank tensor 2: rank 6 of a 5 x 100 matrix")));
  EXPECT_EQ(calls, 0);
}

// Decodes `chunks` into a buffer that holds the layer elements [first, first + size), checking
// that they cover it exactly and in order; *bytes grows by their payloads.
std::vector<float> DecodeChunks(const std::vector<EncodedChunk>& chunks, uint64_t first,
                                size_t size, uint64_t* bytes) {
  std::vector<float> out(size, 1e9f);
  uint64_t next = first;
  for (const EncodedChunk& chunk : chunks) {
    EXPECT_EQ(chunk.offset, next);
    absl::StatusOr<size_t> n = EncodedElementCount(chunk.codec, chunk.payload);
    EXPECT_THAT(n.status(), IsOk());
    if (!n.ok() || chunk.offset < first || chunk.offset - first + *n > size) {
      ADD_FAILURE() << "chunk at " << chunk.offset << " outside [" << first << ", " << first + size
                    << ")";
      return out;
    }
    EXPECT_THAT(DecodeChunk(chunk.codec, chunk.payload,
                            absl::MakeSpan(out).subspan(chunk.offset - first, *n)),
                IsOk());
    next += *n;
    *bytes += chunk.payload.size();
  }
  EXPECT_EQ(next, first + size);
  return out;
}

TEST(EncodeLowRankSlicePieceTest, WholeRowsGoAsFactorsPartialRowsDenseResidualIsTheLoss) {
  const Matrix matrix = Matrices()[0];  // 64 x 48 at rank 4
  auto factors = CompressLowRank(matrix.m, matrix.rows, matrix.cols, matrix.rank, {}, 1);
  ASSERT_THAT(factors, IsOk());
  const std::vector<float> full = Decompress(*factors);
  constexpr uint64_t kTensorOffset = 16;
  // Rows 10 to 30 whole, 20 elements of row 9 before them and 7 of row 30 after.
  const uint64_t begin = 10 * 48 - 20;
  const uint64_t end = 30 * 48 + 7;
  const absl::Span<const float> m = absl::MakeConstSpan(matrix.m).subspan(begin, end - begin);
  for (const v1::Codec codec : {v1::CODEC_FP32, v1::CODEC_INT4_BLOCKWISE}) {
    SCOPED_TRACE(v1::Codec_Name(codec));
    std::vector<EncodedChunk> chunks;
    std::vector<float> residual(m.size(), 5.0f);
    ASSERT_THAT(EncodeLowRankSlicePiece(*factors, kTensorOffset, begin, m, codec, 64,
                                        kMaxChunkBytes, residual.data(), &chunks),
                IsOk());
    ASSERT_EQ(chunks.size(), 3u);
    EXPECT_EQ(chunks[0].codec, v1::CODEC_FP32);
    EXPECT_EQ(chunks[1].codec, v1::CODEC_LOWRANK);
    EXPECT_EQ(chunks[2].codec, v1::CODEC_FP32);
    EXPECT_EQ(chunks[1].offset, kTensorOffset + 10 * 48);
    EXPECT_EQ(chunks[2].offset, kTensorOffset + 30 * 48);
    uint64_t bytes = 0;
    const std::vector<float> decoded =
        DecodeChunks(chunks, kTensorOffset + begin, m.size(), &bytes);
    for (size_t i = 0; i < m.size(); ++i) {
      ASSERT_EQ(residual[i], m[i] - decoded[i]) << i;
      const bool partial = begin + i < 10 * 48 || begin + i >= 30 * 48;
      if (codec == v1::CODEC_FP32 || partial) {
        // Float32 factors, and the partial rows, decode to P Q^T itself.
        ASSERT_EQ(decoded[i], full[begin + i]) << i;
      }
    }
    if (codec == v1::CODEC_FP32) {
      // Q and 20 rows of P, and 27 float32 values.
      EXPECT_EQ(bytes, kLowRankHeaderBytes + (48 + 20) * 4 * 4 + 27 * 4);
    }
  }
}

TEST(EncodeLowRankSlicePieceTest, APieceSmallerThanItsFactorsGoesDense) {
  const Matrix matrix = Matrices()[0];
  auto factors = CompressLowRank(matrix.m, matrix.rows, matrix.cols, matrix.rank, {}, 1);
  ASSERT_THAT(factors, IsOk());
  const std::vector<float> full = Decompress(*factors);
  // One whole row and a bit: its factors (Q alone is 48 x 4 floats) are larger than it.
  const uint64_t begin = 5 * 48;
  const absl::Span<const float> m = absl::MakeConstSpan(matrix.m).subspan(begin, 60);
  std::vector<EncodedChunk> chunks;
  std::vector<float> residual(m.size());
  ASSERT_THAT(EncodeLowRankSlicePiece(*factors, 0, begin, m, v1::CODEC_FP32, 64, kMaxChunkBytes,
                                      residual.data(), &chunks),
              IsOk());
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0].codec, v1::CODEC_FP32);
  EXPECT_EQ(chunks[0].payload.size(), 60 * 4u);
  for (size_t i = 0; i < m.size(); ++i) EXPECT_EQ(residual[i], m[i] - full[begin + i]);
  // A piece past the matrix is refused with nothing appended.
  EXPECT_THAT(EncodeLowRankSlicePiece(*factors, 0, 64 * 48 - 10, m, v1::CODEC_FP32, 64,
                                      kMaxChunkBytes, nullptr, &chunks),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ends past")));
  EXPECT_EQ(chunks.size(), 1u);
}

// One layer "blocks.0": bias [16], w [64, 48], v [37, 29], narrow [32, 3] (its factors would not
// be smaller: fallback codec), u [5, 100]; 4757 elements. 2 slices cut w mid-row (row 49); 3
// slices cut w (row 32) and v (row 2) mid-row, and leave u wholly to the last rank.
v1::ModelSpec Spec() {
  v1::ModelSpec spec;
  v1::LayerSpec* layer = spec.add_layers();
  layer->set_name("blocks.0");
  AddTensor(layer, "bias", {16});
  AddTensor(layer, "w", {64, 48});
  AddTensor(layer, "v", {37, 29});
  AddTensor(layer, "narrow", {32, 3});
  AddTensor(layer, "u", {5, 100});
  return spec;
}

v1::TransportConfig Transport(v1::Codec factor_codec) {
  v1::TransportConfig transport;
  transport.set_int4_block_size(64);
  v1::LayerCodec* c = transport.add_layer_codecs();
  c->set_layer("blocks.0");
  c->set_codec(v1::CODEC_LOWRANK);
  c->set_rank(4);
  c->set_factor_codec(factor_codec);
  return transport;
}

// The layer's pseudo-gradient of a round: Matrices() for w, v and u plus noise that differs per
// round, small random values for bias and narrow.
std::vector<float> LayerGradient(uint32_t round) {
  static const std::vector<Matrix> matrices = Matrices();
  std::mt19937 rng(50 + round);
  std::normal_distribution<float> normal(0, 1);
  std::vector<float> g;
  auto add_random = [&](int n) {
    for (int i = 0; i < n; ++i) g.push_back(0.01f * normal(rng));
  };
  auto add_matrix = [&](const Matrix& matrix) {
    for (float x : matrix.m) g.push_back(x + 0.002f * normal(rng));
  };
  add_random(16);
  add_matrix(matrices[0]);
  add_matrix(matrices[1]);
  add_random(96);
  add_matrix(matrices[2]);
  return g;
}

// The Q section's bytes of the single-rank chunk of the tensor at layer offset `offset`.
uint64_t QBytes(const std::vector<EncodedChunk>& chunks, uint64_t offset) {
  for (const EncodedChunk& chunk : chunks) {
    if (chunk.codec != v1::CODEC_LOWRANK) continue;
    absl::StatusOr<LowRankChunkHeader> header = ParseLowRankHeader(chunk.payload);
    EXPECT_THAT(header.status(), IsOk());
    if (header.ok() && header->offset == offset) return header->q_bytes;
  }
  ADD_FAILURE() << "no low-rank chunk of the tensor at " << offset;
  return 0;
}

// One push of the layer by every rank of a node: each rank's chunks, residual and bytes.
struct NodePush {
  std::vector<float> decoded;   // the layer as the server assembles the ranks' slices
  std::vector<float> residual;  // the ranks' residuals, side by side
  uint64_t bytes = 0;
};

// Rank r's encoders[r] (configured for slice r) push `values` (the whole layer; each rank takes
// its slice) after compressing together.
NodePush PushFromRanks(std::vector<LowRankPushEncoder>& encoders,
                       const std::vector<float>& values) {
  const int ranks = static_cast<int>(encoders.size());
  InProcessAllReduce node(ranks);
  NodePush push;
  push.decoded.assign(values.size(), 0.0f);
  push.residual.assign(values.size(), 0.0f);
  std::vector<uint64_t> bytes(ranks, 0);
  RunRankThreads(ranks, [&](int r) {
    const auto [b, e] = SliceRange(values.size(), ranks, r);
    const std::vector<std::vector<float>> slices = {{values.begin() + b, values.begin() + e}};
    ASSERT_THAT(
        encoders[r].CompressSlices(/*task_id=*/0, slices,
                                   [&](absl::Span<float> v) { return node.AllReduce(r, v); }),
        IsOk());
    std::vector<EncodedChunk> chunks;
    ASSERT_THAT(encoders[r].EncodeLayer(0, /*task_id=*/0, slices[0], push.residual.data() + b,
                                        &chunks, kMaxChunkBytes),
                IsOk());
    const std::vector<float> decoded = DecodeChunks(chunks, b, e - b, &bytes[r]);
    std::copy(decoded.begin(), decoded.end(), push.decoded.begin() + b);
  });
  EXPECT_EQ(node.calls(), 2);
  for (uint64_t b : bytes) push.bytes += b;
  return push;
}

TEST(LowRankPushEncoderSlicesTest, TheNodesUpdateIsOneRanksAndEachResidualIsItsSlicesLoss) {
  const v1::ModelSpec spec = Spec();
  const std::vector<float> g = LayerGradient(0);
  for (const v1::Codec codec : {v1::CODEC_FP32, v1::CODEC_INT4_BLOCKWISE}) {
    LowRankPushEncoder one;
    one.Configure(Transport(codec), spec);
    std::vector<EncodedChunk> chunks;
    ASSERT_THAT(one.EncodeLayer(0, /*task_id=*/0, g, nullptr, &chunks, kMaxChunkBytes), IsOk());
    uint64_t one_bytes = 0;
    const std::vector<float> one_decoded = DecodeChunks(chunks, 0, g.size(), &one_bytes);
    for (const int ranks : {2, 3}) {
      SCOPED_TRACE(absl::StrFormat("%s, %d ranks", v1::Codec_Name(codec), ranks));
      std::vector<LowRankPushEncoder> encoders(ranks);
      for (int r = 0; r < ranks; ++r) encoders[r].Configure(Transport(codec), spec, r, ranks);
      const NodePush push = PushFromRanks(encoders, g);
      for (size_t i = 0; i < g.size(); ++i) ASSERT_EQ(push.residual[i], g[i] - push.decoded[i]);
      const double error = RelativeMaxError(push.decoded, one_decoded);
      std::printf("%s, %d ranks: max |node - one rank| / max %.3g; bytes %d vs %d\n",
                  v1::Codec_Name(codec).c_str(), ranks, error, static_cast<int>(push.bytes),
                  static_cast<int>(one_bytes));
      // A tensor cut by a slice boundary costs at most one more chunk header and Q, its cut
      // row as float32, and a factor section header and block scale of P (w at 16 is cut by 2
      // and 3 ranks, v at 3088 by 3).
      uint64_t bound = one_bytes;
      for (const auto& [offset, cols] :
           ranks == 2 ? std::vector<std::pair<uint64_t, int>>{{16, 48}}
                      : std::vector<std::pair<uint64_t, int>>{{16, 48}, {3088, 29}}) {
        bound += kLowRankHeaderBytes + QBytes(chunks, offset) + 4 * cols + 24;
      }
      EXPECT_LE(push.bytes, bound);
      if (codec == v1::CODEC_FP32) {
        EXPECT_LE(error, kSummationOrderTolerance);
        if (ranks == 2) {
          // Exactly: one more header and Q, row 49 of w as 48 floats instead of 4.
          EXPECT_EQ(push.bytes, one_bytes + kLowRankHeaderBytes + 48 * 4 * 4 + 48 * 4 - 4 * 4);
        }
      } else {
        // int4 blocks of P start where each rank's rows start: the quantisation differs from
        // one rank's by about a step of the 4-bit levels, 1/7 of a block's max.
        EXPECT_LE(error, 0.15);
      }
    }
  }
}

TEST(LowRankPushEncoderSlicesTest, ErrorFeedbackAcrossRanksTracksTheTrueSumAsOneRanksDoes) {
  const v1::ModelSpec spec = Spec();
  constexpr int kRounds = 12;
  constexpr int kRanks = 3;
  const size_t n = spec.layers(0).num_elements();
  LowRankPushEncoder one;
  one.Configure(Transport(v1::CODEC_INT4_BLOCKWISE), spec);
  std::vector<LowRankPushEncoder> encoders(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    encoders[r].Configure(Transport(v1::CODEC_INT4_BLOCKWISE), spec, r, kRanks);
  }
  std::vector<float> one_residual(n, 0.0f), node_residual(n, 0.0f);
  std::vector<double> sum_true(n, 0.0), sum_one(n, 0.0), sum_node(n, 0.0);
  for (int round = 0; round < kRounds; ++round) {
    const std::vector<float> g = LayerGradient(round);
    std::vector<float> m_one = g, m_node = g;
    for (size_t i = 0; i < n; ++i) {
      sum_true[i] += g[i];
      m_one[i] += one_residual[i];
      m_node[i] += node_residual[i];
    }
    std::vector<EncodedChunk> chunks;
    ASSERT_THAT(
        one.EncodeLayer(0, /*task_id=*/0, m_one, one_residual.data(), &chunks, kMaxChunkBytes),
        IsOk());
    uint64_t bytes = 0;
    const std::vector<float> one_decoded = DecodeChunks(chunks, 0, n, &bytes);
    const NodePush push = PushFromRanks(encoders, m_node);
    node_residual = push.residual;
    for (size_t i = 0; i < n; ++i) {
      sum_one[i] += one_decoded[i];
      sum_node[i] += push.decoded[i];
    }
  }
  double norm = 0, drift_one = 0, drift_node = 0, missing = 0;
  for (size_t i = 0; i < n; ++i) {
    norm += sum_true[i] * sum_true[i];
    drift_one += std::pow(sum_true[i] - sum_one[i], 2);
    drift_node += std::pow(sum_true[i] - sum_node[i], 2);
    // What the node has not delivered is exactly its ranks' last residuals.
    missing += std::pow(sum_true[i] - sum_node[i] - node_residual[i], 2);
  }
  drift_one = std::sqrt(drift_one / norm);
  drift_node = std::sqrt(drift_node / norm);
  std::printf("drift of the decoded sum after %d rounds: one rank %.4f, %d ranks %.4f\n", kRounds,
              drift_one, kRanks, drift_node);
  EXPECT_LT(std::sqrt(missing / norm), 1e-5);
  EXPECT_LT(drift_node, 0.08);
  EXPECT_LT(drift_node, 1.1 * drift_one);
}

// From the second round on every rank starts from last round's Q (the warm start): the node's
// factors must stay one rank's, round after round.
TEST(LowRankPushEncoderSlicesTest, WarmStartedRoundsStayOneRanks) {
  const v1::ModelSpec spec = Spec();
  LowRankPushEncoder one;
  one.Configure(Transport(v1::CODEC_FP32), spec);
  std::vector<LowRankPushEncoder> encoders(2);
  for (int r = 0; r < 2; ++r) encoders[r].Configure(Transport(v1::CODEC_FP32), spec, r, 2);
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE(absl::StrFormat("round %d", round));
    // Each round's gradient differs, so that a wrong warm start gives other factors.
    std::vector<float> g = LayerGradient(0);
    for (size_t i = 0; i < g.size(); ++i) g[i] *= 1.0f + 0.1f * round * std::sin(0.37f * i);
    std::vector<EncodedChunk> chunks;
    ASSERT_THAT(one.EncodeLayer(0, /*task_id=*/0, g, nullptr, &chunks, kMaxChunkBytes), IsOk());
    uint64_t bytes = 0;
    const std::vector<float> one_decoded = DecodeChunks(chunks, 0, g.size(), &bytes);
    const NodePush push = PushFromRanks(encoders, g);
    EXPECT_LE(RelativeMaxError(push.decoded, one_decoded), kSummationOrderTolerance);
  }
}

TEST(LowRankPushEncoderSlicesTest, RefusesWithoutFactorsAndSlicesOfTheWrongSize) {
  const v1::ModelSpec spec = Spec();
  const std::vector<float> g = LayerGradient(0);
  LowRankPushEncoder whole;
  whole.Configure(Transport(v1::CODEC_FP32), spec);
  EXPECT_THAT(
      whole.CompressSlices(/*task_id=*/0, {g}, [](absl::Span<float>) { return absl::OkStatus(); }),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("slices > 1")));
  std::vector<LowRankPushEncoder> encoders(2);
  for (int r = 0; r < 2; ++r) encoders[r].Configure(Transport(v1::CODEC_FP32), spec, r, 2);
  const auto [b, e] = SliceRange(g.size(), 2, 1);
  const std::vector<float> slice(g.begin() + b, g.end());
  std::vector<EncodedChunk> chunks;
  EXPECT_THAT(encoders[1].EncodeLayer(0, /*task_id=*/0, slice, nullptr, &chunks, kMaxChunkBytes),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no factors of this node's slices")));
  EXPECT_THAT(encoders[1].EncodeLayer(0, /*task_id=*/0, std::vector<float>(7), nullptr, &chunks,
                                      kMaxChunkBytes),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("slice 1 of 2 holds 2378")));
  EXPECT_TRUE(chunks.empty());
  // Rank 0 passes a slice of the wrong size: both ranks refuse after one all-reduce.
  InProcessAllReduce node(2);
  std::vector<absl::Status> status(2);
  RunRankThreads(2, [&](int r) {
    const std::vector<std::vector<float>> slices = {r == 0 ? std::vector<float>(5) : slice};
    status[r] = encoders[r].CompressSlices(
        /*task_id=*/0, slices, [&](absl::Span<float> v) { return node.AllReduce(r, v); });
  });
  EXPECT_EQ(node.calls(), 1);
  EXPECT_THAT(status[0], StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("this rank's")));
  EXPECT_THAT(status[1], StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("another rank's")));
}

}  // namespace
}  // namespace aloe
