#include "common/low_rank_push.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/low_rank_wire.h"
#include "common/status_matchers.h"
#include "common/tensor_codec.h"
#include "tests/testing/low_rank_testing.h"

namespace aloe {
namespace {

using ::aloe::testing::AddTensor;
using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

constexpr uint32_t kRows = 64;
constexpr uint32_t kCols = 48;
constexpr uint32_t kRank = 4;

// One layer "blocks.0": bias [16], w [64, 48] (compressed), narrow [32, 3] (its rank-4 factors,
// (32 + 3) * 4 values, would not be smaller than its 96 values: sent with the fallback codec).
v1::ModelSpec Spec() {
  v1::ModelSpec spec;
  v1::LayerSpec* layer = spec.add_layers();
  layer->set_name("blocks.0");
  AddTensor(layer, "bias", {16});
  AddTensor(layer, "w", {kRows, kCols});
  AddTensor(layer, "narrow", {32, 3});
  return spec;
}

v1::TransportConfig Transport(v1::Codec factor_codec) {
  v1::TransportConfig transport;
  transport.set_int8_block_size(64);
  v1::LayerCodec* c = transport.add_layer_codecs();
  c->set_layer("blocks.0");
  c->set_codec(v1::CODEC_LOWRANK);
  c->set_rank(kRank);
  c->set_factor_codec(factor_codec);
  return transport;
}

// A pseudo-gradient whose w has a decaying spectrum (s_k = 0.6^k), as trained layers' do, plus
// noise that differs per round.
std::vector<float> PseudoGradient(uint32_t round) {
  static const std::vector<float> base = [] {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0, 1);
    std::vector<float> w(kRows * kCols, 0.0f);
    float s = 1.0f;
    for (uint32_t k = 0; k < kCols; ++k, s *= 0.6f) {
      std::vector<float> u(kRows), v(kCols);
      for (float& x : u) x = normal(rng) / std::sqrt(float{kRows});
      for (float& x : v) x = normal(rng) / std::sqrt(float{kCols});
      for (uint32_t i = 0; i < kRows; ++i) {
        for (uint32_t j = 0; j < kCols; ++j) w[i * kCols + j] += s * u[i] * v[j];
      }
    }
    return w;
  }();
  std::mt19937 rng(100 + round);
  std::normal_distribution<float> normal(0, 1);
  std::vector<float> g;
  for (int i = 0; i < 16; ++i) g.push_back(0.01f * normal(rng));
  for (float w : base) g.push_back(w + 0.002f * normal(rng));
  for (int i = 0; i < 96; ++i) g.push_back(0.01f * normal(rng));
  return g;
}

// What the server assembles from the chunks.
std::vector<float> Decode(const std::vector<EncodedChunk>& chunks, size_t elements,
                          uint64_t* bytes) {
  std::vector<float> layer(elements, 1e9f);
  uint64_t next = 0;
  for (const EncodedChunk& chunk : chunks) {
    EXPECT_EQ(chunk.offset, next);
    absl::StatusOr<size_t> n = EncodedElementCount(chunk.codec, chunk.payload);
    EXPECT_THAT(n.status(), IsOk());
    EXPECT_THAT(
        DecodeChunk(chunk.codec, chunk.payload, absl::MakeSpan(layer).subspan(chunk.offset, *n)),
        IsOk());
    next += *n;
    *bytes += chunk.payload.size();
  }
  EXPECT_EQ(next, elements);
  return layer;
}

double Norm(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}

TEST(LowRankPushTest, ChunksFollowTheTensorsAndTheResidualIsWhatTheyLose) {
  const v1::ModelSpec spec = Spec();
  LowRankPushEncoder encoder;
  encoder.Configure(Transport(v1::CODEC_FP32), spec);
  ASSERT_TRUE(encoder.IsLowRank(0));
  EXPECT_FALSE(encoder.IsLowRank(1));
  const std::vector<float> g = PseudoGradient(0);
  std::vector<float> residual(g.size(), 5.0f);
  std::vector<EncodedChunk> chunks;
  ASSERT_THAT(encoder.EncodeLayer(0, /*task_id=*/0, g, residual.data(), &chunks, kMaxChunkBytes),
              IsOk());
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0].codec, v1::CODEC_FP32);
  EXPECT_EQ(chunks[1].codec, v1::CODEC_LOWRANK);
  EXPECT_EQ(chunks[2].codec, v1::CODEC_FP32);
  EXPECT_EQ(chunks[1].offset, 16u);
  EXPECT_EQ(chunks[2].offset, 16u + kRows * kCols);
  uint64_t bytes = 0;
  const std::vector<float> decoded = Decode(chunks, g.size(), &bytes);
  // (rows + cols) * rank float32 factors and a header; the rest as float32.
  EXPECT_EQ(bytes, 16 * 4 + kLowRankHeaderBytes + (kRows + kCols) * kRank * 4 + 96 * 4);
  for (size_t i = 0; i < g.size(); ++i) {
    // The same subtraction as the encoder's of the same decoded value: exact.
    ASSERT_EQ(residual[i], g[i] - decoded[i]) << i;
    if (i < 16 || i >= 16 + kRows * kCols) {
      ASSERT_EQ(residual[i], 0.0f) << i;
    }
  }
}

