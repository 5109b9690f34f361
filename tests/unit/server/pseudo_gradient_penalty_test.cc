// Golden tests of the EDiT pseudo-gradient penalty (paper 000 Sec. 3.2, Alg. 2; docs/algorithms.md,
// "EDiT pseudo-gradient penalty"). Expected numbers are worked out by hand in the comments or
// recomputed here with plain double loops, never taken from the implementation.
#include "server/core/pseudo_gradient_penalty.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "common/executor.h"
#include "common/status_matchers.h"
#include "server/core/parameter_store.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::_;
using ::testing::HasSubstr;

// alpha = 0.5 keeps the EMA arithmetic exact by hand: the norms 1, 3, 2 give
//   1: mu = 1, sigma = 0                      (first norm initialises)
//   3: mu = 0.5*3 + 0.5*1 = 2, sigma = sqrt(0.5*0 + 0.5*(3-2)^2)   = sqrt(0.5)
//   2: mu = 0.5*2 + 0.5*2 = 2, sigma = sqrt(0.5*0.5 + 0.5*(2-2)^2) = 0.5
v1::PenaltyConfig HandConfig() {
  v1::PenaltyConfig config;
  config.set_enabled(true);
  config.set_ema_alpha(0.5f);
  config.set_z_threshold(3.0f);
  config.set_warmup(3);
  config.set_temperature(1.0f);
  config.set_clip_norm(10.0f);
  return config;
}

std::unique_ptr<PseudoGradientPenalty> Make(const v1::PenaltyConfig& config, size_t modules = 1) {
  auto penalty = PseudoGradientPenalty::Create(config, modules);
  EXPECT_THAT(penalty, IsOk());
  return *std::move(penalty);
}

// Feeds streams `streams` the norms 1, 3, 2 (all equal within a round) so that each ends at
// mu = 2, sigma = 0.5, count = 3 (= warmup: the next norm is tested).
void WarmUp(PseudoGradientPenalty& penalty, std::vector<uint64_t> streams, size_t module = 0) {
  for (double g : {1.0, 3.0, 2.0}) {
    std::vector<double> norms(streams.size(), g);
    auto report = penalty.Weigh(module, streams, norms);
    ASSERT_THAT(report, IsOk());
    for (const auto& u : report->updates) ASSERT_FALSE(u.anomalous);
  }
}

TEST(PseudoGradientPenaltyTest, EmaStatisticsAfterAKnownSequenceByHand) {
  auto penalty = Make(HandConfig());
  WarmUp(*penalty, {7});
  const auto s = penalty->Stats(0, 7);
  ASSERT_TRUE(s.has_value());
  EXPECT_DOUBLE_EQ(s->mu, 2.0);
  EXPECT_DOUBLE_EQ(s->sigma, 0.5);
  EXPECT_EQ(s->count, 3u);
  EXPECT_FALSE(penalty->Stats(0, 8).has_value());
}

TEST(PseudoGradientPenaltyTest, EmaStatisticsWithDefaultAlphaMatchEquationOne) {
  v1::PenaltyConfig config = HandConfig();
  config.set_ema_alpha(0.02f);
  config.set_warmup(1000);  // no anomaly checks: every norm is folded in
  auto penalty = Make(config);
  const double norms[] = {5.0, 4.0, 4.5, 3.9, 4.2, 6.0, 3.0, 3.5, 3.4, 3.6, 2.9, 3.1};
  // Eq. 1 in double, first norm as initial mean, sigma starting at 0.
  const double alpha = static_cast<double>(0.02f);
  double mu = norms[0];
  double sigma = 0;
  for (size_t i = 0; i < std::size(norms); ++i) {
    ASSERT_THAT(penalty->Weigh(0, {1}, {norms[i]}), IsOk());
    if (i > 0) {
      const double mu_next = alpha * norms[i] + (1 - alpha) * mu;
      sigma = std::sqrt((1 - alpha) * sigma * sigma +
                        alpha * (norms[i] - mu_next) * (norms[i] - mu_next));
      mu = mu_next;
    }
  }
  const auto s = penalty->Stats(0, 1);
  ASSERT_TRUE(s.has_value());
  EXPECT_NEAR(s->mu, mu, 1e-12);
  EXPECT_NEAR(s->sigma, sigma, 1e-12);
  EXPECT_EQ(s->count, std::size(norms));
}

