#include "kernels/cpu/codec_kernels.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/status_matchers.h"
#include "kernels/cpu/low_rank_kernels.h"
#include "kernels/cpu/outer_kernels.h"

#ifdef ALOE_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/codec_kernels_cuda.h"
#include "kernels/cuda/low_rank_kernels_cuda.h"
#include "kernels/cuda/outer_kernels_cuda.h"
#endif

namespace aloe::kernels {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

using Bytes = std::vector<uint8_t>;

constexpr float kFloatMax = std::numeric_limits<float>::max();
constexpr float kFloatMin = std::numeric_limits<float>::min();  // 2^-126
const double kBf16RelBound = std::ldexp(1.0, -8);
const double kBf16SubnormalAbsBound = std::ldexp(1.0, -134);
// int8: |x' - x| <= m / 254 * (1 + 2^-12) + 2^-149 (codec_kernels.h).
const double kInt8Slack = 1.0 + std::ldexp(1.0, -12);
const double kInt8AbsFloor = std::ldexp(1.0, -149);
// int4: |x' - x| <= m / 14 * (1 + 2^-16) + 2^-149 (codec_kernels.h).
const double kInt4Slack = 1.0 + std::ldexp(1.0, -16);
const double kInt4AbsFloor = std::ldexp(1.0, -149);

uint32_t Bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}

float FromBits(uint32_t b) {
  float v;
  std::memcpy(&v, &b, sizeof(v));
  return v;
}

// Fixed seeds: every test sees the same data on every run.
std::vector<float> Normal(size_t n, unsigned seed, float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Cauchy: most values O(1), a few up to ~1e6, so many blocks are dominated by one outlier.
std::vector<float> HeavyTailed(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::cauchy_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) {
    x = dist(rng);
    if (!std::isfinite(x)) x = 0.0f;
  }
  return v;
}

// Magnitudes over the whole float range, changing every 37 values (not aligned with blocks):
// subnormals, near-FLT_MAX values, runs of exact zeros and of -0.
std::vector<float> WideRange(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-150, 127);
  std::vector<float> v(n);
  int e = 0;
  for (size_t i = 0; i < n; ++i) {
    if (i % 37 == 0) e = exponent(rng);
    const float x = std::ldexp(std::clamp(normal(rng), -1.9f, 1.9f), e);
    if (e == -150) {
      v[i] = 0.0f;
    } else if (e == -149) {
      v[i] = -0.0f;
    } else {
      v[i] = std::isfinite(x) ? x : kFloatMax;
    }
  }
  return v;
}

// Bit-level equality of float arrays (distinguishes 0 from -0).
void ExpectSameBits(const std::vector<float>& actual, const std::vector<float>& expected,
                    const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    ASSERT_EQ(Bits(actual[i]), Bits(expected[i]))
        << what << " at " << i << ": " << actual[i] << " vs " << expected[i];
  }
}

// Per-element bf16 bound, computed in double.
void ExpectBf16WithinBound(const std::vector<float>& x, const std::vector<float>& decoded) {
  ASSERT_EQ(x.size(), decoded.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double err = std::fabs(static_cast<double>(decoded[i]) - static_cast<double>(x[i]));
    const double bound = std::fabs(x[i]) >= kFloatMin
                             ? kBf16RelBound * std::fabs(static_cast<double>(x[i]))
                             : kBf16SubnormalAbsBound;
    ASSERT_LE(err, bound) << "x[" << i << "] = " << x[i] << " decoded " << decoded[i];
  }
}

// The int8 and int4 blockwise codecs behind one interface, for the tests they share.
struct BlockwiseCodec {
  const char* name;
  double max_level;  // 127 or 7: the round-trip bound is m / (2 max_level) * slack + 2^-149
  double slack;
  size_t (*encoded_size)(size_t n, size_t block_size);
  absl::StatusOr<BlockwiseEncodedInfo> (*inspect)(const void* in, size_t in_bytes);
  absl::Status (*encode)(const float* x, size_t n, size_t block_size, void* out, float* residual);
  absl::Status (*ref_encode)(const float* x, size_t n, size_t block_size, void* out,
                             float* residual);
  absl::Status (*decode)(const void* in, size_t in_bytes, float* out, size_t n);
  absl::Status (*ref_decode)(const void* in, size_t in_bytes, float* out, size_t n);
  absl::Status (*decode_accumulate)(const void* in, size_t in_bytes, float w, float* acc, size_t n);
  absl::Status (*ref_decode_accumulate)(const void* in, size_t in_bytes, float w, float* acc,
                                        size_t n);
};

const BlockwiseCodec kInt8 = {"Int8",
                              127.0,
                              kInt8Slack,
                              Int8EncodedSize,
                              Int8BlockwiseInspect,
                              Int8BlockwiseEncode,
                              reference::Int8BlockwiseEncode,
                              Int8BlockwiseDecode,
                              reference::Int8BlockwiseDecode,
                              Int8BlockwiseDecodeAccumulate,
                              reference::Int8BlockwiseDecodeAccumulate};

const BlockwiseCodec kInt4 = {"Int4",
                              7.0,
                              kInt4Slack,
                              Int4EncodedSize,
                              Int4BlockwiseInspect,
                              Int4BlockwiseEncode,
                              reference::Int4BlockwiseEncode,
                              Int4BlockwiseDecode,
                              reference::Int4BlockwiseDecode,
                              Int4BlockwiseDecodeAccumulate,
                              reference::Int4BlockwiseDecodeAccumulate};

// Per-element bound of `codec`, with m = max |x| over the element's block computed here in
// double. Returns the largest err / half-step (m / (2 max_level)) seen, so tests can also check
// that the bound is tight.
double ExpectWithinBound(const BlockwiseCodec& codec, const std::vector<float>& x,
                         const std::vector<float>& decoded, size_t block_size) {
  EXPECT_EQ(x.size(), decoded.size());
  double worst = 0.0;
  for (size_t begin = 0; begin < x.size(); begin += block_size) {
    const size_t end = std::min(x.size(), begin + block_size);
    double m = 0.0;
    for (size_t i = begin; i < end; ++i) m = std::max(m, std::fabs(static_cast<double>(x[i])));
    const double half_step = m / (2.0 * codec.max_level);
    const double bound = half_step * codec.slack + std::ldexp(1.0, -149);
    for (size_t i = begin; i < end; ++i) {
      const double err = std::fabs(static_cast<double>(decoded[i]) - static_cast<double>(x[i]));
      EXPECT_LE(err, bound) << codec.name << " x[" << i << "] = " << x[i] << " decoded "
                            << decoded[i] << " block max " << m;
      if (err > bound) return worst;
      if (m > 0) worst = std::max(worst, err / half_step);
    }
  }
  return worst;
}

std::vector<float> RoundTrip(const BlockwiseCodec& codec, const std::vector<float>& x,
                             size_t block_size) {
  Bytes enc(codec.encoded_size(x.size(), block_size));
  std::vector<float> out(x.size());
  EXPECT_THAT(codec.encode(x.data(), x.size(), block_size, enc.data(), nullptr), IsOk());
  EXPECT_THAT(codec.decode(enc.data(), enc.size(), out.data(), out.size()), IsOk());
  return out;
}

