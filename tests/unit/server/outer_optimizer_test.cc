#include "server/core/outer_optimizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/status_matchers.h"
#include "proto/aloe.pb.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// A config as the loader leaves it (common/config.cc FillServerDefaults): N = 1, c = 0, Adam
// 0.9 / 0.999 / 1e-8, no staleness discount; type, lr and momentum as given.
v1::OuterOptimizerConfig Config(v1::OuterOptimizerType type, float lr, float momentum) {
  v1::OuterOptimizerConfig config;
  config.set_type(type);
  config.set_lr(lr);
  config.set_momentum(momentum);
  config.set_dn_buffer_size(1);
  config.set_adam_beta1(0.9f);
  config.set_adam_beta2(0.999f);
  config.set_adam_eps(1e-8f);
  return config;
}

v1::OuterOptimizerConfig DnConfig(float lr, float beta, uint32_t buffer_size, float c) {
  v1::OuterOptimizerConfig config = Config(v1::OUTER_DELAYED_NESTEROV, lr, beta);
  config.set_dn_buffer_size(buffer_size);
  config.set_dn_momentum_activation(c);
  return config;
}

v1::OuterOptimizerConfig AdamConfig(float lr, float beta1, float beta2, float eps) {
  v1::OuterOptimizerConfig config = Config(v1::OUTER_ADAM, lr, 0.0f);
  config.set_adam_beta1(beta1);
  config.set_adam_beta2(beta2);
  config.set_adam_eps(eps);
  return config;
}