TEST(PseudoGradientPenaltyTest, FiveSigmaOutlierGetsWeightZeroOthersExactSoftmax) {
  auto penalty = Make(HandConfig());
  WarmUp(*penalty, {1, 2, 3});
  // Every stream: mu = 2, sigma = 0.5. Norms 2.25, 1.5, 4.5 have z = 0.5, -1, 5.
  // Pseudo-gradients along different axes so that the norms are exact in float.
  const std::vector<float> g1 = {2.25f, 0, 0};
  const std::vector<float> g2 = {0, 1.5f, 0};
  const std::vector<float> g3 = {0, 0, 4.5f};
  std::vector<float> out(3, -7.0f);
  auto report = penalty->AggregateModule(0, {1, 2, 3}, {g1, g2, g3}, absl::MakeSpan(out));
  ASSERT_THAT(report, IsOk());
  ASSERT_EQ(report->updates.size(), 3u);
  EXPECT_DOUBLE_EQ(report->updates[0].z_score, 0.5);
  EXPECT_DOUBLE_EQ(report->updates[1].z_score, -1.0);
  EXPECT_DOUBLE_EQ(report->updates[2].z_score, 5.0);
  EXPECT_FALSE(report->updates[0].anomalous);
  EXPECT_FALSE(report->updates[1].anomalous);
  EXPECT_TRUE(report->updates[2].anomalous);
  // w = exp(-G_i) / (exp(-2.25) + exp(-1.5)) over the two survivors:
  // w1 = 1 / (1 + e^0.75) = 0.32082130082460703, w2 = 1 / (1 + e^-0.75) = 0.679178699175393.
  EXPECT_NEAR(report->updates[0].weight, 0.32082130082460703, 1e-15);
  EXPECT_NEAR(report->updates[1].weight, 0.679178699175393, 1e-15);
  EXPECT_EQ(report->updates[2].weight, 0.0);
  EXPECT_FALSE(report->rollback);
  // g_bar = w1 g1 + w2 g2; its norm is far below phi = 10, so no clipping.
  EXPECT_EQ(report->clip_coefficient, 1.0);
  EXPECT_FLOAT_EQ(out[0], static_cast<float>(0.32082130082460703 * 2.25));
  EXPECT_FLOAT_EQ(out[1], static_cast<float>(0.679178699175393 * 1.5));
  EXPECT_EQ(out[2], 0.0f);
  EXPECT_NEAR(report->aggregated_norm,
              std::hypot(0.32082130082460703 * 2.25, 0.679178699175393 * 1.5), 1e-6);
}

TEST(PseudoGradientPenaltyTest, OnlyNonAnomalousNormsUpdateTheStatistics) {
  auto penalty = Make(HandConfig());
  WarmUp(*penalty, {1, 2, 3});
  ASSERT_THAT(penalty->Weigh(0, {1, 2, 3}, {2.25, 1.5, 4.5}), IsOk());
  // Stream 1 folded 2.25: mu = 0.5*2.25 + 0.5*2 = 2.125,
  //   sigma = sqrt(0.5*0.25 + 0.5*(2.25-2.125)^2) = sqrt(0.1328125).
  const auto s1 = penalty->Stats(0, 1);
  EXPECT_DOUBLE_EQ(s1->mu, 2.125);
  EXPECT_DOUBLE_EQ(s1->sigma, std::sqrt(0.1328125));
  EXPECT_EQ(s1->count, 4u);
  // Stream 2 folded 1.5: mu = 1.75, sigma = sqrt(0.125 + 0.5*0.0625) = sqrt(0.15625).
  EXPECT_DOUBLE_EQ(penalty->Stats(0, 2)->mu, 1.75);
  EXPECT_DOUBLE_EQ(penalty->Stats(0, 2)->sigma, std::sqrt(0.15625));
  // Stream 3 (anomalous, G = +inf) is untouched.
  const auto s3 = penalty->Stats(0, 3);
  EXPECT_DOUBLE_EQ(s3->mu, 2.0);
  EXPECT_DOUBLE_EQ(s3->sigma, 0.5);
  EXPECT_EQ(s3->count, 3u);
}