// Encodes and decodes x with both the fused kernels and the references and checks everything
// they promise: the same bytes and floats bit for bit, with or without a residual and in place;
// the header read back; finite decoded values; residual == x - decode exactly; the round-trip
// bound. Returns the decoded values.
std::vector<float> CheckedRoundTrip(const BlockwiseCodec& codec, const std::vector<float>& x,
                                    size_t b) {
  const size_t n = x.size();
  Bytes enc(codec.encoded_size(n, b), 0xAA);
  Bytes ref_enc(codec.encoded_size(n, b), 0x55);
  std::vector<float> residual(n, 99.0f);
  std::vector<float> ref_residual(n, -99.0f);
  std::vector<float> out(n, 7.0f);
  EXPECT_THAT(codec.encode(x.data(), n, b, enc.data(), residual.data()), IsOk());
  EXPECT_THAT(codec.ref_encode(x.data(), n, b, ref_enc.data(), ref_residual.data()), IsOk());
  EXPECT_EQ(enc, ref_enc);
  ExpectSameBits(residual, ref_residual, "residual");

  Bytes enc_no_residual(codec.encoded_size(n, b));
  EXPECT_THAT(codec.encode(x.data(), n, b, enc_no_residual.data(), nullptr), IsOk());
  EXPECT_EQ(enc_no_residual, enc);

  absl::StatusOr<BlockwiseEncodedInfo> info = codec.inspect(enc.data(), enc.size());
  EXPECT_THAT(info, IsOk());
  if (!info.ok()) return out;
  EXPECT_EQ(info->n, n);
  EXPECT_EQ(info->block_size, b);

  std::vector<float> ref_out(n, -7.0f);
  EXPECT_THAT(codec.decode(enc.data(), enc.size(), out.data(), n), IsOk());
  EXPECT_THAT(codec.ref_decode(enc.data(), enc.size(), ref_out.data(), n), IsOk());
  ExpectSameBits(out, ref_out, "decode");
  for (size_t i = 0; i < n; ++i) {
    EXPECT_TRUE(std::isfinite(out[i])) << i;  // FLT_MAX blocks do not overflow on decode
    EXPECT_EQ(Bits(residual[i]), Bits(x[i] - out[i])) << i;
    if (!std::isfinite(out[i]) || Bits(residual[i]) != Bits(x[i] - out[i])) return out;
  }
  std::vector<float> in_place = x;
  Bytes enc_in_place(codec.encoded_size(n, b));
  EXPECT_THAT(codec.encode(in_place.data(), n, b, enc_in_place.data(), in_place.data()), IsOk());
  EXPECT_EQ(enc_in_place, enc);
  ExpectSameBits(in_place, residual, "in-place residual");

  ExpectWithinBound(codec, x, out, b);
  return out;
}

std::vector<float> Bf16RoundTrip(const std::vector<float>& x) {
  Bytes enc(Bf16EncodedSize(x.size()));
  std::vector<float> out(x.size());
  EXPECT_THAT(Bf16Encode(x.data(), x.size(), enc.data(), nullptr), IsOk());
  EXPECT_THAT(Bf16Decode(enc.data(), enc.size(), out.data(), out.size()), IsOk());
  return out;
}

// ---- bf16 -----------------------------------------------------------------------------------

class Bf16SizeTest : public ::testing::TestWithParam<size_t> {};

TEST_P(Bf16SizeTest, FusedMatchesReferenceBitExact) {
  const size_t n = GetParam();
  const std::vector<float> x = WideRange(n, 11 + static_cast<unsigned>(n));
  Bytes enc(Bf16EncodedSize(n), 0xAA);
  Bytes ref_enc(Bf16EncodedSize(n), 0x55);
  std::vector<float> residual(n, 99.0f);
  std::vector<float> ref_residual(n, -99.0f);
  ASSERT_THAT(Bf16Encode(x.data(), n, enc.data(), residual.data()), IsOk());
  ASSERT_THAT(reference::Bf16Encode(x.data(), n, ref_enc.data(), ref_residual.data()), IsOk());
  EXPECT_EQ(enc, ref_enc);
  ExpectSameBits(residual, ref_residual, "residual");

  Bytes enc_no_residual(Bf16EncodedSize(n));
  ASSERT_THAT(Bf16Encode(x.data(), n, enc_no_residual.data(), nullptr), IsOk());
  EXPECT_EQ(enc_no_residual, enc);

  std::vector<float> out(n, 7.0f);
  std::vector<float> ref_out(n, -7.0f);
  ASSERT_THAT(Bf16Decode(enc.data(), enc.size(), out.data(), n), IsOk());
  ASSERT_THAT(reference::Bf16Decode(enc.data(), enc.size(), ref_out.data(), n), IsOk());
  ExpectSameBits(out, ref_out, "decode");

  // Error feedback: residual is exactly x - decode(encode(x)).
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(Bits(residual[i]), Bits(x[i] - out[i])) << i;

  // In place: x becomes its own residual.
  std::vector<float> in_place = x;
  Bytes enc_in_place(Bf16EncodedSize(n));
  ASSERT_THAT(Bf16Encode(in_place.data(), n, enc_in_place.data(), in_place.data()), IsOk());
  EXPECT_EQ(enc_in_place, enc);
  ExpectSameBits(in_place, residual, "in-place residual");
}

TEST_P(Bf16SizeTest, DecodeAccumulateEqualsDecodeThenWeightedAccumulate) {
  const size_t n = GetParam();
  const std::vector<float> x = Normal(n, 21 + static_cast<unsigned>(n));
  const std::vector<float> acc0 = Normal(n, 22 + static_cast<unsigned>(n));
  Bytes enc(Bf16EncodedSize(n));
  ASSERT_THAT(Bf16Encode(x.data(), n, enc.data(), nullptr), IsOk());
  std::vector<float> decoded(n);
  ASSERT_THAT(Bf16Decode(enc.data(), enc.size(), decoded.data(), n), IsOk());
  std::vector<float> expected = acc0;
  reference::WeightedAccumulate(decoded.data(), 0.37f, expected.data(), n);

  std::vector<float> acc = acc0;
  ASSERT_THAT(Bf16DecodeAccumulate(enc.data(), enc.size(), 0.37f, acc.data(), n), IsOk());
  ExpectSameBits(acc, expected, "fused");
  std::vector<float> ref_acc = acc0;
  ASSERT_THAT(reference::Bf16DecodeAccumulate(enc.data(), enc.size(), 0.37f, ref_acc.data(), n),
              IsOk());
  ExpectSameBits(ref_acc, expected, "reference");
}

// Sizes around the 2048-value tile of the fused loops.
INSTANTIATE_TEST_SUITE_P(Sizes, Bf16SizeTest, ::testing::Values(0, 1, 7, 2047, 2048, 2049, 100003));

TEST(Bf16CodecTest, RoundTripWithinRelativeBound) {
  ExpectBf16WithinBound(Normal(100000, 1), Bf16RoundTrip(Normal(100000, 1)));
  ExpectBf16WithinBound(HeavyTailed(100000, 2), Bf16RoundTrip(HeavyTailed(100000, 2)));
  ExpectBf16WithinBound(WideRange(100000, 3), Bf16RoundTrip(WideRange(100000, 3)));
  // Saturation at the top of the range stays within the relative bound.
  const std::vector<float> extremes = {kFloatMax, -kFloatMax, FromBits(0x7f7f8000u),
                                       FromBits(0x7f7f7fffu), FromBits(0xff7fc000u)};
  ExpectBf16WithinBound(extremes, Bf16RoundTrip(extremes));
}