v1::OuterOptimizerConfig StalenessConfig(float exponent, uint32_t max_staleness) {
  v1::OuterOptimizerConfig config = Config(v1::OUTER_NESTEROV, 0.7f, 0.9f);
  config.set_staleness_exponent(exponent);
  config.set_max_staleness(max_staleness);
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
// Delayed Nesterov (paper 002 Alg. 3). Expected values are hand numbers or double-precision
// loops written here from the algorithm, independent of the kernels.

TEST(OuterDelayedNesterovTest, BufferOneWithoutActivationIsNesterovBitForBit) {
  // N = 1: every update is a momentum step with D = g and coefficient (1 - c + c) * beta = beta.
  constexpr size_t kN = 257;
  std::unique_ptr<OuterOptimizer> dn = MakeOrDie(DnConfig(0.7f, 0.9f, 1, 0.0f), kN);
  std::unique_ptr<OuterOptimizer> nesterov = MakeOrDie(Config(v1::OUTER_NESTEROV, 0.7f, 0.9f), kN);
  ASSERT_NE(dn, nullptr);
  ASSERT_NE(nesterov, nullptr);
  EXPECT_EQ(dn->name(), "delayed_nesterov");
  const auto& dn_state = dynamic_cast<const OuterDelayedNesterov&>(*dn);
  const auto& nesterov_state = dynamic_cast<const OuterNesterov&>(*nesterov);
  std::vector<float> a = RandomVector(kN, 1);
  std::vector<float> b = a;
  for (unsigned step = 0; step < 10; ++step) {
    const std::vector<float> g = RandomVector(kN, 100 + step);
    ASSERT_THAT(dn->Apply(g, a, absl::MakeSpan(a)), IsOk());
    ASSERT_THAT(nesterov->Apply(g, b, absl::MakeSpan(b)), IsOk());
    ASSERT_EQ(a, b) << "step " << step;
    ASSERT_TRUE(std::equal(dn_state.momentum().begin(), dn_state.momentum().end(),
                           nesterov_state.momentum().begin()))
        << "step " << step;
    ASSERT_THAT(dn_state.buffer(), ::testing::Each(0.0f));
    ASSERT_EQ(dn_state.num_updates(), step + 1);
  }
}

TEST(OuterDelayedNesterovTest, ZeroActivationIsSgdOfGOverNPlusOneMomentumStepEveryN) {
  // c = 0, N = 4, 3N + 2 updates of random g: every update is an SGD step of g/N; on updates
  // N, 2N, 3N additionally m = beta*m + (mean of the last N g) and theta -= lr*beta*m.
  constexpr size_t kN = 100;
  constexpr uint32_t kBuffer = 4;
  constexpr double kLr = 0.7;
  constexpr double kBeta = 0.9;
  std::unique_ptr<OuterOptimizer> opt = MakeOrDie(DnConfig(0.7f, 0.9f, kBuffer, 0.0f), kN);
  ASSERT_NE(opt, nullptr);
  const auto& dn = dynamic_cast<const OuterDelayedNesterov&>(*opt);
  std::vector<float> theta = RandomVector(kN, 2);
  std::vector<double> expected_theta(theta.begin(), theta.end());
  std::vector<double> expected_m(kN, 0.0);
  std::vector<double> sum_since_momentum(kN, 0.0);
  for (uint32_t t = 0; t < 3 * kBuffer + 2; ++t) {
    const std::vector<float> g = RandomVector(kN, 200 + t);
    ASSERT_THAT(opt->Apply(g, theta, absl::MakeSpan(theta)), IsOk());
    const bool momentum_step = (t + 1) % kBuffer == 0;
    for (size_t i = 0; i < kN; ++i) {
      expected_theta[i] -= kLr * g[i] / kBuffer;  // the SGD step of g/N
      sum_since_momentum[i] += g[i];
      if (momentum_step) {
        expected_m[i] = kBeta * expected_m[i] + sum_since_momentum[i] / kBuffer;
        expected_theta[i] -= kLr * kBeta * expected_m[i];  // the momentum step
        sum_since_momentum[i] = 0;
      }
      ASSERT_NEAR(theta[i], expected_theta[i], 1e-5 * (1 + std::abs(expected_theta[i])))
          << "t=" << t << " i=" << i;
      ASSERT_NEAR(dn.momentum()[i], expected_m[i], 1e-5) << "t=" << t << " i=" << i;
      ASSERT_NEAR(dn.buffer()[i], sum_since_momentum[i], 1e-5) << "t=" << t << " i=" << i;
    }
    ASSERT_EQ(dn.num_updates(), t + 1);
  }
}

// k workers start from the same base theta_r (one version), each runs H local SGD steps on its
// own quadratic 0.5*|x - target_w|^2 with its own step size and returns g_w = theta_r - x_end
// (the DiLoCo sign); all k updates are then applied one after another in one grace batch.
// Returns the k pseudo-gradients of one round.
std::vector<std::vector<float>> WorkerPseudoGradients(
    const std::vector<float>& base, const std::vector<std::vector<float>>& targets,
    int local_steps) {
  std::vector<std::vector<float>> g;
  for (size_t w = 0; w < targets.size(); ++w) {
    const float eta = 0.05f * static_cast<float>(w + 1);
    std::vector<float> x = base;
    for (int h = 0; h < local_steps; ++h) {
      for (size_t i = 0; i < x.size(); ++i) x[i] -= eta * (x[i] - targets[w][i]);
    }
    std::vector<float> gw(base.size());
    for (size_t i = 0; i < base.size(); ++i) gw[i] = base[i] - x[i];
    g.push_back(std::move(gw));
  }
  return g;
}

// Paper 002 footnote 5 (docs/algorithms.md): with N = k and c = 0, the k updates of one buffer
// period, all computed from the same base, leave theta and m exactly where synchronous DiLoCo (one
// Nesterov step on the average g_bar) would:
//   updates 1..k-1:  theta -= lr * g_i / k                       (m unchanged)
//   update k:        m' = beta*m + (sum_i g_i)/k = beta*m + g_bar
//                    theta -= lr * (beta*m' + g_k / k)
//   total:           theta_r - lr * (g_bar + beta*m') = sync Nesterov on g_bar, and m' equal.
// The equality is for the state after the k-th update only (the k-1 intermediate thetas are
// partial SGD steps that sync never exposes), needs the batch to start with an empty buffer
// ((t mod N) == 0), and holds in exact arithmetic; in float it holds to rounding.
TEST(OuterDelayedNesterovTest, BufferOfKUpdatesFromOneBaseEqualsSyncNesterovOnTheirAverage) {
  constexpr size_t kN = 64;
  constexpr uint32_t kWorkers = 4;
  constexpr double kLr = 0.7;
  constexpr double kBeta = 0.9;
  std::unique_ptr<OuterOptimizer> opt = MakeOrDie(DnConfig(0.7f, 0.9f, kWorkers, 0.0f), kN);
  ASSERT_NE(opt, nullptr);
  const auto& dn = dynamic_cast<const OuterDelayedNesterov&>(*opt);
  std::vector<std::vector<float>> targets;
  for (uint32_t w = 0; w < kWorkers; ++w) targets.push_back(RandomVector(kN, 300 + w));

  std::vector<float> theta = RandomVector(kN, 3);              // DN's global parameters
  std::vector<double> sync_theta(theta.begin(), theta.end());  // sync DiLoCo, in double
  std::vector<double> sync_m(kN, 0.0);
  for (int round = 0; round < 3; ++round) {
    const std::vector<float> base = theta;
    const std::vector<std::vector<float>> g = WorkerPseudoGradients(base, targets, 5);
    const std::vector<float> m_before(dn.momentum().begin(), dn.momentum().end());
    std::vector<double> partial(kN, 0.0);
    for (uint32_t w = 0; w < kWorkers; ++w) {
      ASSERT_THAT(opt->Apply(g[w], theta, absl::MakeSpan(theta)), IsOk());
      if (w + 1 == kWorkers) break;
      // Intermediate: a partial SGD step, not a sync state.
      for (size_t i = 0; i < kN; ++i) {
        partial[i] += g[w][i];
        ASSERT_NEAR(theta[i], base[i] - kLr * partial[i] / kWorkers, 1e-5)
            << "round " << round << " after update " << w + 1;
        ASSERT_EQ(dn.momentum()[i], m_before[i]);
      }
    }
    // Sync DiLoCo on the same base: one Nesterov step (Eq. 4) on the average.
    for (size_t i = 0; i < kN; ++i) {
      ASSERT_NEAR(sync_theta[i], base[i], 1e-5) << "round " << round;  // bases agree
      double g_bar = 0;
      for (uint32_t w = 0; w < kWorkers; ++w) g_bar += g[w][i];
      g_bar /= kWorkers;
      sync_m[i] = kBeta * sync_m[i] + g_bar;
      sync_theta[i] -= kLr * (kBeta * sync_m[i] + g_bar);
      ASSERT_NEAR(theta[i], sync_theta[i], 1e-5 * (1 + std::abs(sync_theta[i])))
          << "round " << round << " i=" << i;
      ASSERT_NEAR(dn.momentum()[i], sync_m[i], 1e-5 * (1 + std::abs(sync_m[i])))
          << "round " << round << " i=" << i;
      ASSERT_EQ(dn.buffer()[i], 0.0f);
    }
  }
}

// With c > 0 the claim above does not hold: the k-1 buffer steps use the old momentum m and the
// k-th step scales the new one by (1 - c*k + c), so after the period
//   theta_DN - theta_sync = lr * beta * c * (k - 1) * (m' - m)
// (m' equal in both). The difference is zero only when m' = m. This checks that relation exactly
// (in double) over two periods, so that m != 0 in the second.
TEST(OuterDelayedNesterovTest, WithActivationBufferDiffersFromSyncByOldMomentumTerm) {
  constexpr size_t kN = 32;
  constexpr uint32_t kWorkers = 4;
  constexpr double kLr = 0.7;
  constexpr double kBeta = 0.9;
  constexpr float kC = 0.2f;
  std::unique_ptr<OuterOptimizer> opt = MakeOrDie(DnConfig(0.7f, 0.9f, kWorkers, kC), kN);
  ASSERT_NE(opt, nullptr);
  const auto& dn = dynamic_cast<const OuterDelayedNesterov&>(*opt);
  std::vector<float> theta = RandomVector(kN, 4);
  double max_difference = 0;
  for (int round = 0; round < 2; ++round) {
    const std::vector<float> base = theta;
    const std::vector<double> m_old(dn.momentum().begin(), dn.momentum().end());
    std::vector<std::vector<float>> g;
    for (uint32_t w = 0; w < kWorkers; ++w) g.push_back(RandomVector(kN, 400 + 10 * round + w));
    for (uint32_t w = 0; w < kWorkers; ++w) {
      ASSERT_THAT(opt->Apply(g[w], theta, absl::MakeSpan(theta)), IsOk());
    }
    for (size_t i = 0; i < kN; ++i) {
      double g_bar = 0;
      for (uint32_t w = 0; w < kWorkers; ++w) g_bar += g[w][i];
      g_bar /= kWorkers;
      const double m_new = kBeta * m_old[i] + g_bar;
      const double sync = base[i] - kLr * (kBeta * m_new + g_bar);
      const double difference = kLr * kBeta * double{kC} * (kWorkers - 1) * (m_new - m_old[i]);
      ASSERT_NEAR(dn.momentum()[i], m_new, 1e-5);
      ASSERT_NEAR(theta[i], sync + difference, 1e-5) << "round " << round << " i=" << i;
      max_difference = std::max(max_difference, std::abs(difference));
    }
  }
  EXPECT_GT(max_difference, 0.1);  // the relation is not trivially 0
}

TEST(OuterDelayedNesterovTest, ActivationGoldenNumbersByHand) {
  // N = 2, c = 0.25 (<= 1/N), beta = 0.5, lr = 0.5, theta = {0, 1}; all numbers are short
  // binary fractions, so float is exact. Momentum coefficients: (1 - c*N + c)*beta = 0.375 on
  // momentum steps, c*beta = 0.125 in between.
  std::unique_ptr<OuterOptimizer> opt = MakeOrDie(DnConfig(0.5f, 0.5f, 2, 0.25f), 2);
  ASSERT_NE(opt, nullptr);
  const auto& dn = dynamic_cast<const OuterDelayedNesterov&>(*opt);
  std::vector<float> theta = {0.0f, 1.0f};

  // t=0, buffer step: D = {1, -2}; theta -= 0.5*(0.125*{0, 0} + {0.5, -1}) = {-0.25, 1.5}.
  ASSERT_THAT(opt->Apply(std::vector<float>{1.0f, -2.0f}, theta, absl::MakeSpan(theta)), IsOk());
  EXPECT_THAT(theta, ::testing::ElementsAre(-0.25f, 1.5f));
  EXPECT_THAT(dn.buffer(), ::testing::ElementsAre(1.0f, -2.0f));
  EXPECT_THAT(dn.momentum(), ::testing::ElementsAre(0.0f, 0.0f));

  // t=1, momentum step, g = {3, 0.5}: D = {4, -1.5}; m = 0.5*0 + D/2 = {2, -0.75};
  // theta -= 0.5*(0.375*{2, -0.75} + {1.5, 0.25}) = 0.5*{2.25, -0.03125} = {1.125, -0.015625}
  // -> {-1.375, 1.515625}; D = 0.
  ASSERT_THAT(opt->Apply(std::vector<float>{3.0f, 0.5f}, theta, absl::MakeSpan(theta)), IsOk());
  EXPECT_THAT(dn.momentum(), ::testing::ElementsAre(2.0f, -0.75f));
  EXPECT_THAT(dn.buffer(), ::testing::ElementsAre(0.0f, 0.0f));
  EXPECT_THAT(theta, ::testing::ElementsAre(-1.375f, 1.515625f));

  // t=2, buffer step, g = {-1, 2}: D = {-1, 2};
  // theta -= 0.5*(0.125*{2, -0.75} + {-0.5, 1}) = 0.5*{-0.25, 0.90625} = {-0.125, 0.453125}
  // -> {-1.25, 1.0625}; m unchanged.
  ASSERT_THAT(opt->Apply(std::vector<float>{-1.0f, 2.0f}, theta, absl::MakeSpan(theta)), IsOk());
  EXPECT_THAT(theta, ::testing::ElementsAre(-1.25f, 1.0625f));
  EXPECT_THAT(dn.momentum(), ::testing::ElementsAre(2.0f, -0.75f));
  EXPECT_THAT(dn.buffer(), ::testing::ElementsAre(-1.0f, 2.0f));

  // t=3, momentum step, g = {2, -1}: D = {1, 1}; m = 0.5*{2, -0.75} + {0.5, 0.5} = {1.5, 0.125};
  // theta -= 0.5*(0.375*{1.5, 0.125} + {1, -0.5}) = 0.5*{1.5625, -0.453125}
  // = {0.78125, -0.2265625} -> {-2.03125, 1.2890625}.
  ASSERT_THAT(opt->Apply(std::vector<float>{2.0f, -1.0f}, theta, absl::MakeSpan(theta)), IsOk());
  EXPECT_THAT(dn.momentum(), ::testing::ElementsAre(1.5f, 0.125f));
  EXPECT_THAT(dn.buffer(), ::testing::ElementsAre(0.0f, 0.0f));
  EXPECT_THAT(theta, ::testing::ElementsAre(-2.03125f, 1.2890625f));
  EXPECT_EQ(dn.num_updates(), 4u);
}

TEST(OuterDelayedNesterovTest, SaveLoadMidBufferContinuesIdentically) {
  // Saved after 5 updates with N = 4: t = 5, D holds one update, m one momentum step. The
  // restored copy must flush D on the same (8th) update.
  constexpr size_t kN = 50;
  const v1::OuterOptimizerConfig config = DnConfig(0.7f, 0.9f, 4, 0.1f);
  std::unique_ptr<OuterOptimizer> original = MakeOrDie(config, kN);
  std::unique_ptr<OuterOptimizer> restored = MakeOrDie(config, kN);
  ASSERT_NE(original, nullptr);
  ASSERT_NE(restored, nullptr);
  std::vector<float> theta = RandomVector(kN, 5);
  for (unsigned s = 0; s < 5; ++s) {
    ASSERT_THAT(original->Apply(RandomVector(kN, 500 + s), theta, absl::MakeSpan(theta)), IsOk());
  }
  std::string blob;
  original->SaveState(&blob);
  ASSERT_THAT(restored->LoadState(blob), IsOk());
  const auto& a = dynamic_cast<const OuterDelayedNesterov&>(*original);
  const auto& b = dynamic_cast<const OuterDelayedNesterov&>(*restored);
  EXPECT_EQ(b.num_updates(), 5u);
  EXPECT_TRUE(std::equal(a.buffer().begin(), a.buffer().end(), b.buffer().begin()));
  EXPECT_THAT(b.buffer(), ::testing::Not(::testing::Each(0.0f)));

  std::vector<float> theta_a = theta;
  std::vector<float> theta_b = theta;
  for (unsigned s = 0; s < 7; ++s) {
    const std::vector<float> g = RandomVector(kN, 600 + s);
    ASSERT_THAT(original->Apply(g, theta_a, absl::MakeSpan(theta_a)), IsOk());
    ASSERT_THAT(restored->Apply(g, theta_b, absl::MakeSpan(theta_b)), IsOk());
    ASSERT_EQ(theta_a, theta_b) << "step " << s;  // bit for bit
  }
  EXPECT_EQ(b.num_updates(), 12u);
  std::string blob_a, blob_b;
  original->SaveState(&blob_a);
  restored->SaveState(&blob_b);
  EXPECT_EQ(blob_a, blob_b);
}

// ---------------------------------------------------------------------------------------------
// Outer Adam (Kingma & Ba, with bias correction).

TEST(OuterAdamTest, GoldenNumbersByHand) {
  // lr 0.1, beta1 0.9, beta2 0.999, eps 1e-8, theta = {0, 0}.
  std::unique_ptr<OuterOptimizer> opt = MakeOrDie(AdamConfig(0.1f, 0.9f, 0.999f, 1e-8f), 2);
  ASSERT_NE(opt, nullptr);
  EXPECT_EQ(opt->name(), "adam");
  const auto& adam = dynamic_cast<const OuterAdam&>(*opt);
  std::vector<float> theta = {0.0f, 0.0f};

  // Step 1, g = {1, -2}: m = 0.1 g = {0.1, -0.2}, v = 0.001 g^2 = {0.001, 0.004};
  // m_hat = g, v_hat = g^2, so theta -= 0.1 * g / (|g| + 1e-8) = {-0.1, +0.1} (to 1e-9).
  ASSERT_THAT(opt->Apply(std::vector<float>{1.0f, -2.0f}, theta, absl::MakeSpan(theta)), IsOk());
  EXPECT_NEAR(adam.first_moment()[0], 0.1, 1e-7);
  EXPECT_NEAR(adam.first_moment()[1], -0.2, 1e-7);
  // float(0.999) = 0.99900001287, so 1 - beta2 is 1.3e-5 (relative) below 0.001: v carries that.
  EXPECT_NEAR(adam.second_moment()[0], 0.001, 2e-5 * 0.001);
  EXPECT_NEAR(adam.second_moment()[1], 0.004, 2e-5 * 0.004);
  EXPECT_NEAR(theta[0], -0.1, 1e-7);
  EXPECT_NEAR(theta[1], 0.1, 1e-7);
  EXPECT_EQ(adam.step(), 1u);

  // Step 2, g = {0.5, 0.5}: m = 0.9 m + 0.05 = {0.14, -0.13};
  // v = 0.999 v + 0.001 * 0.25 = {0.001249, 0.004246}; 1 - 0.9^2 = 0.19, 1 - 0.999^2 = 0.001999.
  // Element 0: m_hat = 0.14/0.19 = 0.736842, v_hat = 0.001249/0.001999 = 0.624812,
  //   step = 0.1 * 0.736842 / 0.790451 = 0.0932180 -> theta = -0.1932180.
  // Element 1: m_hat = -0.13/0.19 = -0.684211, v_hat = 0.004246/0.001999 = 2.124062,
  //   step = 0.1 * -0.684211 / 1.457416 = -0.0469468 -> theta = 0.1469468.
  ASSERT_THAT(opt->Apply(std::vector<float>{0.5f, 0.5f}, theta, absl::MakeSpan(theta)), IsOk());
  EXPECT_NEAR(adam.first_moment()[0], 0.14, 1e-7);
  EXPECT_NEAR(adam.first_moment()[1], -0.13, 1e-7);
  EXPECT_NEAR(adam.second_moment()[0], 0.001249, 2e-5 * 0.001249);
  EXPECT_NEAR(adam.second_moment()[1], 0.004246, 2e-5 * 0.004246);
  EXPECT_NEAR(theta[0], -0.1932180, 1e-6);
  EXPECT_NEAR(theta[1], 0.1469468, 1e-6);

  // Step 3, g = {-1, 0.25} (computed the same way): theta = {-0.2042963, 0.1752746}.
  ASSERT_THAT(opt->Apply(std::vector<float>{-1.0f, 0.25f}, theta, absl::MakeSpan(theta)), IsOk());
  EXPECT_NEAR(theta[0], -0.2042963, 1e-6);
  EXPECT_NEAR(theta[1], 0.1752746, 1e-6);
  EXPECT_EQ(adam.step(), 3u);
}

TEST(OuterAdamTest, FollowsDoublePrecisionLoopOverManySteps) {
  constexpr size_t kN = 64;
  constexpr double kLr = 0.05, kBeta1 = 0.8, kBeta2 = 0.99, kEps = 1e-6;
  std::unique_ptr<OuterOptimizer> opt = MakeOrDie(AdamConfig(0.05f, 0.8f, 0.99f, 1e-6f), kN);
  ASSERT_NE(opt, nullptr);
  std::vector<float> theta = RandomVector(kN, 6);
  std::vector<double> expected(theta.begin(), theta.end());
  std::vector<double> m(kN, 0.0), v(kN, 0.0);
  for (int t = 1; t <= 30; ++t) {
    const std::vector<float> g = RandomVector(kN, 700 + t);
    ASSERT_THAT(opt->Apply(g, theta, absl::MakeSpan(theta)), IsOk());
    for (size_t i = 0; i < kN; ++i) {
      m[i] = kBeta1 * m[i] + (1 - kBeta1) * g[i];
      v[i] = kBeta2 * v[i] + (1 - kBeta2) * g[i] * g[i];
      const double m_hat = m[i] / (1 - std::pow(kBeta1, t));
      const double v_hat = v[i] / (1 - std::pow(kBeta2, t));
      expected[i] -= kLr * m_hat / (std::sqrt(v_hat) + kEps);
      ASSERT_NEAR(theta[i], expected[i], 1e-5 * (1 + std::abs(expected[i])))
          << "t=" << t << " i=" << i;
    }
  }
}

TEST(OuterAdamTest, LoadStateRejectsNegativeSecondMoment) {
  constexpr size_t kN = 4;
  std::unique_ptr<OuterOptimizer> opt = MakeOrDie(AdamConfig(0.1f, 0.9f, 0.999f, 1e-8f), kN);
  ASSERT_NE(opt, nullptr);
  std::vector<float> theta(kN, 0.0f);
  ASSERT_THAT(opt->Apply(RandomVector(kN, 7), theta, absl::MakeSpan(theta)), IsOk());
  std::string good;
  opt->SaveState(&good);
  std::string bad = good;
  const float negative = -1.0f;
  std::memcpy(&bad[bad.size() - sizeof(float)], &negative, sizeof(float));  // last v element
  EXPECT_THAT(opt->LoadState(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("negative second moment")));
  std::string after;
  opt->SaveState(&after);
  EXPECT_EQ(after, good);
}

// ---------------------------------------------------------------------------------------------
// Staleness policy (paper 002 'Poly' and 'PolyThres').

float ScaleOrDie(const v1::OuterOptimizerConfig& config, uint64_t staleness) {
  absl::StatusOr<float> scale = StalenessScale(config, staleness);
  EXPECT_THAT(scale, IsOk()) << "staleness " << staleness;
  return scale.ok() ? *scale : -1.0f;
}

TEST(StalenessScaleTest, ExponentZeroIsOffForAnyStaleness) {
  const v1::OuterOptimizerConfig config = StalenessConfig(0.0f, 0);
  for (uint64_t s : {uint64_t{0}, uint64_t{1}, uint64_t{1000}, ~uint64_t{0}}) {
    EXPECT_EQ(ScaleOrDie(config, s), 1.0f) << s;
  }
}

TEST(StalenessScaleTest, PolyDiscountIsOnePlusStalenessToMinusA) {
  // a = 0.5 (paper 002): (1+s)^-0.5.
  const v1::OuterOptimizerConfig half = StalenessConfig(0.5f, 0);
  EXPECT_EQ(ScaleOrDie(half, 0), 1.0f);
  EXPECT_FLOAT_EQ(ScaleOrDie(half, 3), 0.5f);
  EXPECT_FLOAT_EQ(ScaleOrDie(half, 8), 1.0f / 3);
  EXPECT_FLOAT_EQ(ScaleOrDie(half, 15), 0.25f);
  EXPECT_FLOAT_EQ(ScaleOrDie(half, 99), 0.1f);
  // a = 1: 1/(1+s); a = 2: 1/(1+s)^2.
  EXPECT_FLOAT_EQ(ScaleOrDie(StalenessConfig(1.0f, 0), 1), 0.5f);
  EXPECT_FLOAT_EQ(ScaleOrDie(StalenessConfig(1.0f, 0), 4), 0.2f);
  EXPECT_FLOAT_EQ(ScaleOrDie(StalenessConfig(2.0f, 0), 9), 0.01f);
  // No limit (max_staleness 0): huge staleness gives a tiny positive factor, not 0 or NaN.
  const float tiny = ScaleOrDie(half, ~uint64_t{0});
  EXPECT_GT(tiny, 0.0f);
  EXPECT_NEAR(tiny, std::pow(2.0, -32), 1e-12);
}

TEST(StalenessScaleTest, DropsUpdatesBeyondMaxStaleness) {
  // PolyThres (paper 002: discard staleness beyond 10): staleness 10 is kept, 11 dropped.
  const v1::OuterOptimizerConfig config = StalenessConfig(0.5f, 10);
  EXPECT_FLOAT_EQ(ScaleOrDie(config, 10), static_cast<float>(1 / std::sqrt(11.0)));
  EXPECT_THAT(StalenessScale(config, 11),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("update staleness 11 exceeds max_staleness 10")));
  // The threshold also applies without a discount.
  EXPECT_THAT(StalenessScale(StalenessConfig(0.0f, 2), 3),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("update staleness 3 exceeds max_staleness 2")));
  EXPECT_EQ(ScaleOrDie(StalenessConfig(0.0f, 2), 2), 1.0f);
}

