#include "kernels/cpu/outer_kernels.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#ifdef ALOE_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/outer_kernels_cuda.h"
#endif

namespace aloe::kernels {
namespace {

constexpr size_t kSizes[] = {0, 1, 7, 16, 64, 1000, 4099};

// Fixed seed per (size, salt): deterministic, different data per buffer.
std::vector<float> RandomVector(size_t n, unsigned salt, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(static_cast<unsigned>(n) * 7919u + salt);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// The fused and reference loops do the same float operations per element; the tolerance only
// allows for a compiler contracting a*b+c into an FMA in one of them. Data are O(1).
constexpr float kTol = 1e-6f;

void ExpectAllNear(const std::vector<float>& actual, const std::vector<float>& expected,
                   const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    ASSERT_NEAR(actual[i], expected[i], kTol) << what << " at element " << i;
  }
}

class OuterKernelsSizeTest : public ::testing::TestWithParam<size_t> {};

TEST_P(OuterKernelsSizeTest, SgdApplyMatchesReference) {
  const size_t n = GetParam();
  const std::vector<float> g = RandomVector(n, 1);
  const std::vector<float> theta = RandomVector(n, 2);
  std::vector<float> out(n, 99.0f);
  std::vector<float> expected(n, -99.0f);
  SgdApply(g.data(), theta.data(), out.data(), n, 0.7f);
  reference::SgdApply(g.data(), theta.data(), expected.data(), n, 0.7f);
  ExpectAllNear(out, expected, "out of place");
  for (size_t i = 0; i < n; ++i) ASSERT_NEAR(out[i], theta[i] - 0.7f * g[i], kTol);

  std::vector<float> in_place = theta;
  SgdApply(g.data(), in_place.data(), in_place.data(), n, 0.7f);
  ExpectAllNear(in_place, expected, "in place");
}

TEST_P(OuterKernelsSizeTest, NesterovApplyMatchesReference) {
  const size_t n = GetParam();
  const std::vector<float> g = RandomVector(n, 3);
  const std::vector<float> m0 = RandomVector(n, 4);
  const std::vector<float> theta = RandomVector(n, 5);
  const float lr = 0.7f;
  const float beta = 0.9f;

  std::vector<float> m = m0;
  std::vector<float> out(n, 99.0f);
  std::vector<float> ref_m = m0;
  std::vector<float> expected(n, -99.0f);
  NesterovApply(g.data(), m.data(), theta.data(), out.data(), n, lr, beta);
  reference::NesterovApply(g.data(), ref_m.data(), theta.data(), expected.data(), n, lr, beta);
  ExpectAllNear(m, ref_m, "momentum");
  ExpectAllNear(out, expected, "theta out of place");

  // Second step from the updated momentum, in place.
  std::vector<float> in_place = expected;
  std::vector<float> ref_in_place = expected;
  NesterovApply(g.data(), m.data(), in_place.data(), in_place.data(), n, lr, beta);
  reference::NesterovApply(g.data(), ref_m.data(), ref_in_place.data(), ref_in_place.data(), n, lr,
                           beta);
  ExpectAllNear(m, ref_m, "momentum, second step");
  ExpectAllNear(in_place, ref_in_place, "theta in place, second step");
}

TEST_P(OuterKernelsSizeTest, NesterovApplyFollowsEquation4ElementWise) {
  // Independent of the reference: m' = beta*m + g, theta' = theta - lr*(beta*m' + g), in double.
  const size_t n = GetParam();
  const std::vector<float> g = RandomVector(n, 6);
  const std::vector<float> m0 = RandomVector(n, 7);
  const std::vector<float> theta = RandomVector(n, 8);
  std::vector<float> m = m0;
  std::vector<float> out(n);
  NesterovApply(g.data(), m.data(), theta.data(), out.data(), n, 0.5f, 0.8f);
  for (size_t i = 0; i < n; ++i) {
    const double m1 = 0.8 * m0[i] + g[i];
    const double t1 = theta[i] - 0.5 * (0.8 * m1 + g[i]);
    ASSERT_NEAR(m[i], m1, 1e-6) << i;
    ASSERT_NEAR(out[i], t1, 1e-6) << i;
  }
}

// DN (paper 002 Alg. 3) against the reference, for each branch: momentum step, non-momentum
// step with c > 0 (reads m) and with c = 0 (fast path that skips m), in place and out of place.
TEST_P(OuterKernelsSizeTest, DelayedNesterovApplyMatchesReference) {
  const size_t n = GetParam();
  const std::vector<float> g = RandomVector(n, 30);
  const std::vector<float> m0 = RandomVector(n, 31);
  const std::vector<float> d0 = RandomVector(n, 32);
  const std::vector<float> theta = RandomVector(n, 33);
  struct Case {
    uint32_t buffer_size;
    float c;
    bool momentum_step;
  };
  const Case cases[] = {
      {4, 0.0f, false}, {4, 0.1f, false},    {4, 0.0f, true},
      {4, 0.25f, true}, {3, 1.0f / 3, true}, {1, 0.0f, true},
  };
  for (const Case& k : cases) {
    const std::string what = "N=" + std::to_string(k.buffer_size) + " c=" + std::to_string(k.c) +
                             (k.momentum_step ? " momentum step" : " buffer step");
    std::vector<float> m = m0, d = d0, out(n, 99.0f);
    std::vector<float> ref_m = m0, ref_d = d0, expected(n, -99.0f);
    DelayedNesterovApply(g.data(), m.data(), d.data(), theta.data(), out.data(), n, 0.7f, 0.9f,
                         k.buffer_size, k.c, k.momentum_step);
    reference::DelayedNesterovApply(g.data(), ref_m.data(), ref_d.data(), theta.data(),
                                    expected.data(), n, 0.7f, 0.9f, k.buffer_size, k.c,
                                    k.momentum_step);
    ExpectAllNear(m, ref_m, what + " momentum");
    ExpectAllNear(d, ref_d, what + " buffer");
    ExpectAllNear(out, expected, what + " theta out of place");
    if (k.momentum_step) {
      EXPECT_THAT(d, ::testing::Each(0.0f)) << what;
    } else {
      EXPECT_EQ(m, m0) << what;  // the momentum is only read between momentum steps
    }

    std::vector<float> in_place = theta;
    m = m0;
    d = d0;
    DelayedNesterovApply(g.data(), m.data(), d.data(), in_place.data(), in_place.data(), n, 0.7f,
                         0.9f, k.buffer_size, k.c, k.momentum_step);
    ExpectAllNear(in_place, expected, what + " theta in place");
  }
}

TEST_P(OuterKernelsSizeTest, DelayedNesterovApplyFollowsAlgorithm3ElementWise) {
  // Independent of the reference: Alg. 3 per element in double, N = 4, c = 0.2, beta 0.8, lr 0.5.
  const size_t n = GetParam();
  const std::vector<float> g = RandomVector(n, 34);
  const std::vector<float> m0 = RandomVector(n, 35);
  const std::vector<float> d0 = RandomVector(n, 36);
  const std::vector<float> theta = RandomVector(n, 37);
  for (bool momentum_step : {false, true}) {
    std::vector<float> m = m0, d = d0, out(n);
    DelayedNesterovApply(g.data(), m.data(), d.data(), theta.data(), out.data(), n, 0.5f, 0.8f, 4,
                         0.2f, momentum_step);
    for (size_t i = 0; i < n; ++i) {
      const double d1 = static_cast<double>(d0[i]) + g[i];
      if (momentum_step) {
        const double m1 = 0.8 * m0[i] + d1 / 4;
        const double t1 = theta[i] - 0.5 * ((1 - 0.2 * 4 + 0.2) * 0.8 * m1 + g[i] / 4.0);
        ASSERT_NEAR(m[i], m1, 1e-6) << i;
        ASSERT_EQ(d[i], 0.0f) << i;
        ASSERT_NEAR(out[i], t1, 1e-6) << i;
      } else {
        const double t1 = theta[i] - 0.5 * (0.2 * 0.8 * m0[i] + g[i] / 4.0);
        ASSERT_EQ(m[i], m0[i]) << i;
        ASSERT_NEAR(d[i], d1, 1e-6) << i;
        ASSERT_NEAR(out[i], t1, 1e-6) << i;
      }
    }
  }
}

TEST_P(OuterKernelsSizeTest, DelayedNesterovWithBufferOneIsNesterovBitForBit) {
  // N = 1, c = 0: every update is a momentum step with D = g, so Alg. 3 is Eq. 4 exactly.
  const size_t n = GetParam();
  const std::vector<float> m0 = RandomVector(n, 38);
  std::vector<float> dn_theta = RandomVector(n, 39);
  std::vector<float> nesterov_theta = dn_theta;
  std::vector<float> dn_m = m0, nesterov_m = m0, d(n, 0.0f);
  for (unsigned step = 0; step < 3; ++step) {
    const std::vector<float> g = RandomVector(n, 40 + step);
    DelayedNesterovApply(g.data(), dn_m.data(), d.data(), dn_theta.data(), dn_theta.data(), n, 0.7f,
                         0.9f, 1, 0.0f, true);
    NesterovApply(g.data(), nesterov_m.data(), nesterov_theta.data(), nesterov_theta.data(), n,
                  0.7f, 0.9f);
    ASSERT_EQ(dn_m, nesterov_m) << "step " << step;
    ASSERT_EQ(dn_theta, nesterov_theta) << "step " << step;
    ASSERT_THAT(d, ::testing::Each(0.0f));
  }
}

TEST_P(OuterKernelsSizeTest, AdamApplyMatchesReferenceAndDoubleLoop) {
  const size_t n = GetParam();
  const std::vector<float> g = RandomVector(n, 50);
  const std::vector<float> m0 = RandomVector(n, 51);
  const std::vector<float> v0 = RandomVector(n, 52, 0.0f, 1.0f);
  const std::vector<float> theta = RandomVector(n, 53);
  // Step t = 3 with beta1 0.9, beta2 0.999: step_size = lr / (1 - 0.9^3),
  // inv_sqrt_bias2 = 1 / sqrt(1 - 0.999^3).
  const double step_size = 0.01 / (1 - std::pow(0.9, 3));
  const double inv_sqrt_bias2 = 1 / std::sqrt(1 - std::pow(0.999, 3));
  std::vector<float> m = m0, v = v0, out(n);
  std::vector<float> ref_m = m0, ref_v = v0, expected(n);
  AdamApply(g.data(), m.data(), v.data(), theta.data(), out.data(), n,
            static_cast<float>(step_size), 0.9f, 0.999f, 1e-8f, static_cast<float>(inv_sqrt_bias2));
  reference::AdamApply(g.data(), ref_m.data(), ref_v.data(), theta.data(), expected.data(), n,
                       static_cast<float>(step_size), 0.9f, 0.999f, 1e-8f,
                       static_cast<float>(inv_sqrt_bias2));
  ExpectAllNear(m, ref_m, "adam m");
  ExpectAllNear(v, ref_v, "adam v");
  ExpectAllNear(out, expected, "adam theta");
  for (size_t i = 0; i < n; ++i) {
    const double m1 = 0.9 * m0[i] + 0.1 * g[i];
    const double v1 = 0.999 * v0[i] + 0.001 * static_cast<double>(g[i]) * g[i];
    const double t1 = theta[i] - step_size * m1 / (std::sqrt(v1) * inv_sqrt_bias2 + 1e-8);
    ASSERT_NEAR(m[i], m1, 1e-6) << i;
    ASSERT_NEAR(v[i], v1, 1e-6) << i;
    ASSERT_NEAR(out[i], t1, 1e-6 * (1 + std::abs(t1))) << i;
  }

  std::vector<float> in_place = theta;
  m = m0;
  v = v0;
  AdamApply(g.data(), m.data(), v.data(), in_place.data(), in_place.data(), n,
            static_cast<float>(step_size), 0.9f, 0.999f, 1e-8f, static_cast<float>(inv_sqrt_bias2));
  ExpectAllNear(in_place, expected, "adam theta in place");
}

TEST_P(OuterKernelsSizeTest, WeightedAccumulateMatchesReference) {
  const size_t n = GetParam();
  const std::vector<float> x = RandomVector(n, 9);
  const std::vector<float> acc0 = RandomVector(n, 10);
  std::vector<float> acc = acc0;
  std::vector<float> expected = acc0;
  WeightedAccumulate(x.data(), 0.25f, acc.data(), n);
  reference::WeightedAccumulate(x.data(), 0.25f, expected.data(), n);
  ExpectAllNear(acc, expected, "accumulate");
  for (size_t i = 0; i < n; ++i) ASSERT_NEAR(acc[i], acc0[i] + 0.25 * x[i], kTol);

  // acc += w*acc (exact aliasing) is acc *= 1 + w.
  std::vector<float> self = acc0;
  WeightedAccumulate(self.data(), 0.5f, self.data(), n);
  for (size_t i = 0; i < n; ++i) ASSERT_NEAR(self[i], 1.5 * acc0[i], kTol);
}

TEST_P(OuterKernelsSizeTest, ScaleMatchesReference) {
  const size_t n = GetParam();
  std::vector<float> x = RandomVector(n, 11);
  std::vector<float> expected = x;
  const std::vector<float> original = x;
  Scale(x.data(), n, -3.5f);
  reference::Scale(expected.data(), n, -3.5f);
  ExpectAllNear(x, expected, "scale");
  for (size_t i = 0; i < n; ++i) ASSERT_NEAR(x[i], -3.5 * original[i], 4 * kTol);
}

TEST_P(OuterKernelsSizeTest, ScaledCopyEqualsAZeroAccumulatorPlusTheWeightedInput) {
  const size_t n = GetParam();
  const std::vector<float> x = RandomVector(n, 18);
  std::vector<float> out(n, 123.0f), ref(n, 123.0f), acc(n, 0.0f);
  ScaledCopy(x.data(), -0.3f, out.data(), n);
  reference::ScaledCopy(x.data(), -0.3f, ref.data(), n);
  WeightedAccumulate(x.data(), -0.3f, acc.data(), n);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(out[i], ref[i]) << i;
    ASSERT_EQ(out[i], acc[i]) << i;  // bit-equal to the fill-then-accumulate it replaces
    ASSERT_NEAR(out[i], -0.3 * x[i], kTol);
  }
}

TEST_P(OuterKernelsSizeTest, SquaredL2NormMatchesDoubleLoop) {
  const size_t n = GetParam();
  const std::vector<float> x = RandomVector(n, 12, -100.0f, 100.0f);
  double expected = 0;
  for (float v : x) expected += static_cast<double>(v) * v;
  const double fused = SquaredL2Norm(x.data(), n);
  EXPECT_NEAR(fused, expected, 1e-12 * expected);
  EXPECT_NEAR(reference::SquaredL2Norm(x.data(), n), expected, 1e-12 * expected);
  if (n == 0) {
    EXPECT_EQ(fused, 0.0);
  }
}

TEST_P(OuterKernelsSizeTest, SquaredL2NormOfBytesIsTheNormOfTheValuesAtAnyAlignment) {
  const size_t n = GetParam();
  const std::vector<float> x = RandomVector(n, 13, -100.0f, 100.0f);
  double expected = 0;
  for (float v : x) expected += static_cast<double>(v) * v;
  // The values' bytes at offsets 0..3 of a byte buffer: aligned and not.
  for (size_t shift = 0; shift < 4; ++shift) {
    std::vector<unsigned char> bytes(n * sizeof(float) + shift + 1, 0xff);
    if (n > 0) std::memcpy(bytes.data() + shift, x.data(), n * sizeof(float));
    const double got = SquaredL2NormOfBytes(bytes.data() + shift, n);
    EXPECT_NEAR(got, expected, 1e-5 * expected) << "shift " << shift;
  }
  EXPECT_EQ(SquaredL2NormOfBytes(nullptr, 0), 0.0);
}

TEST_P(OuterKernelsSizeTest, SquaredL2NormDoesNotOverflowFloat) {
  // Each square (1e30) overflows float32 but not double.
  const size_t n = GetParam();
  const std::vector<float> x(n, 1e15f);
  const double expected = static_cast<double>(n) * 1e15 * 1e15;
  EXPECT_NEAR(SquaredL2Norm(x.data(), n), expected, 1e-6 * expected);
}

TEST_P(OuterKernelsSizeTest, AllFiniteAcceptsFiniteExtremes) {
  const size_t n = GetParam();
  std::vector<float> x = RandomVector(n, 13);
  const float extremes[] = {std::numeric_limits<float>::max(), std::numeric_limits<float>::lowest(),
                            std::numeric_limits<float>::denorm_min(), -0.0f, 0.0f};
  for (size_t i = 0; i < n; ++i) {
    if (i % 3 == 0) x[i] = extremes[(i / 3) % 5];
  }
  EXPECT_TRUE(AllFinite(x.data(), n));
  EXPECT_TRUE(reference::AllFinite(x.data(), n));
}

TEST_P(OuterKernelsSizeTest, AllFiniteDetectsNanAndInfAtFirstMiddleLast) {
  const size_t n = GetParam();
  if (n == 0) {
    EXPECT_TRUE(AllFinite(nullptr, 0));  // nothing to poison: vacuously finite
    return;
  }
  const float bad_values[] = {
      std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
      std::numeric_limits<float>::signaling_NaN(), std::numeric_limits<float>::infinity(),
      -std::numeric_limits<float>::infinity()};
  const size_t positions[] = {0, n / 2, n - 1};
  for (float bad : bad_values) {
    for (size_t pos : positions) {
      std::vector<float> x = RandomVector(n, 14);
      x[pos] = bad;
      EXPECT_FALSE(AllFinite(x.data(), n)) << "value " << bad << " at " << pos << " of " << n;
      EXPECT_FALSE(reference::AllFinite(x.data(), n)) << "value " << bad << " at " << pos;
    }
  }
}

// CopyWithinMagnitude from a deliberately misaligned byte buffer: returns (result, reference
// result), checks that AllWithinMagnitude of the values in place agrees with each, that both
// copies equal the input bit for bit and that nothing around the destination was written, and
// the same of StreamWithinMagnitude.
std::pair<bool, bool> CopyFromUnaligned(const std::vector<float>& x, float limit) {
  std::vector<unsigned char> bytes(x.size() * sizeof(float) + 1);
  if (!x.empty()) std::memcpy(bytes.data() + 1, x.data(), x.size() * sizeof(float));
  constexpr size_t kGuard = 16;  // floats before and after the destination
  std::vector<float> storage(x.size() + 2 * kGuard, 7.0f), ref(x.size(), 7.0f);
  float* out = storage.data() + kGuard;
  const bool fast = CopyWithinMagnitude(bytes.data() + 1, out, x.size(), limit);
  const bool slow = reference::CopyWithinMagnitude(bytes.data() + 1, ref.data(), x.size(), limit);
  // The screen alone, of the values in place, answers the same (fast kernel and reference).
  EXPECT_EQ(AllWithinMagnitude(x.data(), x.size(), limit), fast);
  EXPECT_EQ(reference::AllWithinMagnitude(x.data(), x.size(), limit), slow);
  EXPECT_EQ(0, x.empty() ? 0 : std::memcmp(out, x.data(), x.size() * sizeof(float)));
  EXPECT_EQ(0, x.empty() ? 0 : std::memcmp(ref.data(), x.data(), x.size() * sizeof(float)));
  for (size_t i = 0; i < kGuard; ++i) {
    EXPECT_EQ(storage[i], 7.0f) << "wrote " << kGuard - i << " before the destination";
    EXPECT_EQ(storage[kGuard + x.size() + i], 7.0f) << "wrote " << i << " past the destination";
  }
  // The streaming copy answers and writes the same, from every start within a 32-byte line
  // (0 to 7 elements before its first aligned store; sizes from 64 take the streaming loop).
  for (size_t shift = 0; shift < 8; ++shift) {
    std::vector<float> streamed(x.size() + 2 * kGuard + 8, 7.0f);
    float* to = streamed.data() + kGuard + shift;
    EXPECT_EQ(StreamWithinMagnitude(bytes.data() + 1, to, x.size(), limit), fast)
        << "start " << shift;
    EXPECT_EQ(0, x.empty() ? 0 : std::memcmp(to, x.data(), x.size() * sizeof(float)))
        << "start " << shift;
    EXPECT_EQ(std::count(streamed.begin(), streamed.end(), 7.0f),
              static_cast<std::ptrdiff_t>(streamed.size() - x.size()) -
                  std::count(x.begin(), x.end(), 7.0f))
        << "start " << shift << ": wrote outside the destination";
  }
  return {fast, slow};
}

TEST_P(OuterKernelsSizeTest, CopyWithinMagnitudeCopiesExactlyAndScreensTheLimit) {
  const size_t n = GetParam();
  const float limit = 1e6f;
  std::vector<float> x = RandomVector(n, 17);
  const float edges[] = {limit, -limit, -0.0f, std::numeric_limits<float>::denorm_min(), 0.5f};
  for (size_t i = 0; i < n; ++i) {
    if (i % 4 == 0) x[i] = edges[(i / 4) % 5];
  }
  EXPECT_EQ(CopyFromUnaligned(x, limit), std::make_pair(true, true));
  if (n == 0) return;
  const float bad_values[] = {
      std::nextafter(limit, 2 * limit),         -std::nextafter(limit, 2 * limit),
      std::numeric_limits<float>::max(),        std::numeric_limits<float>::quiet_NaN(),
      -std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
      -std::numeric_limits<float>::infinity()};
  for (float bad : bad_values) {
    for (size_t pos : {size_t{0}, n / 2, n - 1}) {
      std::vector<float> y = x;
      y[pos] = bad;
      EXPECT_EQ(CopyFromUnaligned(y, limit), std::make_pair(false, false))
          << "value " << bad << " at " << pos << " of " << n;
    }
  }
  // Limit 0 (of either sign) admits only zeros of either sign.
  for (float zero : {0.0f, -0.0f}) {
    EXPECT_EQ(CopyFromUnaligned(std::vector<float>(n, -0.0f), zero), std::make_pair(true, true));
    std::vector<float> y(n, 0.0f);
    y[n - 1] = std::numeric_limits<float>::denorm_min();
    EXPECT_EQ(CopyFromUnaligned(y, zero), std::make_pair(false, false));
    y[n - 1] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_EQ(CopyFromUnaligned(y, zero), std::make_pair(false, false));
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, OuterKernelsSizeTest, ::testing::ValuesIn(kSizes),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return "n" + std::to_string(info.param);
                         });

TEST(OuterKernelsTest, NullPointersWithZeroLengthAreNoOps) {
  SgdApply(nullptr, nullptr, nullptr, 0, 1.0f);
  NesterovApply(nullptr, nullptr, nullptr, nullptr, 0, 1.0f, 0.9f);
  DelayedNesterovApply(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 1.0f, 0.9f, 4, 0.1f, true);
  DelayedNesterovApply(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 1.0f, 0.9f, 4, 0.1f, false);
  AdamApply(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 1.0f, 0.9f, 0.999f, 1e-8f, 1.0f);
  WeightedAccumulate(nullptr, 1.0f, nullptr, 0);
  Scale(nullptr, 0, 2.0f);
  ScaledCopy(nullptr, 2.0f, nullptr, 0);
  EXPECT_EQ(SquaredL2Norm(nullptr, 0), 0.0);
  EXPECT_TRUE(AllFinite(nullptr, 0));
  EXPECT_TRUE(CopyWithinMagnitude(nullptr, nullptr, 0, 1.0f));
  EXPECT_TRUE(StreamWithinMagnitude(nullptr, nullptr, 0, 1.0f));
  EXPECT_TRUE(AllWithinMagnitude(nullptr, 0, 1.0f));
}

TEST(OuterKernelsTest, NesterovWithZeroMomentumIsSgd) {
  const size_t n = 1000;
  const std::vector<float> g = RandomVector(n, 15);
  const std::vector<float> theta = RandomVector(n, 16);
  std::vector<float> m(n, 0.0f);
  std::vector<float> nesterov(n);
  std::vector<float> sgd(n);
  NesterovApply(g.data(), m.data(), theta.data(), nesterov.data(), n, 0.3f, 0.0f);
  SgdApply(g.data(), theta.data(), sgd.data(), n, 0.3f);
  EXPECT_EQ(nesterov, sgd);
  EXPECT_EQ(m, g);
}

#if defined(__x86_64__)
// x86-64 builds (kernels/CMakeLists.txt: SSE4.2 baseline, an AVX2 clone picked at load time on
// hosts that have it) must not change a single bit of the outer step between hosts: a job
// resumed on another machine follows the same trajectory. Kernels whose reference does the same
// float operations in the same order must then equal it exactly, whichever clone this host runs;
// a fused multiply-add or a reordering in either would show up here (the data is O(1) random).
TEST(OuterKernelsTest, KernelsEqualTheReferenceBitForBitOnX86) {
  const size_t n = 4099;  // a vector tail on every width
  const std::vector<float> g = RandomVector(n, 31);
  const std::vector<float> theta = RandomVector(n, 32);
  const std::vector<float> m0 = RandomVector(n, 33);
  auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  std::vector<float> out(n), expected(n);
  SgdApply(g.data(), theta.data(), out.data(), n, 0.37f);
  reference::SgdApply(g.data(), theta.data(), expected.data(), n, 0.37f);
  EXPECT_TRUE(same(out, expected)) << "SgdApply";

  std::vector<float> m = m0, m_ref = m0;
  NesterovApply(g.data(), m.data(), theta.data(), out.data(), n, 0.37f, 0.9f);
  reference::NesterovApply(g.data(), m_ref.data(), theta.data(), expected.data(), n, 0.37f, 0.9f);
  EXPECT_TRUE(same(out, expected) && same(m, m_ref)) << "NesterovApply";

  std::vector<float> acc = m0, acc_ref = m0;
  WeightedAccumulate(g.data(), 0.3f, acc.data(), n);
  reference::WeightedAccumulate(g.data(), 0.3f, acc_ref.data(), n);
  EXPECT_TRUE(same(acc, acc_ref)) << "WeightedAccumulate";

  ScaledCopy(g.data(), 0.3f, out.data(), n);
  reference::ScaledCopy(g.data(), 0.3f, expected.data(), n);
  EXPECT_TRUE(same(out, expected)) << "ScaledCopy";
  Scale(out.data(), n, 1.7f);
  reference::Scale(expected.data(), n, 1.7f);
  EXPECT_TRUE(same(out, expected)) << "Scale";
}

// An out-of-place step (copy on write) writes theta_out with streaming stores on AVX2 hosts,
// the few elements before its first 32-byte boundary and after the last group of 8 with the
// ordinary loop: every outer step must give bit for bit what the same step in place gives, for
// every alignment of theta_out, and leave its optimizer state (m, d, v) the same too.
TEST(OuterKernelsTest, OutOfPlaceStepsEqualInPlaceStepsBitForBit) {
  auto same = [](const float* a, const float* b, size_t n) {
    return std::memcmp(a, b, n * sizeof(float)) == 0;
  };
  for (const size_t n : {size_t{64}, size_t{4099}}) {
    const std::vector<float> g = RandomVector(n, 41);
    const std::vector<float> theta = RandomVector(n, 42);
    const std::vector<float> m0 = RandomVector(n, 43);
    const std::vector<float> d0 = RandomVector(n, 44);
    const std::vector<float> v0 = RandomVector(n, 45, 0.0f, 1.0f);
    for (size_t shift = 0; shift < 8; ++shift) {
      SCOPED_TRACE(::testing::Message() << "n " << n << ", theta_out at +" << shift);
      std::vector<float> storage(n + 8, -7.0f);
      float* out = storage.data() + shift;
      std::vector<float> in_place = theta;

      SgdApply(g.data(), theta.data(), out, n, 0.37f);
      SgdApply(g.data(), in_place.data(), in_place.data(), n, 0.37f);
      EXPECT_TRUE(same(out, in_place.data(), n)) << "SgdApply";

      std::vector<float> m = m0, m_in = m0;
      in_place = theta;
      NesterovApply(g.data(), m.data(), theta.data(), out, n, 0.37f, 0.9f);
      NesterovApply(g.data(), m_in.data(), in_place.data(), in_place.data(), n, 0.37f, 0.9f);
      EXPECT_TRUE(same(out, in_place.data(), n) && same(m.data(), m_in.data(), n))
          << "NesterovApply";

      // Delayed Nesterov, N = 3: a momentum step, then the two kinds of other steps (c = 0,
      // where m is not read, and c = 0.2).
      for (const auto& [momentum, c] :
           {std::pair<bool, float>{true, 0.2f}, {false, 0.0f}, {false, 0.2f}}) {
        std::vector<float> dm = m0, dm_in = m0, d = d0, d_in = d0;
        in_place = theta;
        DelayedNesterovApply(g.data(), dm.data(), d.data(), theta.data(), out, n, 0.37f, 0.9f, 3, c,
                             momentum);
        DelayedNesterovApply(g.data(), dm_in.data(), d_in.data(), in_place.data(), in_place.data(),
                             n, 0.37f, 0.9f, 3, c, momentum);
        EXPECT_TRUE(same(out, in_place.data(), n) && same(dm.data(), dm_in.data(), n) &&
                    same(d.data(), d_in.data(), n))
            << "DelayedNesterovApply momentum_step " << momentum << " c " << c;
      }

      std::vector<float> am = m0, am_in = m0, av = v0, av_in = v0;
      in_place = theta;
      AdamApply(g.data(), am.data(), av.data(), theta.data(), out, n, 0.01f, 0.9f, 0.999f, 1e-8f,
                1.3f);
      AdamApply(g.data(), am_in.data(), av_in.data(), in_place.data(), in_place.data(), n, 0.01f,
                0.9f, 0.999f, 1e-8f, 1.3f);
      EXPECT_TRUE(same(out, in_place.data(), n) && same(am.data(), am_in.data(), n) &&
                  same(av.data(), av_in.data(), n))
          << "AdamApply";
      // Nothing outside theta_out was written.
      for (size_t i = 0; i < shift; ++i) ASSERT_EQ(storage[i], -7.0f);
      for (size_t i = shift + n; i < storage.size(); ++i) ASSERT_EQ(storage[i], -7.0f);
    }
  }
}
#endif

#ifdef ALOE_HAVE_CUDA

// Device buffer holding a copy of a host vector; freed on destruction.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(const std::vector<float>& host) : n_(host.size()) {
    if (cudaMalloc(&ptr_, std::max<size_t>(n_, 1) * sizeof(float)) != cudaSuccess) {
      ptr_ = nullptr;
      return;
    }
    if (n_ > 0) cudaMemcpy(ptr_, host.data(), n_ * sizeof(float), cudaMemcpyHostToDevice);
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  bool ok() const { return ptr_ != nullptr; }
  float* get() { return static_cast<float*>(ptr_); }
  std::vector<float> ToHost() const {
    std::vector<float> host(n_);
    if (n_ > 0) cudaMemcpy(host.data(), ptr_, n_ * sizeof(float), cudaMemcpyDeviceToHost);
    return host;
  }