TEST(Bf16CodecTest, RoundsToNearestEvenOnHandPickedBits) {
  struct Case {
    uint32_t in;
    uint16_t out;
  };
  const Case cases[] = {
      {0x3f800000u, 0x3f80u},  // 1.0: exact
      {0x3f807fffu, 0x3f80u},  // just below the halfway point: down
      {0x3f808000u, 0x3f80u},  // tie, 0x3f80 even: down
      {0x3f808001u, 0x3f81u},  // just above the halfway point: up
      {0x3f818000u, 0x3f82u},  // tie, 0x3f81 odd: up to even
      {0xbf808000u, 0xbf80u},  // negative tie to even: magnitude down
      {0xbf818000u, 0xbf82u},  // negative tie to even: magnitude up
      {0x3f7fffffu, 0x3f80u},  // largest float below 1: carries into the exponent
      {0x00000000u, 0x0000u},  // +0
      {0x80000000u, 0x8000u},  // -0 keeps its sign
      {0x00000001u, 0x0000u},  // smallest subnormal: rounds to 0
      {0x00008000u, 0x0000u},  // subnormal tie to even (0)
      {0x00018000u, 0x0002u},  // subnormal tie to even (up)
      {0x007fffffu, 0x0080u},  // largest subnormal: rounds up to FLT_MIN
      {0x7f7f7fffu, 0x7f7fu},  // just below the overflow point
      {0x7f7f8000u, 0x7f7fu},  // would round to Inf: saturates
      {0x7f7fffffu, 0x7f7fu},  // FLT_MAX saturates
      {0xff7fffffu, 0xff7fu},  // -FLT_MAX saturates to the most negative finite bf16
  };
  for (const Case& c : cases) {
    const float x = FromBits(c.in);
    for (const bool fused : {true, false}) {
      uint8_t enc[2] = {0, 0};
      float residual = 0.0f;
      const absl::Status s =
          fused ? Bf16Encode(&x, 1, enc, &residual) : reference::Bf16Encode(&x, 1, enc, &residual);
      ASSERT_THAT(s, IsOk());
      const uint16_t got = static_cast<uint16_t>(enc[0] | (enc[1] << 8));  // little-endian
      EXPECT_EQ(got, c.out) << std::hex << "in 0x" << c.in << " got 0x" << got
                            << (fused ? " (fused)" : " (reference)");
      const float decoded = FromBits(static_cast<uint32_t>(c.out) << 16);
      EXPECT_EQ(Bits(residual), Bits(x - decoded)) << std::hex << "in 0x" << c.in;
    }
  }
}

TEST(Bf16CodecTest, EncodeRejectsNonFiniteNamingTheFirstIndex) {
  struct Case {
    size_t index;
    float value;
    const char* text;
  };
  const Case cases[] = {
      {5, std::numeric_limits<float>::quiet_NaN(), "x[5] is NaN"},
      {0, std::numeric_limits<float>::infinity(), "x[0] is +Inf"},
      {3000, -std::numeric_limits<float>::infinity(), "x[3000] is -Inf"},  // second tile
  };
  for (const Case& c : cases) {
    std::vector<float> x = Normal(4096, 7);
    x[c.index] = c.value;
    x[4000] = std::numeric_limits<float>::quiet_NaN();  // a later bad value is not reported
    Bytes enc(Bf16EncodedSize(x.size()));
    EXPECT_THAT(Bf16Encode(x.data(), x.size(), enc.data(), nullptr),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.text)));
    EXPECT_THAT(reference::Bf16Encode(x.data(), x.size(), enc.data(), nullptr),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.text)));
  }
}

TEST(Bf16CodecTest, DecodeRejectsWrongLengthAndNonFiniteValues) {
  const std::vector<float> x = Normal(3000, 8);
  Bytes enc(Bf16EncodedSize(x.size()));
  ASSERT_THAT(Bf16Encode(x.data(), x.size(), enc.data(), nullptr), IsOk());
  std::vector<float> out(x.size());
  for (const size_t bytes : {enc.size() - 1, enc.size() - 2, enc.size() + 2, size_t{0}}) {
    Bytes wrong = enc;
    wrong.resize(bytes);
    EXPECT_THAT(Bf16Decode(wrong.data(), wrong.size(), out.data(), out.size()),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected 6000 bytes")));
    EXPECT_THAT(reference::Bf16Decode(wrong.data(), wrong.size(), out.data(), out.size()),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected 6000 bytes")));
  }

  struct Case {
    size_t index;
    uint16_t bits;
    const char* text;
  };
  const Case cases[] = {
      {2, 0x7f80u, "encoded value 2 is +Inf"},
      {2100, 0xff80u, "encoded value 2100 is -Inf"},
      {2999, 0xffc1u, "encoded value 2999 is NaN"},
  };
  for (const Case& c : cases) {
    Bytes bad = enc;
    bad[2 * c.index] = static_cast<uint8_t>(c.bits & 0xff);
    bad[2 * c.index + 1] = static_cast<uint8_t>(c.bits >> 8);
    EXPECT_THAT(Bf16Decode(bad.data(), bad.size(), out.data(), out.size()),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.text)));
    EXPECT_THAT(reference::Bf16Decode(bad.data(), bad.size(), out.data(), out.size()),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.text)));

    // The accumulator is untouched on error, even though the bad value comes late.
    const std::vector<float> acc0 = Normal(x.size(), 9);
    std::vector<float> acc = acc0;
    EXPECT_THAT(Bf16DecodeAccumulate(bad.data(), bad.size(), 0.5f, acc.data(), acc.size()),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.text)));
    ExpectSameBits(acc, acc0, "acc after failed fused decode-accumulate");
    EXPECT_THAT(
        reference::Bf16DecodeAccumulate(bad.data(), bad.size(), 0.5f, acc.data(), acc.size()),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.text)));
    ExpectSameBits(acc, acc0, "acc after failed reference decode-accumulate");
  }
}

// ---- int8 blockwise -------------------------------------------------------------------------

enum class SizeKind { kZero, kOne, kBlockMinusOne, kBlock, kBlockPlusOne, kLarge };

size_t SizeOf(SizeKind kind, size_t block_size) {
  switch (kind) {
    case SizeKind::kZero:
      return 0;
    case SizeKind::kOne:
      return 1;
    case SizeKind::kBlockMinusOne:
      return block_size - 1;
    case SizeKind::kBlock:
      return block_size;
    case SizeKind::kBlockPlusOne:
      return block_size + 1;
    case SizeKind::kLarge:
      return std::max<size_t>(100003, 5 * block_size + 3);
  }
  return 0;
}

std::string SizeKindName(SizeKind kind) {
  static const char* const kKinds[] = {"Zero",  "One",          "BlockMinusOne",
                                       "Block", "BlockPlusOne", "Large"};
  return kKinds[static_cast<int>(kind)];
}

std::string Int8ParamName(const ::testing::TestParamInfo<std::tuple<size_t, SizeKind>>& info) {
  return "B" + std::to_string(std::get<0>(info.param)) + "_" +
         SizeKindName(std::get<1>(info.param));
}

// Values that stress the vectorised blockwise paths against the scalar ones: exact zeros and -0,
// ties half an int4 level apart, subnormals, +-FLT_MAX and runs shorter and longer than one
// SIMD step.
std::vector<float> EdgeValues(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    switch ((i / 29) % 7) {
      case 0:
        v[i] = i % 3 == 0 ? -0.0f : 0.0f;
        break;
      case 1:  // ties: (k + 0.5) steps with the block max 7 (int4 scale 1)
        v[i] = i % 29 == 0 ? 7.0f : static_cast<float>(static_cast<int>(i % 15) - 7) + 0.5f;
        break;
      case 2:
        v[i] = std::ldexp(static_cast<float>(i % 5) - 2.0f, -140 - static_cast<int>(i % 9));
        break;
      case 3:
        v[i] = i % 2 == 0 ? kFloatMax : -kFloatMax / static_cast<float>(1 + i % 13);
        break;
      case 4:
        v[i] = kFloatMin * static_cast<float>(static_cast<int>(i % 11) - 5);
        break;
      default:
        v[i] = std::sin(static_cast<float>(i)) * 1e-3f;
        break;
    }
  }
  return v;
}

using BlockwiseParam = std::tuple<const BlockwiseCodec*, size_t, SizeKind>;

std::string BlockwiseParamName(const ::testing::TestParamInfo<BlockwiseParam>& info) {
  return std::string(std::get<0>(info.param)->name) + "_B" +
         std::to_string(std::get<1>(info.param)) + "_" + SizeKindName(std::get<2>(info.param));
}