TEST(PseudoGradientPenaltyTest, ThresholdIsStrictAndNegativeZIsNeverAnomalous) {
  auto penalty = Make(HandConfig());
  WarmUp(*penalty, {1, 2});
  // z = (3.5 - 2)/0.5 = 3 exactly (not > 3); z = (0 - 2)/0.5 = -4 (small norms are fine).
  auto report = penalty->Weigh(0, {1, 2}, {3.5, 0.0});
  ASSERT_THAT(report, IsOk());
  EXPECT_DOUBLE_EQ(report->updates[0].z_score, 3.0);
  EXPECT_FALSE(report->updates[0].anomalous);
  EXPECT_DOUBLE_EQ(report->updates[1].z_score, -4.0);
  EXPECT_FALSE(report->updates[1].anomalous);
}

TEST(PseudoGradientPenaltyTest, NoAnomalyDuringWarmup) {
  auto penalty = Make(HandConfig());  // warmup 3
  ASSERT_THAT(penalty->Weigh(0, {1}, {1.0}), IsOk());
  ASSERT_THAT(penalty->Weigh(0, {1}, {3.0}), IsOk());
  // Two norms folded (mu = 2, sigma = sqrt(0.5)): 100 has z = 138.6 but is not tested yet.
  auto report = penalty->Weigh(0, {1}, {100.0});
  ASSERT_THAT(report, IsOk());
  EXPECT_NEAR(report->updates[0].z_score, 98.0 / std::sqrt(0.5), 1e-9);
  EXPECT_FALSE(report->updates[0].anomalous);
  EXPECT_EQ(report->updates[0].weight, 1.0);
  EXPECT_EQ(penalty->Stats(0, 1)->count, 3u);
  EXPECT_DOUBLE_EQ(penalty->Stats(0, 1)->mu, 51.0);  // 0.5*100 + 0.5*2
}

TEST(PseudoGradientPenaltyTest, AllAnomalousRollsBack) {
  auto penalty = Make(HandConfig());
  WarmUp(*penalty, {1, 2});
  const std::vector<float> g1 = {4.5f, 0};  // z = 5
  const std::vector<float> g2 = {0, 6.0f};  // z = 8
  std::vector<float> out(2);
  auto report = penalty->AggregateModule(0, {1, 2}, {g1, g2}, absl::MakeSpan(out));
  ASSERT_THAT(report, IsOk());
  EXPECT_TRUE(report->rollback);
  EXPECT_TRUE(report->updates[0].anomalous);
  EXPECT_TRUE(report->updates[1].anomalous);
  EXPECT_EQ(report->updates[0].weight, 0.0);
  EXPECT_EQ(report->updates[1].weight, 0.0);
  EXPECT_EQ(report->clip_coefficient, 0.0);
  EXPECT_EQ(penalty->Stats(0, 1)->count, 3u);
  EXPECT_EQ(penalty->Stats(0, 2)->count, 3u);
}

TEST(PseudoGradientPenaltyTest, SingleUpdateGetsWeightOneButIsStillTestedAndClipped) {
  auto penalty = Make(HandConfig());
  WarmUp(*penalty, {1});
  const std::vector<float> g = {1.2f, -1.6f};  // norm 2, z = 0
  std::vector<float> out(2);
  auto report = penalty->AggregateModule(0, {1}, {g}, absl::MakeSpan(out));
  ASSERT_THAT(report, IsOk());
  EXPECT_EQ(report->updates[0].weight, 1.0);
  EXPECT_EQ(out, g);  // weight exactly 1: copied bit for bit, no clipping below phi

  const std::vector<float> spike = {4.5f, 0};  // z = (4.5 - mu)/sigma > 3
  report = penalty->AggregateModule(0, {1}, {spike}, absl::MakeSpan(out));
  ASSERT_THAT(report, IsOk());
  EXPECT_TRUE(report->updates[0].anomalous);
  EXPECT_TRUE(report->rollback);
}