 private:
  size_t n_;
  void* ptr_ = nullptr;
};

class OuterKernelsCudaTest : public ::testing::TestWithParam<size_t> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(OuterKernelsCudaTest, KernelsMatchCpuReference) {
  const size_t n = GetParam();
  const std::vector<float> g = RandomVector(n, 21);
  const std::vector<float> m0 = RandomVector(n, 22);
  const std::vector<float> theta = RandomVector(n, 23);

  // SGD, out of place.
  std::vector<float> sgd_expected(n);
  reference::SgdApply(g.data(), theta.data(), sgd_expected.data(), n, 0.7f);
  DeviceBuffer d_g(g), d_theta(theta), d_out(std::vector<float>(n, 0.0f));
  ASSERT_TRUE(d_g.ok() && d_theta.ok() && d_out.ok());
  EXPECT_EQ(CudaSgdApply(d_g.get(), d_theta.get(), d_out.get(), n, 0.7f, nullptr), "");
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ExpectAllNear(d_out.ToHost(), sgd_expected, "cuda sgd");

  // Nesterov, in place on theta.
  std::vector<float> ref_m = m0;
  std::vector<float> nesterov_expected = theta;
  reference::NesterovApply(g.data(), ref_m.data(), nesterov_expected.data(),
                           nesterov_expected.data(), n, 0.7f, 0.9f);
  DeviceBuffer d_m(m0);
  ASSERT_TRUE(d_m.ok());
  EXPECT_EQ(
      CudaNesterovApply(d_g.get(), d_m.get(), d_theta.get(), d_theta.get(), n, 0.7f, 0.9f, nullptr),
      "");
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ExpectAllNear(d_m.ToHost(), ref_m, "cuda nesterov momentum");
  ExpectAllNear(d_theta.ToHost(), nesterov_expected, "cuda nesterov theta");