class BlockwiseSizeTest : public ::testing::TestWithParam<BlockwiseParam> {
 protected:
  const BlockwiseCodec& Codec() const { return *std::get<0>(GetParam()); }
  size_t BlockSize() const { return std::get<1>(GetParam()); }
  size_t Count() const { return SizeOf(std::get<2>(GetParam()), BlockSize()); }
};

TEST_P(BlockwiseSizeTest, FusedMatchesReferenceBitExact) {
  const size_t n = Count();
  const size_t b = BlockSize();
  for (const unsigned data : {1u, 2u, 3u, 4u}) {
    const std::vector<float> x = data == 1   ? Normal(n, 31 + static_cast<unsigned>(n))
                                 : data == 2 ? HeavyTailed(n, 32 + static_cast<unsigned>(n))
                                 : data == 3 ? WideRange(n, 33 + static_cast<unsigned>(n))
                                             : EdgeValues(n);
    SCOPED_TRACE(::testing::Message() << "n=" << n << " B=" << b << " data " << data);
    CheckedRoundTrip(Codec(), x, b);
    if (HasFailure()) return;
  }
}

TEST_P(BlockwiseSizeTest, DecodeAccumulateEqualsDecodeThenWeightedAccumulate) {
  const BlockwiseCodec& codec = Codec();
  const size_t n = Count();
  const size_t b = BlockSize();
  const std::vector<float> x = HeavyTailed(n, 41 + static_cast<unsigned>(n));
  const std::vector<float> acc0 = Normal(n, 42 + static_cast<unsigned>(n));
  Bytes enc(codec.encoded_size(n, b));
  ASSERT_THAT(codec.encode(x.data(), n, b, enc.data(), nullptr), IsOk());
  std::vector<float> decoded(n);
  ASSERT_THAT(codec.decode(enc.data(), enc.size(), decoded.data(), n), IsOk());
  std::vector<float> expected = acc0;
  WeightedAccumulate(decoded.data(), -0.37f, expected.data(), n);

  std::vector<float> acc = acc0;
  ASSERT_THAT(codec.decode_accumulate(enc.data(), enc.size(), -0.37f, acc.data(), n), IsOk());
  ExpectSameBits(acc, expected, "fused");
  std::vector<float> ref_acc = acc0;
  ASSERT_THAT(codec.ref_decode_accumulate(enc.data(), enc.size(), -0.37f, ref_acc.data(), n),
              IsOk());
  ExpectSameBits(ref_acc, expected, "reference");
}

const auto kSizeKinds =
    ::testing::Values(SizeKind::kZero, SizeKind::kOne, SizeKind::kBlockMinusOne, SizeKind::kBlock,
                      SizeKind::kBlockPlusOne, SizeKind::kLarge);

INSTANTIATE_TEST_SUITE_P(Int8, BlockwiseSizeTest,
                         ::testing::Combine(::testing::Values(&kInt8),
                                            ::testing::Values(size_t{1}, size_t{64}, size_t{256},
                                                              size_t{4096}),
                                            kSizeKinds),
                         BlockwiseParamName);

// int4 block sizes are even; 32 is one SIMD step.
INSTANTIATE_TEST_SUITE_P(Int4, BlockwiseSizeTest,
                         ::testing::Combine(::testing::Values(&kInt4),
                                            ::testing::Values(size_t{2}, size_t{32}, size_t{64},
                                                              size_t{256}, size_t{4096}),
                                            kSizeKinds),
                         BlockwiseParamName);

TEST(Int8CodecTest, WireLayoutByteByByte) {
  // B = 4, n = 10: blocks {127, 0.5, 1.5, -2.5}, {0, -0, 0, 0}, {0.25, -0.0625}.
  const std::vector<float> x = {127.0f, 0.5f, 1.5f, -2.5f, 0.0f,
                                -0.0f,  0.0f, 0.0f, 0.25f, -0.0625f};
  ASSERT_EQ(Int8EncodedSize(10, 4), 16u + 3 * 4 + 10);
  Bytes enc(Int8EncodedSize(10, 4));
  ASSERT_THAT(Int8BlockwiseEncode(x.data(), x.size(), 4, enc.data(), nullptr), IsOk());
  const Bytes header = {'A', 'Q', '8', 0x01, 4, 0, 0, 0, 10, 0, 0, 0, 0, 0, 0, 0};
  EXPECT_EQ(Bytes(enc.begin(), enc.begin() + 16), header);

  float scales[3];
  std::memcpy(scales, enc.data() + 16, sizeof(scales));
  EXPECT_EQ(scales[0], 1.0f);            // 127 / 127
  EXPECT_EQ(Bits(scales[1]), 0u);        // all-zero block: +0
  EXPECT_EQ(scales[2], 0.25f / 127.0f);  // float division, as documented
  // Block 0, scale 1: 0.5 and -2.5 are ties and go to the even level, 1.5 goes up to 2.
  // Block 2: 0.25 is the max (127); -0.0625 * (1 / scale) = -31.75 -> -32.
  const std::vector<int8_t> expected_q = {127, 0, 2, -2, 0, 0, 0, 0, 127, -32};
  std::vector<int8_t> q(10);
  std::memcpy(q.data(), enc.data() + 28, q.size());
  EXPECT_EQ(q, expected_q);

  // Decoded values are q * scale.
  std::vector<float> out(10);
  ASSERT_THAT(Int8BlockwiseDecode(enc.data(), enc.size(), out.data(), out.size()), IsOk());
  const std::vector<float> expected = {127.0f,
                                       0.0f,
                                       2.0f,
                                       -2.0f,
                                       0.0f,
                                       0.0f,
                                       0.0f,
                                       0.0f,
                                       127.0f * (0.25f / 127.0f),
                                       -32.0f * (0.25f / 127.0f)};
  ExpectSameBits(out, expected, "decode");

  // The reference writes the same bytes.
  Bytes ref_enc(enc.size());
  ASSERT_THAT(reference::Int8BlockwiseEncode(x.data(), x.size(), 4, ref_enc.data(), nullptr),
              IsOk());
  EXPECT_EQ(ref_enc, enc);
}

TEST(BlockwiseCodecTest, RoundTripWithinBlockBoundOnNormalAndHeavyTailedData) {
  for (const BlockwiseCodec* codec : {&kInt8, &kInt4}) {
    for (const size_t b : {size_t{2}, size_t{64}, size_t{256}, size_t{4096}}) {
      SCOPED_TRACE(::testing::Message() << codec->name << " B=" << b);
      const std::vector<float> normal = Normal(200001, 51, 0.01f);
      const double worst_normal =
          ExpectWithinBound(*codec, normal, RoundTrip(*codec, normal, b), b);
      // The bound is tight: some element lands half a step away.
      EXPECT_GT(worst_normal, 0.99);
      const std::vector<float> heavy = HeavyTailed(200001, 52);
      ExpectWithinBound(*codec, heavy, RoundTrip(*codec, heavy, b), b);
      const std::vector<float> wide = WideRange(200001, 53);
      ExpectWithinBound(*codec, wide, RoundTrip(*codec, wide, b), b);
    }
  }
}

