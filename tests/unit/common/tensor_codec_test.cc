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