TEST(StalenessScaleTest, RejectsNegativeOrNonFiniteExponent) {
  for (float a :
       {-0.5f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    EXPECT_THAT(StalenessScale(StalenessConfig(a, 0), 1),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("outer_optimizer.staleness_exponent")))
        << a;
    EXPECT_THAT(MakeOuterOptimizer(StalenessConfig(a, 0), 4),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("outer_optimizer.staleness_exponent")))
        << a;
  }
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
  std::unique_ptr<OuterOptimizer> dn = MakeOrDie(DnConfig(0.7f, 0.9f, 4, 0.1f), 4);
  std::unique_ptr<OuterOptimizer> adam = MakeOrDie(AdamConfig(0.01f, 0.9f, 0.999f, 1e-8f), 4);
  ASSERT_NE(dn, nullptr);
  ASSERT_NE(adam, nullptr);
  EXPECT_NE(dynamic_cast<OuterDelayedNesterov*>(dn.get()), nullptr);
  EXPECT_NE(dynamic_cast<OuterAdam*>(adam.get()), nullptr);
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
       {v1::OUTER_OPTIMIZER_UNSPECIFIED, v1::OUTER_SGD, v1::OUTER_NESTEROV,
        v1::OUTER_DELAYED_NESTEROV, v1::OUTER_ADAM}) {
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
  for (v1::OuterOptimizerType type :
       {v1::OUTER_OPTIMIZER_UNSPECIFIED, v1::OUTER_NESTEROV, v1::OUTER_DELAYED_NESTEROV}) {
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

TEST(MakeOuterOptimizerTest, ValidatesDelayedNesterovBufferSize) {
  for (uint32_t n : {0u, 1000001u}) {
    EXPECT_THAT(MakeOuterOptimizer(DnConfig(0.7f, 0.9f, n, 0.0f), 4),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("outer_optimizer.dn_buffer_size must be in [1, 1000000]")))
        << n;
  }
  EXPECT_THAT(MakeOuterOptimizer(DnConfig(0.7f, 0.9f, 1, 0.0f), 4), IsOk());
  EXPECT_THAT(MakeOuterOptimizer(DnConfig(0.7f, 0.9f, 1000000, 0.0f), 4), IsOk());
}

TEST(MakeOuterOptimizerTest, ValidatesDelayedNesterovActivationInZeroToOneOverN) {
  const float bad_c[] = {-0.01f, 0.26f, 1.0f, std::numeric_limits<float>::quiet_NaN(),
                         std::numeric_limits<float>::infinity()};
  for (float c : bad_c) {
    EXPECT_THAT(MakeOuterOptimizer(DnConfig(0.7f, 0.9f, 4, c), 4),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("outer_optimizer.dn_momentum_activation must be in [0, 1/N")))
        << c;
  }
  EXPECT_THAT(MakeOuterOptimizer(DnConfig(0.7f, 0.9f, 4, 0.0f), 4), IsOk());
  EXPECT_THAT(MakeOuterOptimizer(DnConfig(0.7f, 0.9f, 4, 0.25f), 4), IsOk());
  // float(1/3) is slightly above 1/3 in double: still the upper end of the range.
  EXPECT_THAT(MakeOuterOptimizer(DnConfig(0.7f, 0.9f, 3, 1.0f / 3), 4), IsOk());
  EXPECT_THAT(MakeOuterOptimizer(DnConfig(0.7f, 0.9f, 1, 1.0f), 4), IsOk());
}