// Blocks of `b` values (each zero-padded to a full block) that stress the round-trip bound:
// levels of max_level apart.
std::vector<float> AdversarialBlocks(size_t b, float max_level) {
  std::vector<float> x;
  auto add_block = [&](const std::vector<float>& block) {
    x.insert(x.end(), block.begin(), block.begin() + std::min(block.size(), b));
    x.resize((x.size() + b - 1) / b * b, 0.0f);
  };
  // One huge value and tiny ones: the tiny ones all quantise to 0 (error = their magnitude).
  std::vector<float> outlier = Normal(b, 61, 1e-3f);
  outlier[10] = 1e6f;
  add_block(outlier);
  // Values exactly half a step apart from levels: the worst case of rounding.
  std::vector<float> half_steps;
  const int levels = static_cast<int>(max_level);
  for (int k = -levels; k < levels; ++k) half_steps.push_back((k + 0.5f) * (3.0f / max_level));
  half_steps.push_back(3.0f);
  add_block(half_steps);
  // The extremes of the float range.
  add_block({kFloatMax, -kFloatMax, kFloatMax / 3.0f, 1.0f});
  add_block({-kFloatMax, 1e38f, -1e30f});
  add_block({kFloatMax / max_level, -kFloatMax / (max_level - 1.0f)});
  add_block({std::ldexp(1.0f, -120), -std::ldexp(1.0f, -121), 1e-37f});
  // Subnormal scales: max |x| < max_level * 2^-126 (the division path) and tiny subnormal blocks.
  add_block({max_level * 1e-38f, -3e-38f, 1e-40f, 5e-39f});
  add_block({1e-40f, -1e-41f, 2e-42f});
  add_block({std::ldexp(1.0f, -142), std::ldexp(-1.0f, -143), std::ldexp(1.0f, -149)});
  add_block({std::ldexp(1.0f, -149), -std::ldexp(1.0f, -149)});
  add_block({std::ldexp(3.0f, -148)});
  // A lone nonzero among zeros, and a sign flip of the max.
  add_block({0.0f, 0.0f, -7.0f});
  return x;
}

TEST(BlockwiseCodecTest, RoundTripWithinBlockBoundOnAdversarialBlocks) {
  for (const BlockwiseCodec* codec : {&kInt8, &kInt4}) {
    for (const size_t b : {size_t{64}, size_t{256}}) {
      SCOPED_TRACE(::testing::Message() << codec->name << " B=" << b);
      const std::vector<float> x = AdversarialBlocks(b, static_cast<float>(codec->max_level));
      const std::vector<float> out = CheckedRoundTrip(*codec, x, b);
      ASSERT_FALSE(HasFailure());
      // The block max itself decodes to within one float step, signs kept.
      EXPECT_FLOAT_EQ(out[10], 1e6f);
      EXPECT_GT(out[2 * b], 0.99999f * kFloatMax);
      EXPECT_LT(out[2 * b + 1], -0.99999f * kFloatMax);
      EXPECT_FLOAT_EQ(out[11 * b + 2], -7.0f);
    }
  }
}

TEST(Int8CodecTest, EncodeRejectsNonFiniteNamingTheFirstIndex) {
  struct Case {
    size_t index;
    float value;
    const char* text;
  };
  const Case cases[] = {
      {5, std::numeric_limits<float>::quiet_NaN(), "x[5] is NaN"},
      {0, std::numeric_limits<float>::infinity(), "x[0] is +Inf"},
      {777, -std::numeric_limits<float>::infinity(), "x[777] is -Inf"},
  };
  for (const Case& c : cases) {
    std::vector<float> x = Normal(1000, 71);
    x[c.index] = c.value;
    x[800] = std::numeric_limits<float>::infinity();  // a later bad value is not reported
    Bytes enc(Int8EncodedSize(x.size(), 64));
    std::vector<float> residual(x.size());
    EXPECT_THAT(Int8BlockwiseEncode(x.data(), x.size(), 64, enc.data(), residual.data()),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.text)));
    EXPECT_THAT(reference::Int8BlockwiseEncode(x.data(), x.size(), 64, enc.data(), nullptr),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.text)));
  }
}

TEST(Int8CodecTest, EncodeRejectsBlockSizeOutOfRange) {
  const std::vector<float> x = Normal(10, 72);
  Bytes enc(Int8EncodedSize(x.size(), 1));
  for (const size_t b : {size_t{0}, kInt8MaxBlockSize + 1}) {
    EXPECT_THAT(Int8BlockwiseEncode(x.data(), x.size(), b, enc.data(), nullptr),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block size")));
    EXPECT_THAT(reference::Int8BlockwiseEncode(x.data(), x.size(), b, enc.data(), nullptr),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block size")));
  }
  EXPECT_THAT(Int8BlockwiseEncode(x.data(), x.size(), kInt8MaxBlockSize, enc.data(), nullptr),
              IsOk());
}

// A malformed buffer and the text its error must contain.
struct Malformed {
  std::string name;
  Bytes bytes;
  std::string text;
};

// `good` with `patch` written at `offset`.
Bytes Patched(const Bytes& good, size_t offset, const std::vector<uint8_t>& patch) {
  Bytes b = good;
  std::copy(patch.begin(), patch.end(), b.begin() + offset);
  return b;
}

// The int8/int4 buffer `good` with the scale of `block` replaced.
Bytes WithScale(const Bytes& good, size_t block, float scale) {
  std::vector<uint8_t> patch(4);
  std::memcpy(patch.data(), &scale, 4);
  return Patched(good, 16 + 4 * block, patch);
}

// Malformed variants of `good`, a well-formed int8 or int4 buffer of n values in 16 blocks of
// 64, that both formats refuse. too_large_scale is just above the format's largest scale.
std::vector<Malformed> MalformedBlockwiseBuffers(const Bytes& good, size_t n,
                                                 float too_large_scale) {
  auto with = [&good](size_t offset, std::vector<uint8_t> patch) {
    return Patched(good, offset, patch);
  };
  auto with_scale = [&good](size_t block, float scale) { return WithScale(good, block, scale); };
  const std::string header = absl::StrFormat("header (n=%d, block size 64)", n);
  std::vector<uint8_t> other_n(8);
  const uint64_t n2 = n + 2;
  std::memcpy(other_n.data(), &n2, sizeof(n2));
  std::vector<Malformed> cases;
  cases.push_back({"truncated block", Bytes(good.begin(), good.end() - 1),
                   absl::StrFormat("%s implies %d bytes", header, good.size())});
  Bytes long_buffer = good;
  long_buffer.push_back(0);
  cases.push_back({"long", long_buffer, header});
  cases.push_back({"header only partly there", Bytes(good.begin(), good.begin() + 10),
                   "shorter than its 16-byte header"});
  cases.push_back({"empty", Bytes(), "shorter than its 16-byte header"});
  cases.push_back({"bad magic", with(2, {'X'}), "bad magic"});
  cases.push_back({"bad version", with(3, {0x02}), "bad magic/version"});
  cases.push_back({"block size 0", with(4, {0, 0, 0, 0}), "block size 0"});
  cases.push_back({"block size too big", with(4, {0x02, 0x00, 0x01, 0x00}), "block size 65538"});
  cases.push_back({"n disagrees with length", with(8, other_n), absl::StrFormat("n=%d", n2)});
  cases.push_back({"huge n", with(8, {0, 0, 0, 0, 0, 0, 0, 0x80}), "implies more bytes"});
  cases.push_back(
      {"NaN scale", with_scale(3, std::numeric_limits<float>::quiet_NaN()), "for block 3"});
  cases.push_back(
      {"+Inf scale", with_scale(15, std::numeric_limits<float>::infinity()), "for block 15"});
  cases.push_back({"negative scale", with_scale(0, -0.5f), "invalid scale -0.5"});
  cases.push_back({"-0 scale", with_scale(2, -0.0f), "for block 2"});
  cases.push_back({"scale too large", with_scale(7, too_large_scale), "for block 7"});
  return cases;
}

// Every malformed buffer is refused by Inspect, Decode and DecodeAccumulate (fused and
// reference) with its text, and leaves the destination as it was.
void ExpectMalformedRejected(const BlockwiseCodec& codec, const std::vector<Malformed>& cases,
                             const std::vector<float>& acc0) {
  for (const Malformed& m : cases) {
    SCOPED_TRACE(m.name);
    EXPECT_THAT(codec.inspect(m.bytes.data(), m.bytes.size()),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(m.text)));
    std::vector<float> out = acc0;
    EXPECT_THAT(codec.decode(m.bytes.data(), m.bytes.size(), out.data(), out.size()),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(m.text)));
    EXPECT_THAT(codec.ref_decode(m.bytes.data(), m.bytes.size(), out.data(), out.size()),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(m.text)));
    ExpectSameBits(out, acc0, "decode output");
    std::vector<float> acc = acc0;
    EXPECT_THAT(
        codec.decode_accumulate(m.bytes.data(), m.bytes.size(), 0.5f, acc.data(), acc.size()),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(m.text)));
    EXPECT_THAT(
        codec.ref_decode_accumulate(m.bytes.data(), m.bytes.size(), 0.5f, acc.data(), acc.size()),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(m.text)));
    ExpectSameBits(acc, acc0, "accumulator");
  }
}

