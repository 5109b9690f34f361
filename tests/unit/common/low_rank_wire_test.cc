#include "common/low_rank_wire.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "common/tensor_codec.h"
#include "tests/testing/low_rank_testing.h"

namespace aloe {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::RandomMatrix;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;

LowRankFactors Factors(uint32_t rows, uint32_t cols, uint32_t rank, uint32_t seed) {
  const std::vector<float> m = RandomMatrix(rows, cols, seed);
  absl::StatusOr<LowRankFactors> f = CompressLowRank(m, rows, cols, rank, {}, seed);
  EXPECT_THAT(f.status(), IsOk());
  return *f;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

template <typename T>
void Patch(std::string* payload, size_t at, T value) {
  std::memcpy(payload->data() + at, &value, sizeof(T));
}

TEST(LowRankWireTest, RoundTripIsDecompressOfTheDecodedFactorsBitForBit) {
  for (const v1::Codec codec :
       {v1::CODEC_FP32, v1::CODEC_BF16, v1::CODEC_INT8_BLOCKWISE, v1::CODEC_INT4_BLOCKWISE}) {
    SCOPED_TRACE(v1::Codec_Name(codec));
    const LowRankFactors f = Factors(37, 23, 5, 1);
    absl::StatusOr<LowRankEncoding> enc = EncodeLowRankFactors(f, 100, codec, 16, kMaxChunkBytes);
    ASSERT_THAT(enc.status(), IsOk());
    ASSERT_EQ(enc->chunks.size(), 1u);
    EXPECT_EQ(enc->chunks[0].offset, 100u);
    if (codec == v1::CODEC_FP32) {
      EXPECT_TRUE(SameBits(enc->decoded.p, f.p));
      EXPECT_TRUE(SameBits(enc->decoded.q, f.q));
      // Header, then (rows + cols) * rank floats.
      EXPECT_EQ(enc->chunks[0].payload.size(), kLowRankHeaderBytes + (37 + 23) * 5 * 4);
    } else {
      EXPECT_FALSE(SameBits(enc->decoded.p, f.p));
    }
    absl::StatusOr<size_t> count = EncodedElementCount(v1::CODEC_LOWRANK, enc->chunks[0].payload);
    ASSERT_THAT(count.status(), IsOk());
    EXPECT_EQ(*count, 37u * 23u);
    std::vector<float> expected(37 * 23);
    ASSERT_THAT(DecompressLowRank(enc->decoded, absl::MakeSpan(expected)), IsOk());
    std::vector<float> out(37 * 23, 5.0f);
    ASSERT_THAT(DecodeChunk(v1::CODEC_LOWRANK, enc->chunks[0].payload, absl::MakeSpan(out)),
                IsOk());
    EXPECT_TRUE(SameBits(out, expected));
  }
}

TEST(LowRankWireTest, RowSplitChunksDecodeToTheSameBitsAsOne) {
  for (const v1::Codec codec :
       {v1::CODEC_FP32, v1::CODEC_BF16, v1::CODEC_INT8_BLOCKWISE, v1::CODEC_INT4_BLOCKWISE}) {
    SCOPED_TRACE(v1::Codec_Name(codec));
    const LowRankFactors f = Factors(50, 20, 4, 2);
    absl::StatusOr<LowRankEncoding> one = EncodeLowRankFactors(f, 0, codec, 8, kMaxChunkBytes);
    ASSERT_THAT(one.status(), IsOk());
    ASSERT_EQ(one->chunks.size(), 1u);
    // Room for the header, Q and a quarter of P per chunk.
    uint32_t q_bytes;
    std::memcpy(&q_bytes, one->chunks[0].payload.data() + 36, 4);
    const size_t p_bytes = one->chunks[0].payload.size() - kLowRankHeaderBytes - q_bytes;
    const size_t limit = kLowRankHeaderBytes + q_bytes + p_bytes / 4;
    absl::StatusOr<LowRankEncoding> split = EncodeLowRankFactors(f, 0, codec, 8, limit);
    ASSERT_THAT(split.status(), IsOk());
    ASSERT_GT(split->chunks.size(), 3u);
    std::vector<float> whole(50 * 20);
    ASSERT_THAT(DecodeChunk(v1::CODEC_LOWRANK, one->chunks[0].payload, absl::MakeSpan(whole)),
                IsOk());
    std::vector<float> pieces(50 * 20, 9.0f);
    uint64_t next = 0;
    for (const LowRankChunk& chunk : split->chunks) {
      EXPECT_LE(chunk.payload.size(), limit);
      EXPECT_EQ(chunk.offset, next);
      absl::StatusOr<size_t> n = EncodedElementCount(v1::CODEC_LOWRANK, chunk.payload);
      ASSERT_THAT(n.status(), IsOk());
      EXPECT_EQ(*n % 20, 0u);
      ASSERT_THAT(DecodeChunk(v1::CODEC_LOWRANK, chunk.payload,
                              absl::MakeSpan(pieces).subspan(chunk.offset, *n)),
                  IsOk());
      next += *n;
    }
    EXPECT_EQ(next, 50u * 20u);
    // The chunks decode to the decode of the factors as they were quantised, whatever the split.
    std::vector<float> expected(50 * 20);
    ASSERT_THAT(DecompressLowRank(split->decoded, absl::MakeSpan(expected)), IsOk());
    EXPECT_TRUE(SameBits(pieces, expected));
    // FP32 and BF16 quantise each value alone: split or not, the same factors and bits. The
    // blockwise codecs quantise P per chunk (a block's scale depends on its neighbours).
    if (codec == v1::CODEC_FP32 || codec == v1::CODEC_BF16) {
      EXPECT_TRUE(SameBits(split->decoded.p, one->decoded.p));
      EXPECT_TRUE(SameBits(pieces, whole));
    }
  }
}

TEST(LowRankWireTest, QThatDoesNotFitAChunkIsRefusedNamingTheRankAndLimit) {
  const LowRankFactors f = Factors(40, 300, 8, 3);
  // Q alone: 300 * 8 * 4 = 9600 bytes.
  EXPECT_THAT(
      EncodeLowRankFactors(f, 0, v1::CODEC_FP32, 0, 9000),
      StatusIs(kInvalid, ::testing::AllOf(HasSubstr("rank 8"), HasSubstr("chunk limit of 9000"))));
  EXPECT_THAT(EncodeLowRankFactors(f, 0, v1::CODEC_LOWRANK, 0, kMaxChunkBytes),
              StatusIs(kInvalid, HasSubstr("cannot encode factors")));
  std::string out;
  EXPECT_THAT(EncodeChunk(v1::CODEC_LOWRANK, f.p, 0, &out, nullptr),
              StatusIs(kInvalid, HasSubstr("whole 2-D tensor")));
}

// LowRankMaxChunkRank is the encoder's own limit: at that rank every factor codec encodes in
// chunks of the limit, one rank more is refused; LowRankMinChunkBytes is the smallest chunk.
TEST(LowRankWireTest, MaxChunkRankIsTheLargestRankTheEncoderAccepts) {
  constexpr uint32_t kRows = 200, kCols = 300;
  constexpr size_t kLimit = 20000;
  const v1::Codec codecs[] = {v1::CODEC_FP32, v1::CODEC_BF16, v1::CODEC_INT8_BLOCKWISE,
                              v1::CODEC_INT4_BLOCKWISE};
  const size_t blocks[] = {0, 0, 256, 64};
  // FP32: 40 + 300 r 4 + 4 r <= 20000 for r <= 16.
  const uint32_t expected[] = {16, 33, 65, 117};
  for (int c = 0; c < 4; ++c) {
    SCOPED_TRACE(v1::Codec_Name(codecs[c]));
    const uint32_t rank = LowRankMaxChunkRank(kCols, codecs[c], blocks[c], kLimit);
    EXPECT_EQ(rank, expected[c]);
    EXPECT_LE(LowRankMinChunkBytes(kCols, rank, codecs[c], blocks[c]), kLimit);
    EXPECT_GT(LowRankMinChunkBytes(kCols, rank + 1, codecs[c], blocks[c]), kLimit);
    for (uint32_t r : {rank, rank + 1}) {
      absl::StatusOr<LowRankEncoding> enc =
          EncodeLowRankFactors(Factors(kRows, kCols, r, 5), 0, codecs[c], blocks[c], kLimit);
      if (r == rank) {
        ASSERT_THAT(enc.status(), IsOk());
        size_t smallest = kLimit;
        for (const LowRankChunk& chunk : enc->chunks) {
          EXPECT_LE(chunk.payload.size(), kLimit);
          smallest = std::min(smallest, chunk.payload.size());
        }
        EXPECT_GE(smallest, LowRankMinChunkBytes(kCols, rank, codecs[c], blocks[c]));
      } else {
        EXPECT_THAT(enc.status(), StatusIs(kInvalid, HasSubstr("chunk limit of 20000")));
      }
    }
  }
  EXPECT_EQ(LowRankMaxChunkRank(kCols, v1::CODEC_FP32, 0, 100), 0u);
}

// The rank each tensor is compressed at: clamped to the matrix, 0 when the factors would not be
// smaller than the tensor or the tensor is 1-D.
TEST(LowRankWireTest, TensorRankClampsAndSkipsTensorsTheFactorsWouldNotShrink) {
  v1::TensorSpec t;
  t.add_shape(100);
  EXPECT_EQ(LowRankTensorRank(t, 8), 0u);
  t.add_shape(30);
  EXPECT_EQ(LowRankTensorRank(t, 8), 8u);
  // (100 + 30) * 23 = 2990 < 3000; at 24, 3120 is not smaller.
  EXPECT_EQ(LowRankTensorRank(t, 23), 23u);
  EXPECT_EQ(LowRankTensorRank(t, 24), 0u);
  v1::TensorSpec wide;
  wide.add_shape(2);
  wide.add_shape(1000);
  EXPECT_EQ(LowRankTensorRank(wide, 64), 0u);  // clamped to 2: (2 + 1000) * 2 > 2000
}

// A valid FP32 chunk of a 12 x 10 matrix at rank 3, rows [0, 12), and what it decodes to.
struct Sample {
  std::string payload;
  size_t q_at = kLowRankHeaderBytes;
  size_t p_at = kLowRankHeaderBytes + 10 * 3 * 4;
};

Sample MakeSample() {
  const LowRankFactors f = Factors(12, 10, 3, 4);
  absl::StatusOr<LowRankEncoding> enc =
      EncodeLowRankFactors(f, 0, v1::CODEC_FP32, 0, kMaxChunkBytes);
  EXPECT_THAT(enc.status(), IsOk());
  return Sample{enc->chunks[0].payload};
}

TEST(LowRankWireTest, HostileChunksAreRefusedNamingTheProblemWithNothingWritten) {
  const Sample good = MakeSample();
  struct Case {
    std::string name;
    std::string payload;
    size_t out_size;
    std::string expected;
  };
  std::vector<Case> cases;
  auto with = [&](const std::string& name, auto patch, size_t out_size,
                  const std::string& expected) {
    std::string p = good.payload;
    patch(&p);
    cases.push_back({name, p, out_size, expected});
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  with(
      "short header", [](std::string* p) { p->resize(kLowRankHeaderBytes - 1); }, 120, "truncated");
  with(
      "magic", [](std::string* p) { Patch<uint32_t>(p, 0, 0x12345678); }, 120, "bad magic");
  with(
      "version", [](std::string* p) { Patch<uint16_t>(p, 4, 2); }, 120, "version 2");
  with(
      "factor codec", [](std::string* p) { Patch<uint16_t>(p, 6, v1::CODEC_LOWRANK); }, 120,
      "cannot encode factors");
  with(
      "rank 0", [](std::string* p) { Patch<uint32_t>(p, 24, 0); }, 120, "wrong rank 0");
  with(
      "rank above min(rows, cols)", [](std::string* p) { Patch<uint32_t>(p, 24, 11); }, 120,
      "wrong rank 11 for a 12 x 10 matrix");
  with(
      "rank that does not match the factors", [](std::string* p) { Patch<uint32_t>(p, 24, 2); },
      120, "factor Q holds 30 values, the header's shape cols x rank needs 20");
  with(
      "cols that do not match Q", [](std::string* p) { Patch<uint32_t>(p, 20, 9); }, 108,
      "factor Q holds 30 values");
  with(
      "rows end past the matrix", [](std::string* p) { Patch<uint32_t>(p, 32, 13); }, 130,
      "rows [0, 13)");
  with(
      "empty rows", [](std::string* p) { Patch<uint32_t>(p, 28, 12); }, 0, "rows [12, 12)");
  with(
      "P rows that do not match the header", [](std::string* p) { Patch<uint32_t>(p, 32, 11); },
      110, "factor P holds 36 values, the header's shape (b - a) x rank needs 33");
  with(
      "Q beyond the payload", [](std::string* p) { Patch<uint32_t>(p, 36, 100000); }, 120,
      "truncated: Q of 100000 bytes");
  with(
      "truncated P", [](std::string* p) { p->resize(p->size() - 4); }, 120, "factor P");
  with(
      "truncated P, partial float", [](std::string* p) { p->resize(p->size() - 1); }, 120,
      "factor P");
  with(
      "NaN in Q", [&](std::string* p) { Patch<float>(p, good.q_at + 8, nan); }, 120,
      "factor Q: non-finite");
  with(
      "Inf in P", [&](std::string* p) { Patch<float>(p, good.p_at + 4, inf); }, 120,
      "factor P: non-finite");
  with(
      "output of another size", [](std::string*) {}, 119, "expected 119");
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<float> out(c.out_size, 7.0f);
    EXPECT_THAT(DecodeChunk(v1::CODEC_LOWRANK, c.payload, absl::MakeSpan(out)),
                StatusIs(kInvalid, HasSubstr(c.expected)));
    for (float v : out) ASSERT_EQ(v, 7.0f);
  }
  std::vector<float> out(120);
  EXPECT_THAT(DecodeChunk(v1::CODEC_LOWRANK, good.payload, absl::MakeSpan(out)), IsOk());
}

TEST(LowRankWireTest, TheChunkMustMatchTheSpecTensorAtItsOffset) {
  v1::LayerSpec layer;
  layer.set_name("blocks.0");
  v1::TensorSpec* bias = layer.add_tensors();
  bias->set_name("bias");
  bias->add_shape(8);
  v1::TensorSpec* weight = layer.add_tensors();
  weight->set_name("weight");
  weight->add_shape(12);
  weight->add_shape(10);
  layer.set_num_elements(8 + 120);
  const LowRankFactors f = Factors(12, 10, 3, 5);
  absl::StatusOr<LowRankEncoding> enc =
      EncodeLowRankFactors(f, 8, v1::CODEC_FP32, 0, kLowRankHeaderBytes + 10 * 3 * 4 + 3 * 4 * 2);
  ASSERT_THAT(enc.status(), IsOk());
  ASSERT_EQ(enc->chunks.size(), 6u);  // two rows of P per chunk
  EXPECT_THAT(CheckLowRankChunkInLayer(layer, 8, enc->chunks[0].payload), IsOk());
  EXPECT_THAT(CheckLowRankChunkInLayer(layer, 8 + 20, enc->chunks[1].payload), IsOk());
  EXPECT_THAT(CheckLowRankChunkInLayer(layer, 8, enc->chunks[1].payload),
              StatusIs(kInvalid, HasSubstr("which begin at element 28")));
  std::string moved = enc->chunks[0].payload;
  Patch<uint64_t>(&moved, 8, 0);  // the bias
  EXPECT_THAT(CheckLowRankChunkInLayer(layer, 0, moved),
              StatusIs(kInvalid, HasSubstr("tensor at offset 0 (bias) is not a 12 x 10 matrix")));
  Patch<uint64_t>(&moved, 8, 4);
  EXPECT_THAT(CheckLowRankChunkInLayer(layer, 4, moved),
              StatusIs(kInvalid, HasSubstr("no tensor of the layer begins at offset 4")));
  std::string reshaped = enc->chunks[0].payload;
  Patch<uint32_t>(&reshaped, 16, 24);  // rows
  EXPECT_THAT(CheckLowRankChunkInLayer(layer, 8, reshaped),
              StatusIs(kInvalid, HasSubstr("is not a 24 x 10 matrix")));
}

TEST(LowRankWireTest, MatrixShapeFlattensTrailingDimensions) {
  v1::TensorSpec t;
  t.add_shape(7);
  EXPECT_FALSE(LowRankMatrixShape(t).has_value());
  t.add_shape(3);
  t.add_shape(5);
  EXPECT_EQ(LowRankMatrixShape(t), std::make_pair(7u, 15u));
  EXPECT_EQ(LowRankFallbackCodec(v1::CODEC_BF16), v1::CODEC_BF16);
  EXPECT_EQ(LowRankFallbackCodec(v1::CODEC_INT8_BLOCKWISE), v1::CODEC_FP32);
  EXPECT_EQ(LowRankFallbackCodec(v1::CODEC_INT4_BLOCKWISE), v1::CODEC_FP32);
}

}  // namespace
}  // namespace aloe