  // Weighted accumulate on a stream.
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  std::vector<float> acc_expected = m0;
  reference::WeightedAccumulate(g.data(), 0.25f, acc_expected.data(), n);
  DeviceBuffer d_acc(m0);
  ASSERT_TRUE(d_acc.ok());
  EXPECT_EQ(CudaWeightedAccumulate(d_g.get(), 0.25f, d_acc.get(), n, stream), "");
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);
  ExpectAllNear(d_acc.ToHost(), acc_expected, "cuda weighted accumulate");

  // Delayed Nesterov: a buffer step with c > 0, then a momentum step, in place on theta.
  const std::vector<float> d0 = RandomVector(n, 24);
  std::vector<float> ref_dn_m = m0, ref_d = d0, dn_expected = theta;
  DeviceBuffer d_dn_m(m0), d_d(d0), d_dn_theta(theta);
  ASSERT_TRUE(d_dn_m.ok() && d_d.ok() && d_dn_theta.ok());
  for (bool momentum_step : {false, true}) {
    reference::DelayedNesterovApply(g.data(), ref_dn_m.data(), ref_d.data(), dn_expected.data(),
                                    dn_expected.data(), n, 0.7f, 0.9f, 4, 0.1f, momentum_step);
    EXPECT_EQ(
        CudaDelayedNesterovApply(d_g.get(), d_dn_m.get(), d_d.get(), d_dn_theta.get(),
                                 d_dn_theta.get(), n, 0.7f, 0.9f, 4, 0.1f, momentum_step, nullptr),
        "");
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ExpectAllNear(d_dn_m.ToHost(), ref_dn_m, "cuda dn momentum");
    ExpectAllNear(d_d.ToHost(), ref_d, "cuda dn buffer");
    ExpectAllNear(d_dn_theta.ToHost(), dn_expected, "cuda dn theta");
  }

  // Adam, out of place.
  const std::vector<float> v0 = RandomVector(n, 25, 0.0f, 1.0f);
  std::vector<float> ref_adam_m = m0, ref_v = v0, adam_expected(n);
  reference::AdamApply(g.data(), ref_adam_m.data(), ref_v.data(), theta.data(),
                       adam_expected.data(), n, 0.1f, 0.9f, 0.999f, 1e-8f, 1.5f);
  DeviceBuffer d_adam_m(m0), d_v(v0), d_theta2(theta), d_adam_out(std::vector<float>(n, 0.0f));
  ASSERT_TRUE(d_adam_m.ok() && d_v.ok() && d_theta2.ok() && d_adam_out.ok());
  EXPECT_EQ(CudaAdamApply(d_g.get(), d_adam_m.get(), d_v.get(), d_theta2.get(), d_adam_out.get(), n,
                          0.1f, 0.9f, 0.999f, 1e-8f, 1.5f, nullptr),
            "");
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ExpectAllNear(d_adam_m.ToHost(), ref_adam_m, "cuda adam m");
  ExpectAllNear(d_v.ToHost(), ref_v, "cuda adam v");
  ExpectAllNear(d_adam_out.ToHost(), adam_expected, "cuda adam theta");
}

INSTANTIATE_TEST_SUITE_P(Sizes, OuterKernelsCudaTest,
                         ::testing::Values<size_t>(0, 1, 7, 16, 1000, 4099, 1 << 20),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return "n" + std::to_string(info.param);
                         });

#endif  // ALOE_HAVE_CUDA

}  // namespace
}  // namespace aloe::kernels