// A well-formed buffer of n values is refused for a destination of n - 1.
void ExpectWrongDestinationRejected(const BlockwiseCodec& codec, const Bytes& good, size_t n) {
  std::vector<float> wrong(n - 1);
  EXPECT_THAT(codec.decode(good.data(), good.size(), wrong.data(), wrong.size()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrFormat(
                           "buffer holds %d values but the destination has %d", n, n - 1))));
  EXPECT_THAT(codec.decode_accumulate(good.data(), good.size(), 1.0f, wrong.data(), wrong.size()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrFormat("destination has %d", n - 1))));
}

TEST(Int8CodecTest, DecodeRejectsMalformedBuffersAndLeavesOutputsAlone) {
  const std::vector<float> x = Normal(1000, 81);
  Bytes good(Int8EncodedSize(x.size(), 64));
  ASSERT_THAT(Int8BlockwiseEncode(x.data(), x.size(), 64, good.data(), nullptr), IsOk());
  ASSERT_THAT(Int8BlockwiseInspect(good.data(), good.size()), IsOk());
  ExpectMalformedRejected(kInt8, MalformedBlockwiseBuffers(good, 1000, kFloatMax / 100.0f),
                          Normal(x.size(), 82));
  ExpectWrongDestinationRejected(kInt8, good, x.size());
}

TEST(Int8CodecTest, DecodeReadsMinus128AsMinus127) {
  // q = -128 is never written by the encoder; a decoder reads it as -127 (stays within range).
  const std::vector<float> x = {2.0f, -1.0f, 0.5f};
  Bytes enc(Int8EncodedSize(x.size(), 4));
  ASSERT_THAT(Int8BlockwiseEncode(x.data(), x.size(), 4, enc.data(), nullptr), IsOk());
  enc[16 + 4 + 1] = 0x80;  // q[1] = -128
  std::vector<float> out(3);
  std::vector<float> ref_out(3);
  ASSERT_THAT(Int8BlockwiseDecode(enc.data(), enc.size(), out.data(), out.size()), IsOk());
  ASSERT_THAT(reference::Int8BlockwiseDecode(enc.data(), enc.size(), ref_out.data(), 3), IsOk());
  const float scale = 2.0f / 127.0f;
  EXPECT_EQ(out[1], -127.0f * scale);
  ExpectSameBits(out, ref_out, "decode");
  std::vector<float> acc(3, 1.0f);
  ASSERT_THAT(Int8BlockwiseDecodeAccumulate(enc.data(), enc.size(), 0.5f, acc.data(), 3), IsOk());
  EXPECT_EQ(acc[1], 1.0f + 0.5f * (-127.0f * scale));
}

// ---- int4 blockwise -------------------------------------------------------------------------

TEST(Int4CodecTest, WireLayoutByteByByte) {
  // B = 4, n = 7: blocks {7, 0.5, 1.5, -2.5}, {0.875, -0.125, 0.4375}.
  const std::vector<float> x = {7.0f, 0.5f, 1.5f, -2.5f, 0.875f, -0.125f, 0.4375f};
  ASSERT_EQ(Int4EncodedSize(7, 4), 16u + 2 * 4 + 4);
  Bytes enc(Int4EncodedSize(7, 4), 0xAA);
  ASSERT_THAT(Int4BlockwiseEncode(x.data(), x.size(), 4, enc.data(), nullptr), IsOk());
  const Bytes header = {'A', 'Q', '4', 0x01, 4, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0};
  EXPECT_EQ(Bytes(enc.begin(), enc.begin() + 16), header);

  float scales[2];
  std::memcpy(scales, enc.data() + 16, sizeof(scales));
  EXPECT_EQ(scales[0], 1.0f);    // 7 / 7
  EXPECT_EQ(scales[1], 0.125f);  // 0.875 / 7
  // Block 0, scale 1: levels 7, 0 (tie to even), 2, -2 (tie to even). Block 1, scale 1/8:
  // levels 7, -1, 4 (3.5, a tie, to even). Value 2j in the low nibble, 2j + 1 in the high one;
  // the seventh value's byte has a zero high nibble.
  const Bytes expected_q = {0x07, 0xe2, 0xf7, 0x04};
  EXPECT_EQ(Bytes(enc.begin() + 24, enc.end()), expected_q);

  std::vector<float> out(7);
  ASSERT_THAT(Int4BlockwiseDecode(enc.data(), enc.size(), out.data(), out.size()), IsOk());
  ExpectSameBits(out, {7.0f, 0.0f, 2.0f, -2.0f, 0.875f, -0.125f, 0.5f}, "decode");

  Bytes ref_enc(enc.size(), 0x55);
  ASSERT_THAT(reference::Int4BlockwiseEncode(x.data(), x.size(), 4, ref_enc.data(), nullptr),
              IsOk());
  EXPECT_EQ(ref_enc, enc);
}