TEST(LowRankPushTest, ErrorFeedbackMakesTheDecodedSumTrackTheTrueSum) {
  const v1::ModelSpec spec = Spec();
  const size_t n = spec.layers(0).num_elements();
  constexpr int kRounds = 20;
  for (const v1::Codec factor_codec :
       {v1::CODEC_FP32, v1::CODEC_INT8_BLOCKWISE, v1::CODEC_INT4_BLOCKWISE}) {
    SCOPED_TRACE(v1::Codec_Name(factor_codec));
    double drift[2] = {0, 0};  // ||sum true - sum decoded|| / ||sum true||, without and with
    double residual_half = 0;  // ||residual|| after half the rounds
    double residual_end = 0;
    for (const bool feedback : {false, true}) {
      LowRankPushEncoder encoder;
      encoder.Configure(Transport(factor_codec), spec);
      std::vector<float> residual(n, 0.0f);
      std::vector<double> sum_true(n, 0.0), sum_decoded(n, 0.0);
      uint64_t bytes = 0;
      for (int round = 0; round < kRounds; ++round) {
        std::vector<float> m = PseudoGradient(round);
        for (size_t i = 0; i < n; ++i) sum_true[i] += m[i];
        // As the worker does: the residual joins the next round's pseudo-gradient.
        if (feedback) {
          for (size_t i = 0; i < n; ++i) m[i] += residual[i];
        }
        std::vector<EncodedChunk> chunks;
        ASSERT_THAT(encoder.EncodeLayer(0, /*task_id=*/0, m, feedback ? residual.data() : nullptr,
                                        &chunks, kMaxChunkBytes),
                    IsOk());
        const std::vector<float> decoded = Decode(chunks, n, &bytes);
        for (size_t i = 0; i < n; ++i) sum_decoded[i] += decoded[i];
        if (feedback && round + 1 == kRounds / 2) {
          residual_half = Norm(std::vector<double>(residual.begin(), residual.end()));
        }
      }
      std::vector<double> diff(n);
      for (size_t i = 0; i < n; ++i) diff[i] = sum_true[i] - sum_decoded[i];
      drift[feedback] = Norm(diff) / Norm(sum_true);
      if (feedback) {
        // What is still missing is exactly the last residual.
        for (size_t i = 0; i < n; ++i) diff[i] -= residual[i];
        residual_end = Norm(std::vector<double>(residual.begin(), residual.end()));
        EXPECT_LT(Norm(diff) / Norm(sum_true), 1e-5);
      }
      if (factor_codec == v1::CODEC_FP32) {
        EXPECT_EQ(bytes,
                  kRounds * (16 * 4 + kLowRankHeaderBytes + (kRows + kCols) * kRank * 4 + 96 * 4));
      }
    }
    // Without feedback, every round loses the spectrum beyond rank 4 (0.6^4 of its scale and
    // below) and the noise: 9% of the sum is missing after 20 rounds, whatever their number.
    // With it, what is missing is the last residual alone, which grows like the noise's random
    // walk (sqrt(2) from 10 to 20 rounds), not like the sum (2): 3.4% after 20 rounds.
    EXPECT_GT(drift[0], 0.085);
    EXPECT_LT(drift[1], 0.04);
    EXPECT_LT(drift[1], 0.4 * drift[0]);
    EXPECT_LT(residual_end, 1.6 * residual_half);
    std::printf("%s: drift without error feedback %.4f, with %.4f; residual %.4f -> %.4f\n",
                v1::Codec_Name(factor_codec).c_str(), drift[0], drift[1], residual_half,
                residual_end);
  }
}

