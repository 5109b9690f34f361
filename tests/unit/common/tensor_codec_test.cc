#include "common/tensor_codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "common/status_matchers.h"
#include "kernels/cpu/codec_kernels.h"

namespace aloe {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

TEST(TensorCodecTest, RoundTripIsBitExactAcrossChunks) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0, 10);
  std::vector<float> values(kMaxChunkFloats * 2 + 123);
  for (float& v : values) v = normal(rng);
  values[5] = -0.0f;
  values[6] = std::numeric_limits<float>::denorm_min();
  values[7] = std::numeric_limits<float>::max();

  std::vector<float> decoded(values.size());
  size_t covered = 0;
  for (auto [begin, end] : ChunkRanges(values.size())) {
    ASSERT_EQ(begin, covered);
    ASSERT_LE((end - begin) * sizeof(float), kMaxChunkBytes);
    std::string bytes;
    AppendFloats(absl::MakeConstSpan(values.data() + begin, end - begin), &bytes);
    ASSERT_EQ(bytes.size(), (end - begin) * 4);
    ASSERT_THAT(DecodeFloats(bytes, absl::MakeSpan(decoded.data() + begin, end - begin)), IsOk());
    covered = end;
  }
  EXPECT_EQ(covered, values.size());
  EXPECT_EQ(ChunkRanges(values.size()).size(), 3u);
  EXPECT_EQ(std::memcmp(values.data(), decoded.data(), values.size() * 4), 0);
}

TEST(TensorCodecTest, LittleEndianLayout) {
  std::string bytes;
  AppendFloats({1.0f}, &bytes);  // 0x3f800000
  EXPECT_EQ(bytes, std::string("\x00\x00\x80\x3f", 4));
}

TEST(TensorCodecTest, RejectsWrongSizesAndNonFiniteValues) {
  std::vector<float> out(2);
  EXPECT_THAT(DecodeFloats(std::string(7, '\0'), absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("multiple of 4")));
  EXPECT_THAT(DecodeFloats(std::string(12, '\0'), absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected 2")));
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::string bytes;
    AppendFloats({0.5f, bad}, &bytes);
    EXPECT_THAT(DecodeFloats(bytes, absl::MakeSpan(out)),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("element 1")));
  }
}

TEST(TensorCodecTest, ChunkRangesEdgeCases) {
  EXPECT_TRUE(ChunkRanges(0).empty());
  auto r = ChunkRanges(10, 4);
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[2], std::make_pair(size_t{8}, size_t{10}));
}

}  // namespace
}  // namespace aloe

namespace aloe {
namespace {

TEST(CodecChunkTest, EveryCodecRoundTripsWithinItsBoundAndStaysUnderTheChunkLimit) {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0, 1);
  const BlockSizes blocks(256, 64);
  for (v1::Codec codec :
       {v1::CODEC_FP32, v1::CODEC_BF16, v1::CODEC_INT8_BLOCKWISE, v1::CODEC_INT4_BLOCKWISE}) {
    const size_t n = MaxChunkElements(codec, blocks.Of(codec));
    std::vector<float> x(n);
    for (float& v : x) v = normal(rng);
    std::string bytes;
    std::vector<float> residual(n);
    ASSERT_THAT(EncodeChunk(codec, x, blocks.Of(codec), &bytes, residual.data()), IsOk());
    EXPECT_LE(bytes.size(), kMaxChunkBytes) << v1::Codec_Name(codec);
    auto count = EncodedElementCount(codec, bytes);
    ASSERT_THAT(count, IsOk());
    ASSERT_EQ(*count, n);
    std::vector<float> y(n);
    ASSERT_THAT(DecodeChunk(codec, bytes, absl::MakeSpan(y)), IsOk());
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(residual[i], x[i] - y[i]) << v1::Codec_Name(codec) << " element " << i;
      if (codec == v1::CODEC_FP32) {
        ASSERT_EQ(y[i], x[i]);
      }
      if (codec == v1::CODEC_BF16) {
        ASSERT_LE(std::abs(y[i] - x[i]), std::abs(x[i]) / 256);
      }
    }
    if (codec == v1::CODEC_INT8_BLOCKWISE || codec == v1::CODEC_INT4_BLOCKWISE) {
      // Half a step: m / 254 for int8, m / 14 for int4.
      const size_t block = blocks.Of(codec);
      const float half_steps = codec == v1::CODEC_INT8_BLOCKWISE ? 254.0f : 14.0f;
      for (size_t b = 0; b < n; b += block) {
        float m = 0;
        for (size_t i = b; i < std::min(n, b + block); ++i) m = std::max(m, std::abs(x[i]));
        for (size_t i = b; i < std::min(n, b + block); ++i) {
          ASSERT_LE(std::abs(y[i] - x[i]), m / half_steps * 1.0001f) << i;
        }
      }
    }
  }
  EXPECT_EQ(MaxChunkElements(v1::CODEC_INT8_BLOCKWISE, 256) % 256, 0u);
  // int4: whole blocks, and one more block would not fit.
  const size_t int4_max = MaxChunkElements(v1::CODEC_INT4_BLOCKWISE, 64);
  EXPECT_EQ(int4_max % 64, 0u);
  EXPECT_LE(kernels::Int4EncodedSize(int4_max, 64), kMaxChunkBytes);
  EXPECT_GT(kernels::Int4EncodedSize(int4_max + 64, 64), kMaxChunkBytes);
  EXPECT_GT(int4_max, 2 * kMaxChunkBytes * 8 / 9 - 64);  // 4.5 bits per value
}

