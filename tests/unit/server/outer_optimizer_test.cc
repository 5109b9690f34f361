#include "server/core/outer_optimizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "proto/aloe.pb.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::StartsWith;

v1::OuterOptimizerConfig Config(v1::OuterOptimizerType type, float lr, float momentum) {
  v1::OuterOptimizerConfig config;
  config.set_type(type);
  config.set_lr(lr);
  config.set_momentum(momentum);
  return config;
}

std::unique_ptr<OuterOptimizer> MakeOrDie(const v1::OuterOptimizerConfig& config, size_t n) {
  absl::StatusOr<std::unique_ptr<OuterOptimizer>> opt = MakeOuterOptimizer(config, n);
  EXPECT_THAT(opt, IsOk());
  return opt.ok() ? std::move(opt).value() : nullptr;
}

std::vector<float> RandomVector(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// ---------------------------------------------------------------------------------------------
// Golden numbers (paper 002 Eq. 4 and 5), expected values written by hand or computed here in
// double precision, independently of the kernels.

TEST(OuterNesterovTest, FirstTwoStepsMatchEquation4ByHand) {
  // lr 0.7, beta 0.9 (DiLoCo defaults), m0 = 0, g = {1, -2, 0.5}, theta = {0.1, 0.2, 0.3}.
  std::unique_ptr<OuterOptimizer> opt = MakeOrDie(Config(v1::OUTER_NESTEROV, 0.7f, 0.9f), 3);
  ASSERT_NE(opt, nullptr);
  const std::vector<float> g = {1.0f, -2.0f, 0.5f};
  std::vector<float> theta = {0.1f, 0.2f, 0.3f};

  // Step 1: m = g; theta -= 0.7 * (0.9 * g + g) = theta - 1.33 * g.
  ASSERT_THAT(opt->Apply(g, theta, absl::MakeSpan(theta)), IsOk());
  const auto& nesterov = dynamic_cast<const OuterNesterov&>(*opt);
  EXPECT_THAT(nesterov.momentum(), ::testing::ElementsAre(1.0f, -2.0f, 0.5f));
  EXPECT_NEAR(theta[0], -1.23, 1e-6);
  EXPECT_NEAR(theta[1], 2.86, 1e-6);
  EXPECT_NEAR(theta[2], -0.365, 1e-6);

  // Step 2, same g: m = 0.9 * g + g = 1.9 * g; theta -= 0.7 * (0.9 * 1.9 + 1) * g = 1.897 * g.
  ASSERT_THAT(opt->Apply(g, theta, absl::MakeSpan(theta)), IsOk());
  EXPECT_NEAR(nesterov.momentum()[0], 1.9, 1e-6);
  EXPECT_NEAR(nesterov.momentum()[1], -3.8, 1e-6);
  EXPECT_NEAR(nesterov.momentum()[2], 0.95, 1e-6);
  EXPECT_NEAR(theta[0], -3.127, 2e-6);
  EXPECT_NEAR(theta[1], 6.654, 2e-6);
  EXPECT_NEAR(theta[2], -1.3135, 2e-6);
}

TEST(OuterNesterovTest, OutOfPlaceLeavesThetaInUntouched) {
  std::unique_ptr<OuterOptimizer> opt = MakeOrDie(Config(v1::OUTER_NESTEROV, 0.7f, 0.9f), 3);
  ASSERT_NE(opt, nullptr);
  const std::vector<float> g = {1.0f, -2.0f, 0.5f};
  const std::vector<float> theta = {0.1f, 0.2f, 0.3f};
  std::vector<float> out(3, 0.0f);
  ASSERT_THAT(opt->Apply(g, theta, absl::MakeSpan(out)), IsOk());
  EXPECT_THAT(theta, ::testing::ElementsAre(0.1f, 0.2f, 0.3f));
  EXPECT_NEAR(out[0], -1.23, 1e-6);
  EXPECT_NEAR(out[1], 2.86, 1e-6);
  EXPECT_NEAR(out[2], -0.365, 1e-6);
}

TEST(OuterNesterovTest, SequentialStepsWithSameGradientFollowEquation5) {
  // k sequential steps on the same g: m_k = (1 + beta + ... + beta^(k-1)) g (paper 002 Eq. 5),
  // theta follows Eq. 4 step by step (double-precision loop below).
  constexpr size_t kN = 64;
  constexpr int kSteps = 20;
  constexpr double kLr = 0.7;
  constexpr double kBeta = 0.9;
  std::unique_ptr<OuterOptimizer> opt = MakeOrDie(Config(v1::OUTER_NESTEROV, 0.7f, 0.9f), kN);
  ASSERT_NE(opt, nullptr);
  const auto& nesterov = dynamic_cast<const OuterNesterov&>(*opt);
  const std::vector<float> g = RandomVector(kN, 1);
  std::vector<float> theta = RandomVector(kN, 2);
  std::vector<double> expected_theta(theta.begin(), theta.end());
  std::vector<double> expected_m(kN, 0.0);

  for (int k = 1; k <= kSteps; ++k) {
    ASSERT_THAT(opt->Apply(g, theta, absl::MakeSpan(theta)), IsOk());
    double geometric = 0;  // 1 + beta + ... + beta^(k-1)
    for (int j = 0; j < k; ++j) geometric += std::pow(kBeta, j);
    EXPECT_NEAR(geometric, (1 - std::pow(kBeta, k)) / (1 - kBeta), 1e-12);
    for (size_t i = 0; i < kN; ++i) {
      expected_m[i] = kBeta * expected_m[i] + g[i];
      expected_theta[i] -= kLr * (kBeta * expected_m[i] + g[i]);
      ASSERT_NEAR(expected_m[i], geometric * g[i], 1e-12);
      ASSERT_NEAR(nesterov.momentum()[i], geometric * g[i], 1e-5 * geometric) << "k=" << k;
      ASSERT_NEAR(theta[i], expected_theta[i], 1e-5 * (1 + std::abs(expected_theta[i])))
          << "k=" << k << " i=" << i;
    }
  }
}

TEST(OuterNesterovTest, ZeroMomentumIsSgd) {
  constexpr size_t kN = 100;
  std::unique_ptr<OuterOptimizer> nesterov = MakeOrDie(Config(v1::OUTER_NESTEROV, 0.3f, 0.0f), kN);
  std::unique_ptr<OuterOptimizer> sgd = MakeOrDie(Config(v1::OUTER_SGD, 0.3f, 0.0f), kN);
  ASSERT_NE(nesterov, nullptr);
  ASSERT_NE(sgd, nullptr);
  std::vector<float> a = RandomVector(kN, 3);
  std::vector<float> b = a;
  for (unsigned step = 0; step < 3; ++step) {
    const std::vector<float> g = RandomVector(kN, 10 + step);
    ASSERT_THAT(nesterov->Apply(g, a, absl::MakeSpan(a)), IsOk());
    ASSERT_THAT(sgd->Apply(g, b, absl::MakeSpan(b)), IsOk());
    for (size_t i = 0; i < kN; ++i) ASSERT_NEAR(a[i], b[i], 1e-6) << i;
  }
}

TEST(OuterSgdTest, StepMatchesHandNumbers) {
  // theta - 0.5 * g with g = {1, -2, 0.5}, theta = {0.1, 0.2, 0.3}.
  std::unique_ptr<OuterOptimizer> opt = MakeOrDie(Config(v1::OUTER_SGD, 0.5f, 0.0f), 3);
  ASSERT_NE(opt, nullptr);
  const std::vector<float> g = {1.0f, -2.0f, 0.5f};
  std::vector<float> theta = {0.1f, 0.2f, 0.3f};
  ASSERT_THAT(opt->Apply(g, theta, absl::MakeSpan(theta)), IsOk());
  EXPECT_NEAR(theta[0], -0.4, 1e-6);
  EXPECT_NEAR(theta[1], 1.2, 1e-6);
  EXPECT_NEAR(theta[2], 0.05, 1e-6);
  // Stateless: the same g again moves by the same amount.
  ASSERT_THAT(opt->Apply(g, theta, absl::MakeSpan(theta)), IsOk());
  EXPECT_NEAR(theta[0], -0.9, 1e-6);
  EXPECT_NEAR(theta[1], 2.2, 1e-6);
  EXPECT_NEAR(theta[2], -0.2, 1e-6);
}

// ---------------------------------------------------------------------------------------------
// Config validation.

TEST(MakeOuterOptimizerTest, UnspecifiedTypeIsNesterov) {
  std::unique_ptr<OuterOptimizer> opt =
      MakeOrDie(Config(v1::OUTER_OPTIMIZER_UNSPECIFIED, 0.7f, 0.9f), 4);
  ASSERT_NE(opt, nullptr);
  EXPECT_EQ(opt->name(), "nesterov");
  EXPECT_NE(dynamic_cast<OuterNesterov*>(opt.get()), nullptr);
}

TEST(MakeOuterOptimizerTest, BuildsEachKnownType) {
  std::unique_ptr<OuterOptimizer> sgd = MakeOrDie(Config(v1::OUTER_SGD, 0.7f, 0.0f), 4);
  std::unique_ptr<OuterOptimizer> nesterov = MakeOrDie(Config(v1::OUTER_NESTEROV, 0.7f, 0.9f), 4);
  ASSERT_NE(sgd, nullptr);
  ASSERT_NE(nesterov, nullptr);
  EXPECT_EQ(sgd->name(), "sgd");
  EXPECT_NE(dynamic_cast<OuterSgd*>(sgd.get()), nullptr);
  EXPECT_EQ(nesterov->name(), "nesterov");
}

TEST(MakeOuterOptimizerTest, SgdIgnoresMomentum) {
  EXPECT_THAT(MakeOuterOptimizer(Config(v1::OUTER_SGD, 0.7f, 5.0f), 4), IsOk());
}

TEST(MakeOuterOptimizerTest, RejectsNonPositiveOrNonFiniteLr) {
  const float bad_lrs[] = {0.0f,
                           -0.0f,
                           -1.0f,
                           std::numeric_limits<float>::quiet_NaN(),
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity()};
  for (v1::OuterOptimizerType type :
       {v1::OUTER_OPTIMIZER_UNSPECIFIED, v1::OUTER_SGD, v1::OUTER_NESTEROV}) {
    for (float lr : bad_lrs) {
      EXPECT_THAT(
          MakeOuterOptimizer(Config(type, lr, 0.9f), 4),
          StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outer_optimizer.lr must be > 0")))
          << "type " << type << " lr " << lr;
    }
  }
}

TEST(MakeOuterOptimizerTest, RejectsNesterovMomentumOutsideZeroToOne) {
  const float bad_momenta[] = {1.0f, 1.5f, -0.1f, std::numeric_limits<float>::quiet_NaN(),
                               std::numeric_limits<float>::infinity()};
  for (v1::OuterOptimizerType type : {v1::OUTER_OPTIMIZER_UNSPECIFIED, v1::OUTER_NESTEROV}) {
    for (float momentum : bad_momenta) {
      EXPECT_THAT(
          MakeOuterOptimizer(Config(type, 0.7f, momentum), 4),
          StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outer_optimizer.momentum")))
          << "type " << type << " momentum " << momentum;
    }
  }
  EXPECT_THAT(MakeOuterOptimizer(Config(v1::OUTER_NESTEROV, 0.7f, 0.0f), 4), IsOk());
  EXPECT_THAT(MakeOuterOptimizer(Config(v1::OUTER_NESTEROV, 0.7f, 0.999f), 4), IsOk());
}

TEST(MakeOuterOptimizerTest, RejectsUnknownType) {
  EXPECT_THAT(MakeOuterOptimizer(Config(static_cast<v1::OuterOptimizerType>(99), 0.7f, 0.9f), 4),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outer_optimizer.type")));
}

// ---------------------------------------------------------------------------------------------
// Conformance suite: every OuterOptimizer implementation.

class OuterOptimizerConformanceTest : public ::testing::TestWithParam<v1::OuterOptimizerType> {
 protected:
  static constexpr size_t kN = 37;
  v1::OuterOptimizerConfig config() const { return Config(GetParam(), 0.7f, 0.9f); }

  // Applies `steps` pseudo-gradients (seeded by first_seed..) to theta in place.
  static void Run(OuterOptimizer& opt, std::vector<float>& theta, unsigned first_seed, int steps) {
    for (int s = 0; s < steps; ++s) {
      const std::vector<float> g = RandomVector(kN, first_seed + s);
      ASSERT_THAT(opt.Apply(g, theta, absl::MakeSpan(theta)), IsOk());
    }
  }

  static std::string State(const OuterOptimizer& opt) {
    std::string blob;
    opt.SaveState(&blob);
    return blob;
  }
};

TEST_P(OuterOptimizerConformanceTest, SizeMismatchIsInvalidArgumentAndChangesNothing) {
  std::unique_ptr<OuterOptimizer> opt = MakeOrDie(config(), kN);
  ASSERT_NE(opt, nullptr);
  std::vector<float> theta = RandomVector(kN, 1);
  Run(*opt, theta, 100, 2);
  const std::string state_before = State(*opt);
  const std::vector<float> theta_before = theta;

  const std::vector<float> g = RandomVector(kN, 2);
  const std::vector<float> short_g = RandomVector(kN - 1, 3);
  std::vector<float> long_out(kN + 1, 0.0f);
  const std::vector<float> long_theta(kN + 1, 0.0f);
  EXPECT_THAT(opt->Apply(short_g, theta, absl::MakeSpan(theta)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("g=36")));
  EXPECT_THAT(opt->Apply(g, long_theta, absl::MakeSpan(theta)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("theta_in=38")));
  EXPECT_THAT(opt->Apply(g, theta, absl::MakeSpan(long_out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("theta_out=38")));
  EXPECT_EQ(theta, theta_before);
  EXPECT_EQ(State(*opt), state_before);
  EXPECT_THAT(long_out, ::testing::Each(0.0f));
}

TEST_P(OuterOptimizerConformanceTest, PartialOverlapIsInvalidArgument) {
  std::unique_ptr<OuterOptimizer> opt = MakeOrDie(config(), kN);
  ASSERT_NE(opt, nullptr);
  std::vector<float> buffer = RandomVector(kN + 1, 4);
  const std::vector<float> g = RandomVector(kN, 5);
  const std::vector<float> before = buffer;
  absl::Span<const float> theta_in(buffer.data(), kN);
  absl::Span<float> shifted_out(buffer.data() + 1, kN);
  EXPECT_THAT(opt->Apply(g, theta_in, shifted_out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlap")));
  EXPECT_EQ(buffer, before);
}

TEST_P(OuterOptimizerConformanceTest, InPlaceEqualsOutOfPlace) {
  std::unique_ptr<OuterOptimizer> a = MakeOrDie(config(), kN);
  std::unique_ptr<OuterOptimizer> b = MakeOrDie(config(), kN);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  std::vector<float> in_place = RandomVector(kN, 6);
  std::vector<float> current = in_place;
  for (unsigned s = 0; s < 3; ++s) {
    const std::vector<float> g = RandomVector(kN, 20 + s);
    std::vector<float> next(kN);
    ASSERT_THAT(a->Apply(g, in_place, absl::MakeSpan(in_place)), IsOk());
    ASSERT_THAT(b->Apply(g, current, absl::MakeSpan(next)), IsOk());
    current = next;
  }
  EXPECT_EQ(in_place, current);
}

TEST_P(OuterOptimizerConformanceTest, EmptyLayerIsFine) {
  std::unique_ptr<OuterOptimizer> opt = MakeOrDie(config(), 0);
  ASSERT_NE(opt, nullptr);
  EXPECT_THAT(opt->Apply({}, {}, {}), IsOk());
  std::unique_ptr<OuterOptimizer> restored = MakeOrDie(config(), 0);
  ASSERT_NE(restored, nullptr);
  EXPECT_THAT(restored->LoadState(State(*opt)), IsOk());
}

TEST_P(OuterOptimizerConformanceTest, SaveLoadRoundTripContinuesIdentically) {
  std::unique_ptr<OuterOptimizer> original = MakeOrDie(config(), kN);
  ASSERT_NE(original, nullptr);
  std::vector<float> theta = RandomVector(kN, 7);
  Run(*original, theta, 200, 3);

  std::string blob = "prefix";
  original->SaveState(&blob);
  ASSERT_THAT(blob, StartsWith("prefix"));  // appends
  const std::string state = blob.substr(6);

  std::unique_ptr<OuterOptimizer> restored = MakeOrDie(config(), kN);
  ASSERT_NE(restored, nullptr);
  ASSERT_THAT(restored->LoadState(state), IsOk());
  EXPECT_EQ(State(*restored), state);

  std::vector<float> theta_original = theta;
  std::vector<float> theta_restored = theta;
  Run(*original, theta_original, 300, 2);
  Run(*restored, theta_restored, 300, 2);
  EXPECT_EQ(theta_original, theta_restored);  // bit for bit
  EXPECT_EQ(State(*original), State(*restored));
}

TEST_P(OuterOptimizerConformanceTest, LoadStateRejectsGarbageAndKeepsState) {
  std::unique_ptr<OuterOptimizer> opt = MakeOrDie(config(), kN);
  std::unique_ptr<OuterOptimizer> twin = MakeOrDie(config(), kN);
  ASSERT_NE(opt, nullptr);
  ASSERT_NE(twin, nullptr);
  std::vector<float> theta = RandomVector(kN, 8);
  std::vector<float> theta_twin = theta;
  Run(*opt, theta, 400, 2);
  Run(*twin, theta_twin, 400, 2);
  const std::string good = State(*opt);

  // A blob of another optimizer kind, and one for a layer of another size.
  const v1::OuterOptimizerType other_type =
      GetParam() == v1::OUTER_SGD ? v1::OUTER_NESTEROV : v1::OUTER_SGD;
  std::unique_ptr<OuterOptimizer> other_kind = MakeOrDie(Config(other_type, 0.7f, 0.9f), kN);
  std::unique_ptr<OuterOptimizer> other_size = MakeOrDie(config(), kN + 1);
  ASSERT_NE(other_kind, nullptr);
  ASSERT_NE(other_size, nullptr);

  std::string random_bytes(200, '\0');
  std::mt19937 rng(9);
  for (char& c : random_bytes) c = static_cast<char>(rng());
  std::string bad_version = good;
  bad_version[4] ^= 0x7f;
  std::string bad_kind = good;
  bad_kind[12] ^= 0x20;  // first byte of the kind name

  std::vector<std::string> garbage = {
      "",
      "garbage",
      random_bytes,
      good.substr(0, good.size() - 1),
      good + "x",
      bad_version,
      bad_kind,
      State(*other_kind),
      State(*other_size),
  };
  if (GetParam() != v1::OUTER_SGD) {
    // A state buffer holding NaN (a corrupted checkpoint would poison every later step).
    std::string nan_state = good;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(&nan_state[nan_state.size() - sizeof(float)], &nan, sizeof(float));
    garbage.push_back(nan_state);
  }
  for (size_t i = 0; i < garbage.size(); ++i) {
    EXPECT_THAT(opt->LoadState(garbage[i]),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outer optimizer state")))
        << "garbage #" << i;
  }
  EXPECT_EQ(State(*opt), good);

  // The rejected loads changed nothing: both continue identically.
  Run(*opt, theta, 500, 2);
  Run(*twin, theta_twin, 500, 2);
  EXPECT_EQ(theta, theta_twin);
}

INSTANTIATE_TEST_SUITE_P(AllOptimizers, OuterOptimizerConformanceTest,
                         ::testing::Values(v1::OUTER_SGD, v1::OUTER_NESTEROV),
                         [](const ::testing::TestParamInfo<v1::OuterOptimizerType>& info) {
                           return v1::OuterOptimizerType_Name(info.param);
                         });

}  // namespace
}  // namespace aloe::server