TEST(LowRankPushTest, TheWarmStartCarriesOverRounds) {
  const v1::ModelSpec spec = Spec();
  const std::vector<float> g = PseudoGradient(0);
  LowRankPushEncoder encoder;
  encoder.Configure(Transport(v1::CODEC_FP32), spec);
  double error[3];
  std::vector<std::vector<EncodedChunk>> sent(3);
  for (int round = 0; round < 3; ++round) {
    std::vector<float> residual(g.size());
    ASSERT_THAT(
        encoder.EncodeLayer(0, /*task_id=*/0, g, residual.data(), &sent[round], kMaxChunkBytes),
        IsOk());
    error[round] = 0;
    for (float r : residual) error[round] += double{r} * r;
  }
  // Each round is one more power iteration on the same matrix.
  EXPECT_LT(error[1], error[0]);
  EXPECT_LE(error[2], error[1] * 1.0001);
  // A new encoder starts from the same seeded Q0: the same first push.
  LowRankPushEncoder fresh;
  fresh.Configure(Transport(v1::CODEC_FP32), spec);
  std::vector<EncodedChunk> again;
  ASSERT_THAT(fresh.EncodeLayer(0, /*task_id=*/0, g, nullptr, &again, kMaxChunkBytes), IsOk());
  ASSERT_EQ(again.size(), sent[0].size());
  for (size_t c = 0; c < again.size(); ++c) EXPECT_EQ(again[c].payload, sent[0][c].payload);
  // Configured again with the same settings, the encoder keeps its warm starts.
  encoder.Configure(Transport(v1::CODEC_FP32), spec);
  std::vector<EncodedChunk> kept;
  ASSERT_THAT(encoder.EncodeLayer(0, /*task_id=*/0, g, nullptr, &kept, kMaxChunkBytes), IsOk());
  EXPECT_NE(kept[1].payload, sent[0][1].payload);
}

TEST(LowRankPushTest, RefusalsNameTheLayerTensorRankAndLimit) {
  const v1::ModelSpec spec = Spec();
  LowRankPushEncoder encoder;
  encoder.Configure(Transport(v1::CODEC_FP32), spec);
  std::vector<float> g = PseudoGradient(0);
  std::vector<EncodedChunk> chunks;
  // Q of w: 48 * 4 floats = 768 bytes.
  EXPECT_THAT(encoder.EncodeLayer(0, /*task_id=*/0, g, nullptr, &chunks, 700),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("layer 0 (blocks.0), tensor w, rank 4"),
                                        HasSubstr("chunk limit of 700"))));
  EXPECT_TRUE(chunks.empty());
  g[20] = std::nanf("");
  EXPECT_THAT(encoder.EncodeLayer(0, /*task_id=*/0, g, nullptr, &chunks, kMaxChunkBytes),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor w")));
  EXPECT_THAT(encoder.EncodeLayer(0, /*task_id=*/0, std::vector<float>(3), nullptr, &chunks,
                                  kMaxChunkBytes),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("3 values")));
  EXPECT_THAT(encoder.EncodeLayer(1, /*task_id=*/0, g, nullptr, &chunks, kMaxChunkBytes),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not low-rank")));
  EXPECT_TRUE(chunks.empty());
}