// The factory and the config loader share one check (common/config.h): c = float(1/N) is the
// upper end for every N, the next float up is refused, with the loader's message.
TEST(MakeOuterOptimizerTest, ActivationBoundaryIsTheLoaders) {
  for (uint32_t n = 1; n <= 16; ++n) {
    const float top = 1.0f / n;
    EXPECT_THAT(MakeOuterOptimizer(DnConfig(0.7f, 0.9f, n, top), 4), IsOk()) << n;
    v1::ServerConfig server;
    server.set_corpus_dir("c");
    *server.mutable_outer_optimizer() = DnConfig(0.7f, 0.9f, n, std::nextafter(top, 2.0f));
    FillServerDefaults(&server);
    const absl::Status loader = ValidateServerConfig(server);
    EXPECT_THAT(loader, StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("outer_optimizer.dn_momentum_activation")))
        << n;
    EXPECT_EQ(MakeOuterOptimizer(server.outer_optimizer(), 4).status(), loader) << n;
  }
}

TEST(MakeOuterOptimizerTest, ValidatesAdamFields) {
  const float bad_betas[] = {1.0f, 1.5f, -0.1f, std::numeric_limits<float>::quiet_NaN()};
  for (float beta : bad_betas) {
    EXPECT_THAT(
        MakeOuterOptimizer(AdamConfig(0.1f, beta, 0.999f, 1e-8f), 4),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outer_optimizer.adam_beta1")))
        << beta;
    EXPECT_THAT(
        MakeOuterOptimizer(AdamConfig(0.1f, 0.9f, beta, 1e-8f), 4),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outer_optimizer.adam_beta2")))
        << beta;
  }
  for (float eps : {0.0f, -1e-8f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    EXPECT_THAT(MakeOuterOptimizer(AdamConfig(0.1f, 0.9f, 0.999f, eps), 4),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outer_optimizer.adam_eps")))
        << eps;
  }
  EXPECT_THAT(MakeOuterOptimizer(AdamConfig(0.1f, 0.0f, 0.0f, 1e-8f), 4), IsOk());
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
  // DN with N = 3 and c > 0, so that a few steps cross a momentum step and read m in between.
  v1::OuterOptimizerConfig config() const {
    if (GetParam() == v1::OUTER_DELAYED_NESTEROV) return DnConfig(0.7f, 0.9f, 3, 0.1f);
    return Config(GetParam(), 0.7f, 0.9f);
  }

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
                         ::testing::Values(v1::OUTER_SGD, v1::OUTER_NESTEROV,
                                           v1::OUTER_DELAYED_NESTEROV, v1::OUTER_ADAM),
                         [](const ::testing::TestParamInfo<v1::OuterOptimizerType>& info) {
                           return v1::OuterOptimizerType_Name(info.param);
                         });

}  // namespace
}  // namespace aloe::server