TEST(Int4CodecTest, EncodeRejectsNonFiniteNamingTheFirstIndex) {
  std::vector<float> x = Normal(1000, 171);
  x[777] = -std::numeric_limits<float>::infinity();
  x[800] = std::numeric_limits<float>::quiet_NaN();  // a later bad value is not reported
  Bytes enc(Int4EncodedSize(x.size(), 64));
  std::vector<float> residual(x.size());
  EXPECT_THAT(Int4BlockwiseEncode(x.data(), x.size(), 64, enc.data(), residual.data()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Int4BlockwiseEncode: x[777] is -Inf")));
  EXPECT_THAT(reference::Int4BlockwiseEncode(x.data(), x.size(), 64, enc.data(), nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Int4BlockwiseEncode: x[777] is -Inf")));
}

TEST(Int4CodecTest, EncodeRejectsOddOrOutOfRangeBlockSizes) {
  const std::vector<float> x = Normal(10, 172);
  Bytes enc(Int4EncodedSize(x.size(), 2));
  for (const size_t b : {size_t{0}, size_t{1}, size_t{63}, kInt4MaxBlockSize + 2}) {
    SCOPED_TRACE(b);
    EXPECT_FALSE(Int4BlockSizeValid(b));
    EXPECT_THAT(Int4BlockwiseEncode(x.data(), x.size(), b, enc.data(), nullptr),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block size")));
    EXPECT_THAT(reference::Int4BlockwiseEncode(x.data(), x.size(), b, enc.data(), nullptr),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block size")));
  }
  EXPECT_THAT(Int4BlockwiseEncode(x.data(), x.size(), kInt4MaxBlockSize, enc.data(), nullptr),
              IsOk());
}

// int8's malformed buffers and those only int4 has. good: n = 999, B = 64.
std::vector<Malformed> MalformedInt4Buffers(const Bytes& good) {
  std::vector<Malformed> cases = MalformedBlockwiseBuffers(good, 999, kFloatMax / 5.0f);
  cases.push_back({"int8 magic", Patched(good, 0, {'A', 'Q', '8'}), "bad magic"});
  cases.push_back({"odd block size", Patched(good, 4, {63}), "block size 63, not an even number"});
  cases.push_back(
      {"scale above FLT_MAX / 7", WithScale(good, 1, kFloatMax / 6.5f), "at most FLT_MAX / 7"});
  Bytes padded = good;
  padded.back() = static_cast<uint8_t>(padded.back() | 0x30);
  cases.push_back({"padding nibble", padded, "padding nibble 0x3"});
  return cases;
}

TEST(Int4CodecTest, DecodeRejectsMalformedBuffersAndLeavesOutputsAlone) {
  const std::vector<float> x = Normal(999, 181);
  Bytes good(Int4EncodedSize(x.size(), 64));
  ASSERT_EQ(good.size(), 16u + 16 * 4 + 500);
  ASSERT_THAT(Int4BlockwiseEncode(x.data(), x.size(), 64, good.data(), nullptr), IsOk());
  ASSERT_THAT(Int4BlockwiseInspect(good.data(), good.size()), IsOk());
  ExpectMalformedRejected(kInt4, MalformedInt4Buffers(good), Normal(x.size(), 182));
  ExpectWrongDestinationRejected(kInt4, good, x.size());
  // An int8 buffer is no int4 one, nor the other way round.
  Bytes int8(Int8EncodedSize(x.size(), 64));
  ASSERT_THAT(Int8BlockwiseEncode(x.data(), x.size(), 64, int8.data(), nullptr), IsOk());
  EXPECT_THAT(Int4BlockwiseInspect(int8.data(), int8.size()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad magic")));
  EXPECT_THAT(Int8BlockwiseInspect(good.data(), good.size()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad magic")));
}

TEST(Int4CodecTest, DecodeReadsMinus8AsMinus7) {
  // Nibble 0x8 (-8) is never written by the encoder; a decoder reads it as -7. Exercised in the
  // vectorised loop (n = 64) and in the scalar tail (n = 3).
  for (const size_t n : {size_t{3}, size_t{64}}) {
    SCOPED_TRACE(n);
    std::vector<float> x(n, 0.5f);
    x[0] = 2.0f;
    x[1] = -1.0f;
    Bytes enc(Int4EncodedSize(n, 64));
    ASSERT_THAT(Int4BlockwiseEncode(x.data(), n, 64, enc.data(), nullptr), IsOk());
    enc[16 + 4] = static_cast<uint8_t>((enc[16 + 4] & 0x0f) | 0x80);  // value 1 = -8
    std::vector<float> out(n);
    std::vector<float> ref_out(n);
    ASSERT_THAT(Int4BlockwiseDecode(enc.data(), enc.size(), out.data(), n), IsOk());
    ASSERT_THAT(reference::Int4BlockwiseDecode(enc.data(), enc.size(), ref_out.data(), n), IsOk());
    const float scale = 2.0f / 7.0f;
    EXPECT_EQ(out[0], 7.0f * scale);
    EXPECT_EQ(out[1], -7.0f * scale);
    ExpectSameBits(out, ref_out, "decode");
    std::vector<float> acc(n, 1.0f);
    ASSERT_THAT(Int4BlockwiseDecodeAccumulate(enc.data(), enc.size(), 0.5f, acc.data(), n), IsOk());
    EXPECT_EQ(acc[1], 1.0f + 0.5f * (-7.0f * scale));
  }
}

#ifdef ALOE_HAVE_CUDA

// Device copy of a host byte or float vector; freed on destruction.
template <typename T>
class DeviceVector {
 public:
  explicit DeviceVector(const std::vector<T>& host) : n_(host.size()) {
    if (cudaMalloc(&ptr_, std::max<size_t>(n_, 1) * sizeof(T)) != cudaSuccess) {
      ptr_ = nullptr;
      return;
    }
    if (n_ > 0) cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice);
  }
  ~DeviceVector() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceVector(const DeviceVector&) = delete;
  DeviceVector& operator=(const DeviceVector&) = delete;

  bool Valid() const { return ptr_ != nullptr; }
  T* Data() { return static_cast<T*>(ptr_); }
  std::vector<T> ToHost() const {
    std::vector<T> host(n_);
    if (n_ > 0) cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return host;
  }

 private:
  size_t n_;
  void* ptr_ = nullptr;
};

class CodecKernelsCudaTest : public ::testing::TestWithParam<std::tuple<size_t, SizeKind>> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
  size_t BlockSize() const { return std::get<0>(GetParam()); }
  size_t Count() const { return SizeOf(std::get<1>(GetParam()), BlockSize()); }
};

// The CUDA kernels of a blockwise codec and the CPU codec they must match.
struct CudaBlockwiseCodec {
  const BlockwiseCodec* cpu;
  std::string (*encode)(const float* x, size_t n, size_t block_size, void* out, float* residual,
                        void* stream);
  std::string (*decode)(const void* in, size_t n, size_t block_size, float* out, void* stream);
  std::string (*decode_accumulate)(const void* in, size_t n, size_t block_size, float w, float* acc,
                                   void* stream);
};

const CudaBlockwiseCodec kCudaInt8 = {&kInt8, CudaInt8BlockwiseEncode, CudaInt8BlockwiseDecode,
                                      CudaInt8BlockwiseDecodeAccumulate};
const CudaBlockwiseCodec kCudaInt4 = {&kInt4, CudaInt4BlockwiseEncode, CudaInt4BlockwiseDecode,
                                      CudaInt4BlockwiseDecodeAccumulate};

// Encode (with residual), decode and decode-accumulate of x on the device give the CPU
// reference's bytes and floats, bit for bit.
void ExpectCudaMatchesReference(const CudaBlockwiseCodec& codec, const std::vector<float>& x,
                                size_t b) {
  const size_t n = x.size();
  const BlockwiseCodec& cpu = *codec.cpu;
  const std::vector<float> acc0 = Normal(n, 92 + static_cast<unsigned>(n));
  Bytes ref_enc(cpu.encoded_size(n, b));
  std::vector<float> ref_residual(n);
  ASSERT_THAT(cpu.ref_encode(x.data(), n, b, ref_enc.data(), ref_residual.data()), IsOk());
  std::vector<float> ref_out(n);
  ASSERT_THAT(cpu.ref_decode(ref_enc.data(), ref_enc.size(), ref_out.data(), n), IsOk());
  std::vector<float> ref_acc = acc0;
  ASSERT_THAT(cpu.ref_decode_accumulate(ref_enc.data(), ref_enc.size(), 0.37f, ref_acc.data(), n),
              IsOk());
  const std::vector<float> zeros(n, 0.0f);
  DeviceVector<float> d_x(x), d_residual(zeros), d_out(zeros), d_acc(acc0);
  DeviceVector<uint8_t> d_enc(Bytes(ref_enc.size(), 0xAA));
  ASSERT_TRUE(d_x.Valid() && d_residual.Valid() && d_out.Valid() && d_acc.Valid() && d_enc.Valid());
  EXPECT_EQ(codec.encode(d_x.Data(), n, b, d_enc.Data(), d_residual.Data(), nullptr), "");
  EXPECT_EQ(codec.decode(d_enc.Data(), n, b, d_out.Data(), nullptr), "");
  EXPECT_EQ(codec.decode_accumulate(d_enc.Data(), n, b, 0.37f, d_acc.Data(), nullptr), "");
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(d_enc.ToHost(), ref_enc);
  ExpectSameBits(d_residual.ToHost(), ref_residual, std::string("cuda residual ") + cpu.name);
  ExpectSameBits(d_out.ToHost(), ref_out, std::string("cuda decode ") + cpu.name);
  ExpectSameBits(d_acc.ToHost(), ref_acc, std::string("cuda decode-accumulate ") + cpu.name);
}

TEST_P(CodecKernelsCudaTest, MatchesCpuReferenceBitExact) {
  const size_t n = Count();
  const size_t b = BlockSize();
  const std::vector<float> x = WideRange(n, 91 + static_cast<unsigned>(n));
  ExpectCudaMatchesReference(kCudaInt8, x, b);
  std::vector<float> ref_residual(n);
  std::vector<float> ref_out(n);
  const std::vector<float> zeros(n, 0.0f);
  DeviceVector<float> d_x(x), d_residual(zeros), d_out(zeros);
  ASSERT_TRUE(d_x.Valid() && d_residual.Valid() && d_out.Valid());

  // bf16 encode (with residual) and decode.
  Bytes ref_bf16(Bf16EncodedSize(n));
  ASSERT_THAT(reference::Bf16Encode(x.data(), n, ref_bf16.data(), ref_residual.data()), IsOk());
  ASSERT_THAT(reference::Bf16Decode(ref_bf16.data(), ref_bf16.size(), ref_out.data(), n), IsOk());
  DeviceVector<uint8_t> d_bf16(Bytes(ref_bf16.size(), 0xAA));
  ASSERT_TRUE(d_bf16.Valid());
  EXPECT_EQ(CudaBf16Encode(d_x.Data(), n, d_bf16.Data(), d_residual.Data(), nullptr), "");
  EXPECT_EQ(CudaBf16Decode(d_bf16.Data(), n, d_out.Data(), nullptr), "");
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(d_bf16.ToHost(), ref_bf16);
  ExpectSameBits(d_residual.ToHost(), ref_residual, "cuda bf16 residual");
  ExpectSameBits(d_out.ToHost(), ref_out, "cuda bf16 decode");
}

TEST_P(CodecKernelsCudaTest, NonFiniteInputYieldsABufferTheCpuDecoderRejects) {
  const size_t n = Count();
  const size_t b = BlockSize();
  if (n == 0) GTEST_SKIP() << "nothing to poison";
  std::vector<float> x = Normal(n, 93);
  x[n / 2] = std::numeric_limits<float>::quiet_NaN();
  DeviceVector<float> d_x(x);
  DeviceVector<uint8_t> d_enc(Bytes(Int8EncodedSize(n, b)));
  DeviceVector<uint8_t> d_bf16(Bytes(Bf16EncodedSize(n)));
  ASSERT_TRUE(d_x.Valid() && d_enc.Valid() && d_bf16.Valid());
  EXPECT_EQ(CudaInt8BlockwiseEncode(d_x.Data(), n, b, d_enc.Data(), nullptr, nullptr), "");
  EXPECT_EQ(CudaBf16Encode(d_x.Data(), n, d_bf16.Data(), nullptr, nullptr), "");
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Bytes enc = d_enc.ToHost();
  const Bytes bf16 = d_bf16.ToHost();
  std::vector<float> out(n);
  EXPECT_THAT(Int8BlockwiseDecode(enc.data(), enc.size(), out.data(), n),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("for block " + std::to_string(n / 2 / b))));
  EXPECT_THAT(Bf16Decode(bf16.data(), bf16.size(), out.data(), n),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("encoded value " + std::to_string(n / 2) + " is NaN")));
}

using CodecKernelsCudaInt4Test = CodecKernelsCudaTest;

TEST_P(CodecKernelsCudaInt4Test, MatchesCpuReferenceBitExact) {
  const size_t n = Count();
  const size_t b = BlockSize();
  const std::vector<float> x = WideRange(n, 94 + static_cast<unsigned>(n));
  ExpectCudaMatchesReference(kCudaInt4, x, b);

  // A NaN makes its block's scale NaN, which the CPU decoder refuses.
  if (n == 0) return;
  std::vector<float> poisoned = x;
  poisoned[n / 2] = std::numeric_limits<float>::quiet_NaN();
  DeviceVector<float> d_x(x), d_poisoned(poisoned);
  DeviceVector<uint8_t> d_enc(Bytes(Int4EncodedSize(n, b)));
  ASSERT_TRUE(d_x.Valid() && d_poisoned.Valid() && d_enc.Valid());
  EXPECT_EQ(CudaInt4BlockwiseEncode(d_poisoned.Data(), n, b, d_enc.Data(), nullptr, nullptr), "");
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Bytes enc = d_enc.ToHost();
  std::vector<float> out(n);
  EXPECT_THAT(Int4BlockwiseDecode(enc.data(), enc.size(), out.data(), n),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("for block " + std::to_string(n / 2 / b))));
  EXPECT_NE(CudaInt4BlockwiseEncode(d_x.Data(), n, b + 1, d_enc.Data(), nullptr, nullptr), "");
}

INSTANTIATE_TEST_SUITE_P(BlocksAndSizes, CodecKernelsCudaInt4Test,
                         ::testing::Combine(::testing::Values(size_t{2}, size_t{64}, size_t{256},
                                                              size_t{4096}),
                                            kSizeKinds),
                         Int8ParamName);

INSTANTIATE_TEST_SUITE_P(
    BlocksAndSizes, CodecKernelsCudaTest,
    ::testing::Combine(::testing::Values(size_t{1}, size_t{64}, size_t{256}, size_t{4096}),
                       ::testing::Values(SizeKind::kZero, SizeKind::kOne, SizeKind::kBlockMinusOne,
                                         SizeKind::kBlock, SizeKind::kBlockPlusOne,
                                         SizeKind::kLarge)),
    Int8ParamName);

// The GPU low-rank decode gives the CPU reference's bits: ranks around warps and tiles, odd
// widths, a window cut mid-row, written and accumulated in place.
TEST(LowRankKernelsCudaTest, MatchesCpuReferenceBitExact) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (size_t rank : {size_t{1}, size_t{7}, size_t{16}, size_t{33}, size_t{64}}) {
    const size_t rows = 5 + rank % 4, cols = 129 + 2 * rank;
    const std::vector<float> p = Normal(rows * rank, 100 + static_cast<unsigned>(rank));
    const std::vector<float> qt = Normal(rank * cols, 200 + static_cast<unsigned>(rank));
    const std::vector<float> base = Normal(rows * cols, 300 + static_cast<unsigned>(rank));
    for (size_t j0 : {size_t{0}, cols / 3}) {
      const size_t len = j0 == 0 ? cols : cols - j0 - 5;
      SCOPED_TRACE(::testing::Message() << "rank " << rank << " j0 " << j0);
      std::vector<float> want(rows * cols, 0.0f);
      reference::LowRankDecodeRows(p.data(), rows, rank, qt.data(), cols, j0, len, want.data());
      DeviceVector<float> d_p(p), d_qt(qt), d_out(std::vector<float>(rows * cols, 0.0f));
      ASSERT_TRUE(d_p.Valid() && d_qt.Valid() && d_out.Valid());
      EXPECT_EQ(CudaLowRankDecodeRows(d_p.Data(), rows, rank, d_qt.Data(), cols, j0, len,
                                      d_out.Data(), nullptr),
                "");
      std::vector<float> got = d_out.ToHost();
      EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0);

      want = base;
      reference::LowRankDecodeAccumulateRows(p.data(), rows, rank, qt.data(), cols, j0, len, -0.37f,
                                             want.data(), want.data());
      DeviceVector<float> d_acc(base);
      EXPECT_EQ(CudaLowRankDecodeAccumulateRows(d_p.Data(), rows, rank, d_qt.Data(), cols, j0, len,
                                                -0.37f, d_acc.Data(), d_acc.Data(), nullptr),
                "");
      got = d_acc.ToHost();
      EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0);
    }
  }
  EXPECT_NE(CudaLowRankDecodeRows(nullptr, 1, 1, nullptr, 4, 3, 2, nullptr, nullptr), "");
}

#endif  // ALOE_HAVE_CUDA

}  // namespace
}  // namespace aloe::kernels
