#include "common/tensor_codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "common/status_matchers.h"

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
  for (v1::Codec codec : {v1::CODEC_FP32, v1::CODEC_BF16, v1::CODEC_INT8_BLOCKWISE}) {
    const size_t n = MaxChunkElements(codec, 256);
    std::vector<float> x(n);
    for (float& v : x) v = normal(rng);
    std::string bytes;
    std::vector<float> residual(n);
    ASSERT_THAT(EncodeChunk(codec, x, 256, &bytes, residual.data()), IsOk());
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
    if (codec == v1::CODEC_INT8_BLOCKWISE) {
      for (size_t b = 0; b < n; b += 256) {
        float m = 0;
        for (size_t i = b; i < std::min(n, b + 256); ++i) m = std::max(m, std::abs(x[i]));
        for (size_t i = b; i < std::min(n, b + 256); ++i) {
          ASSERT_LE(std::abs(y[i] - x[i]), m / 254 * 1.0001f) << i;
        }
      }
    }
  }
  EXPECT_EQ(MaxChunkElements(v1::CODEC_INT8_BLOCKWISE, 256) % 256, 0u);
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