TEST(PseudoGradientPenaltyTest, ClipCoefficientIsExact) {
  auto penalty = Make(HandConfig());             // phi = 10
  const std::vector<float> g = {12.0f, -16.0f};  // norm 20 (fresh stream: never anomalous)
  std::vector<float> out(2);
  auto report = penalty->AggregateModule(0, {1}, {g}, absl::MakeSpan(out));
  ASSERT_THAT(report, IsOk());
  const double beta = 10.0 / (20.0 + 1e-6);  // Eq. 4
  EXPECT_DOUBLE_EQ(report->aggregated_norm, 20.0);
  EXPECT_DOUBLE_EQ(report->clip_coefficient, beta);
  EXPECT_FLOAT_EQ(out[0], static_cast<float>(12.0 * beta));
  EXPECT_FLOAT_EQ(out[1], static_cast<float>(-16.0 * beta));
  EXPECT_NEAR(std::hypot(out[0], out[1]), 10.0, 1e-5);
  EXPECT_DOUBLE_EQ(penalty->ClipCoefficient(9.0), 1.0);
  EXPECT_DOUBLE_EQ(penalty->ClipCoefficient(0.0), 1.0);
  EXPECT_DOUBLE_EQ(penalty->ClipCoefficient(1e6), 10.0 / (1e6 + 1e-6));
}

TEST(PseudoGradientPenaltyTest, SoftmaxIsSafeForHugeNormsAndUsesTheTemperature) {
  auto penalty = Make(HandConfig());
  // Fresh streams: nothing anomalous. exp(-1e6) underflows; the shifted softmax does not care.
  auto report = penalty->Weigh(0, {1, 2, 3}, {1e6, 1e6 + 1, 2e6});
  ASSERT_THAT(report, IsOk());
  EXPECT_NEAR(report->updates[0].weight, 1 / (1 + std::exp(-1.0)), 1e-15);
  EXPECT_NEAR(report->updates[1].weight, 1 / (1 + std::exp(1.0)), 1e-15);
  EXPECT_EQ(report->updates[2].weight, 0.0);
  EXPECT_FALSE(report->rollback);

  report = penalty->Weigh(0, {4, 5}, {1000.0, 1000.0});  // naively 0/0
  ASSERT_THAT(report, IsOk());
  EXPECT_EQ(report->updates[0].weight, 0.5);
  EXPECT_EQ(report->updates[1].weight, 0.5);

  v1::PenaltyConfig hot = HandConfig();
  hot.set_temperature(2.0f);
  auto warm = Make(hot);
  report = warm->Weigh(0, {1, 2}, {1.0, 3.0});  // exp(-1/2) : exp(-3/2)
  ASSERT_THAT(report, IsOk());
  EXPECT_NEAR(report->updates[0].weight, 1 / (1 + std::exp(-1.0)), 1e-15);
  EXPECT_NEAR(report->updates[1].weight, 1 / (1 + std::exp(1.0)), 1e-15);
}

TEST(PseudoGradientPenaltyTest, SeveralUpdatesOfOneStreamAreTestedAgainstTheSameStatistics) {
  auto penalty = Make(HandConfig());
  WarmUp(*penalty, {1});
  auto report = penalty->Weigh(0, {1, 1}, {2.5, 4.5});  // z = 1 and 5 against mu 2, sigma 0.5
  ASSERT_THAT(report, IsOk());
  EXPECT_DOUBLE_EQ(report->updates[0].z_score, 1.0);
  EXPECT_DOUBLE_EQ(report->updates[1].z_score, 5.0);
  EXPECT_FALSE(report->updates[0].anomalous);
  EXPECT_TRUE(report->updates[1].anomalous);
  EXPECT_EQ(report->updates[0].weight, 1.0);
  // Only 2.5 folded: mu = 2.25, sigma = sqrt(0.5*0.25 + 0.5*0.0625).
  EXPECT_DOUBLE_EQ(penalty->Stats(0, 1)->mu, 2.25);
  EXPECT_DOUBLE_EQ(penalty->Stats(0, 1)->sigma, std::sqrt(0.15625));
}

TEST(PseudoGradientPenaltyTest, ModulesAndStreamsAreIndependentAndForgettable) {
  auto penalty = Make(HandConfig(), 2);
  WarmUp(*penalty, {1}, /*module=*/0);
  EXPECT_FALSE(penalty->Stats(1, 1).has_value());
  // Module 1 has never seen stream 1: 4.5 there initialises, it is not an outlier.
  auto report = penalty->Weigh(1, {1}, {4.5});
  ASSERT_THAT(report, IsOk());
  EXPECT_FALSE(report->updates[0].anomalous);
  penalty->ForgetStream(1);
  EXPECT_FALSE(penalty->Stats(0, 1).has_value());
  EXPECT_FALSE(penalty->Stats(1, 1).has_value());
}