TEST(CodecChunkTest, BlockSizesFollowTheTransportConfig) {
  v1::TransportConfig transport;
  EXPECT_EQ(TransportBlockSizes(transport).int8, 1u);  // as before: 0 reads as 1
  EXPECT_EQ(TransportBlockSizes(transport).int4, 64u);
  transport.set_int8_block_size(128);
  transport.set_int4_block_size(32);
  const BlockSizes blocks = TransportBlockSizes(transport);
  EXPECT_EQ(blocks.Of(v1::CODEC_INT8_BLOCKWISE), 128u);
  EXPECT_EQ(blocks.Of(v1::CODEC_INT4_BLOCKWISE), 32u);
  EXPECT_EQ(blocks.Of(v1::CODEC_BF16), 0u);
  EXPECT_EQ(BlockSizes(512).int4, 64u);
}

// What FeedbackDrift measured after the last round.
struct Drift {
  double max_abs = 0.0;    // max over elements of |sum of true - sum of decoded updates|
  double max_steps = 0.0;  // the same, per element in quantization steps of its last block
  double max_step = 0.0;   // the largest quantization step (m / 7) of the last round
};

// Rounds of int4 pushes as a worker makes them: each round's update (plus, with feedback, the
// carried residual) is encoded; the encoding's residual is carried to the next round.
Drift FeedbackDrift(bool feedback, size_t rounds, size_t n, size_t block) {
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0, 1);
  std::vector<double> sum_true(n, 0.0), sum_decoded(n, 0.0);
  std::vector<float> bias(n), residual(n, 0.0f), update(n), decoded(n), step(n);
  // A steady per-element drift (a pseudo-gradient's persistent direction) plus round-to-round
  // noise, and one large coordinate per block that sets the block's step: most values are
  // below half a step, and without feedback rounding eats them.
  for (float& b : bias) b = 0.05f * normal(rng);
  for (size_t r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < n; ++i) {
      update[i] = bias[i] + 0.2f * normal(rng) + (i % block == 0 ? 5.0f : 0.0f);
      sum_true[i] += update[i];
      if (feedback) update[i] += residual[i];
    }
    std::string bytes;
    EXPECT_THAT(EncodeChunk(v1::CODEC_INT4_BLOCKWISE, update, block, &bytes, residual.data()),
                IsOk());
    EXPECT_THAT(DecodeChunk(v1::CODEC_INT4_BLOCKWISE, bytes, absl::MakeSpan(decoded)), IsOk());
    for (size_t i = 0; i < n; ++i) sum_decoded[i] += decoded[i];
    for (size_t b = 0; b < n; b += block) {
      float m = 0;
      for (size_t i = b; i < std::min(n, b + block); ++i) m = std::max(m, std::abs(update[i]));
      for (size_t i = b; i < std::min(n, b + block); ++i) step[i] = m / 7.0f;
    }
  }
  Drift drift;
  for (size_t i = 0; i < n; ++i) {
    const double d = std::abs(sum_true[i] - sum_decoded[i]);
    drift.max_abs = std::max(drift.max_abs, d);
    drift.max_steps = std::max(drift.max_steps, d / step[i]);
    drift.max_step = std::max(drift.max_step, static_cast<double>(step[i]));
  }
  return drift;
}

TEST(CodecChunkTest, Int4ErrorFeedbackKeepsTheSumOfDecodedUpdatesOnTheTrueSum) {
  // With feedback the decoded sum telescopes to the true sum minus the last residual: at most
  // half a step of each element's last block. Without it, every round's rounding error stays.
  const Drift with = FeedbackDrift(true, 50, 10001, 64);
  const Drift without = FeedbackDrift(false, 50, 10001, 64);
  RecordProperty("drift_with_feedback", std::to_string(with.max_abs));
  RecordProperty("drift_without_feedback", std::to_string(without.max_abs));
  RecordProperty("last_round_max_step", std::to_string(with.max_step));
  EXPECT_LE(with.max_steps, 0.5 + 1e-4);
  EXPECT_LT(with.max_abs, 0.5 * with.max_step + 1e-4);
  EXPECT_GT(without.max_abs, 10.0 * with.max_abs);
  EXPECT_GT(without.max_steps, 5.0);
}

TEST(CodecChunkTest, MalformedPayloadsAndNonFiniteInputsAreRejected) {
  std::string bytes;
  EXPECT_THAT(EncodeChunk(v1::CODEC_INT8_BLOCKWISE, {1.0f, std::nanf("")}, 256, &bytes, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("[1]")));
  EXPECT_THAT(
      EncodeChunk(v1::CODEC_FP32, {std::numeric_limits<float>::infinity()}, 256, &bytes, nullptr),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("element 0")));
  EXPECT_THAT(EncodedElementCount(v1::CODEC_BF16, std::string(3, '\0')),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bf16")));
  EXPECT_THAT(EncodedElementCount(v1::CODEC_INT8_BLOCKWISE, std::string(40, '\0')),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(EncodedElementCount(static_cast<v1::Codec>(77), "abcd"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown codec")));
}

}  // namespace
}  // namespace aloe