// Bytes of the CODEC_LOWRANK chunks among `chunks`.
size_t LowRankBytes(const std::vector<EncodedChunk>& chunks) {
  size_t n = 0;
  for (const EncodedChunk& c : chunks) {
    if (c.codec == v1::CODEC_LOWRANK) n += c.payload.size();
  }
  return n;
}

TEST(LowRankPushTest, TaskRanksSetTheRankAndObservationsGiveTheEffectiveRank) {
  const v1::ModelSpec spec = Spec();
  v1::TransportConfig transport = Transport(v1::CODEC_FP32);
  transport.mutable_adaptive_rank()->set_enabled(true);
  LowRankPushEncoder encoder;
  encoder.Configure(transport, spec);
  // w = 1 e_0 e_0^T + 0.6 e_1 e_1^T: energies 1 and 0.36, so 0.9 of the energy needs both
  // directions: effective rank 2.
  std::vector<float> g(spec.layers(0).num_elements(), 0.0f);
  g[16] = 1.0f;
  g[16 + kCols + 1] = 0.6f;
  std::vector<EncodedChunk> at_four;
  std::vector<v1::TensorRank> observed;
  ASSERT_THAT(
      encoder.EncodeLayer(0, /*task_id=*/1, g, nullptr, &at_four, kMaxChunkBytes, &observed),
      IsOk());
  ASSERT_EQ(observed.size(), 1u);  // only w is compressed
  EXPECT_EQ(observed[0].layer(), 0u);
  EXPECT_EQ(observed[0].tensor(), 1u);
  EXPECT_EQ(observed[0].rank(), 2u);
  // Task 7 asks for rank 1 for w: its factors are (64 + 48) * 3 floats smaller, and rank 1 holds
  // 1 / 1.36 < 0.9 of the energy, so the observation is "beyond": twice the rank.
  v1::TensorRank one;
  one.set_layer(0);
  one.set_tensor(1);
  one.set_rank(1);
  encoder.SetTaskRanks(7, {one});
  std::vector<EncodedChunk> at_one;
  observed.clear();
  ASSERT_THAT(encoder.EncodeLayer(0, /*task_id=*/7, g, nullptr, &at_one, kMaxChunkBytes, &observed),
              IsOk());
  EXPECT_EQ(LowRankBytes(at_four) - LowRankBytes(at_one), (kRows + kCols) * 3 * sizeof(float));
  ASSERT_EQ(observed.size(), 1u);
  EXPECT_EQ(observed[0].rank(), 2u);
  // Other tasks keep the configured rank; a forgotten task id too.
  for (uint64_t task = 8; task < 8 + LowRankPushEncoder::kRememberedTasks; ++task) {
    encoder.SetTaskRanks(task, {});
  }
  std::vector<EncodedChunk> again;
  ASSERT_THAT(encoder.EncodeLayer(0, /*task_id=*/7, g, nullptr, &again, kMaxChunkBytes), IsOk());
  EXPECT_EQ(LowRankBytes(again), LowRankBytes(at_four));
  // Without adaptive rank nothing is observed.
  LowRankPushEncoder plain;
  plain.Configure(Transport(v1::CODEC_FP32), spec);
  observed.clear();
  ASSERT_THAT(plain.EncodeLayer(0, /*task_id=*/1, g, nullptr, &again, kMaxChunkBytes, &observed),
              IsOk());
  EXPECT_TRUE(observed.empty());
}

}  // namespace
}  // namespace aloe