TEST(PseudoGradientPenaltyTest, BadInputIsRejectedAndChangesNothing) {
  auto penalty = Make(HandConfig(), 2);
  WarmUp(*penalty, {1});
  std::string before;
  penalty->SaveState(&before);
  const double nan = std::nan("");
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_THAT(penalty->Weigh(2, {1}, {1.0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("module 2")));
  EXPECT_THAT(penalty->Weigh(0, {}, {}), StatusIs(absl::StatusCode::kInvalidArgument, _));
  EXPECT_THAT(penalty->Weigh(0, {1, 2}, {1.0}), StatusIs(absl::StatusCode::kInvalidArgument, _));
  EXPECT_THAT(penalty->Weigh(0, {1, 2}, {1.0, -1.0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("norm")));
  EXPECT_THAT(penalty->Weigh(0, {1, 2}, {2.0, nan}),
              StatusIs(absl::StatusCode::kInvalidArgument, _));
  EXPECT_THAT(penalty->Weigh(0, {1, 2}, {2.0, inf}),
              StatusIs(absl::StatusCode::kInvalidArgument, _));
  const std::vector<float> g = {1, 2};
  const std::vector<float> short_g = {1};
  std::vector<float> out(2);
  EXPECT_THAT(penalty->AggregateModule(0, {1, 2}, {g, short_g}, absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("elements")));
  EXPECT_THAT(penalty->AggregateModule(0, {1}, {g, g}, absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, _));
  std::string after;
  penalty->SaveState(&after);
  EXPECT_EQ(before, after);
}

TEST(PseudoGradientPenaltyTest, CreateValidatesTheConfig) {
  v1::PenaltyConfig c = HandConfig();
  c.set_ema_alpha(0);
  EXPECT_THAT(PseudoGradientPenalty::Create(c, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("penalty.ema_alpha")));
  c = HandConfig();
  c.set_ema_alpha(1.5f);
  EXPECT_THAT(PseudoGradientPenalty::Create(c, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("penalty.ema_alpha")));
  c = HandConfig();
  c.set_temperature(0);
  EXPECT_THAT(PseudoGradientPenalty::Create(c, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("penalty.temperature")));
  c = HandConfig();
  c.set_clip_norm(-1);
  EXPECT_THAT(PseudoGradientPenalty::Create(c, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("penalty.clip_norm")));
  c = HandConfig();
  c.set_z_threshold(std::numeric_limits<float>::infinity());
  EXPECT_THAT(PseudoGradientPenalty::Create(c, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("penalty.z_threshold")));
}

TEST(PseudoGradientPenaltyTest, StateRoundTripsAndBadBlobsChangeNothing) {
  auto a = Make(HandConfig(), 2);
  WarmUp(*a, {1, 5}, 0);
  WarmUp(*a, {9}, 1);
  std::string blob;
  a->SaveState(&blob);

  auto b = Make(HandConfig(), 2);
  ASSERT_THAT(b->LoadState(blob), IsOk());
  std::string again;
  b->SaveState(&again);
  EXPECT_EQ(again, blob);
  for (uint64_t stream : {1, 5}) {
    EXPECT_DOUBLE_EQ(b->Stats(0, stream)->mu, 2.0);
    EXPECT_DOUBLE_EQ(b->Stats(0, stream)->sigma, 0.5);
    EXPECT_EQ(b->Stats(0, stream)->count, 3u);
  }
  EXPECT_EQ(b->Stats(1, 9)->count, 3u);
  // The restored penalty decides exactly like the original.
  auto ra = a->Weigh(0, {1, 5}, {2.25, 4.5});
  auto rb = b->Weigh(0, {1, 5}, {2.25, 4.5});
  ASSERT_THAT(ra, IsOk());
  ASSERT_THAT(rb, IsOk());
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(ra->updates[i].anomalous, rb->updates[i].anomalous);
    EXPECT_EQ(ra->updates[i].weight, rb->updates[i].weight);
  }
  EXPECT_TRUE(rb->updates[1].anomalous);

  auto c = Make(HandConfig(), 2);
  WarmUp(*c, {3}, 1);
  std::string c_before;
  c->SaveState(&c_before);
  EXPECT_THAT(c->LoadState(blob.substr(0, blob.size() - 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, _));
  EXPECT_THAT(c->LoadState(blob + "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("trailing")));
  EXPECT_THAT(c->LoadState("nonsense"), StatusIs(absl::StatusCode::kInvalidArgument, _));
  auto three = Make(HandConfig(), 3);
  EXPECT_THAT(three->LoadState(blob),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("modules")));
  std::string corrupt = blob;
  const double negative = -1.0;
  // The first entry's mu sits after magic, version, module count, stream count, stream, count.
  std::memcpy(&corrupt[4 + 4 + 8 + 8 + 8 + 8], &negative, sizeof(negative));
  EXPECT_THAT(c->LoadState(corrupt),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("invalid statistics")));
  std::string c_after;
  c->SaveState(&c_after);
  EXPECT_EQ(c_after, c_before);
}

// Through the parameter store: a rolled-back layer keeps its parameters and its optimizer state,
// while the other layer of the same step is applied.
TEST(PseudoGradientPenaltyTest, RollbackLeavesTheLayerAndItsMomentumUntouched) {
  v1::ModelSpec spec;
  spec.set_num_shards(2);
  for (uint32_t i = 0; i < 2; ++i) {
    v1::LayerSpec* layer = spec.add_layers();
    layer->set_id(i);
    layer->set_name(i == 0 ? "a" : "b");
    layer->set_num_elements(i == 0 ? 3 : 2);
    layer->set_shard(i);
  }
  v1::OuterOptimizerConfig nesterov;
  nesterov.set_type(v1::OUTER_NESTEROV);
  nesterov.set_lr(1.0f);
  nesterov.set_momentum(0.5f);
  ThreadPoolExecutor executor(2);
  auto store = ParameterStore::Create(spec, {{0, 0, 0}, {0, 0}}, nesterov, executor);
  ASSERT_THAT(store, IsOk());
  auto penalty = Make(HandConfig(), 2);

  auto update = [](uint64_t worker, float a, float b) {
    PendingUpdate u;
    u.worker_id = worker;
    u.layers = {{a, 0, 0}, {0, b}};
    return u;
  };
  auto step = [&](float a1, float a2, float b1, float b2) {
    const PendingUpdate u1 = update(1, a1, b1);
    const PendingUpdate u2 = update(2, a2, b2);
    PenaltyAggregation aggregation(*penalty);
    EXPECT_THAT((*store)->ApplyOuterStep({&u1, &u2}, aggregation), IsOk());
    return aggregation.reports();
  };
  // Warmup: equal norms 1, 3, 2 in both layers (weights 1/2 each: g_bar = the common g).
  // Nesterov lr 1, beta 0.5 on layer a, element 0: m = 1, 3.5, 3.75;
  // theta = -(0.5*1 + 1) - (0.5*3.5 + 3) - (0.5*3.75 + 2) = -1.5 - 4.75 - 3.875 = -10.125.
  step(1, 1, 1, 1);
  step(3, 3, 3, 3);
  step(2, 2, 2, 2);
  const ModelSnapshot warm = (*store)->Snapshot();
  EXPECT_FLOAT_EQ((*warm.layers[0])[0], -10.125f);

  // Layer a: both updates have z = 5 -> rollback. Layer b: z = 0 -> applied.
  auto reports = step(4.5f, 4.5f, 2, 2);
  EXPECT_TRUE(reports[0].rollback);
  EXPECT_FALSE(reports[1].rollback);
  EXPECT_EQ((*store)->version(), 4u);
  const ModelSnapshot after = (*store)->Snapshot();
  EXPECT_EQ(*after.layers[0], *warm.layers[0]);  // not even Nesterov's momentum term moved it
  EXPECT_NE(*after.layers[1], *warm.layers[1]);

  // Next step on layer a continues from the momentum of step 3: m = 0.5*3.75 + 2 = 3.875,
  // theta -= 0.5*3.875 + 2 = 3.9375.
  reports = step(2, 2, 2, 2);
  EXPECT_FALSE(reports[0].rollback);
  EXPECT_FLOAT_EQ((*(*store)->Snapshot().layers[0])[0], -10.125f - 3.9375f);
}

}  // namespace
}  // namespace aloe::server
