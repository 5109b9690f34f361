// The synthetic objective: targets, loss, noisy SGD steps and the pseudo-gradient, checked
// against values computed independently in double precision.
#include "sim/synthetic_trainer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "common/status_matchers.h"

namespace aloe::sim {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

// Two layers of 3 and 2 elements.
v1::ModelSpec TinySpec() {
  v1::ModelSpec spec;
  spec.add_layers()->set_num_elements(3);
  spec.add_layers()->set_num_elements(2);
  return spec;
}

std::vector<server::DataShard> TwoShards() { return {{"a", "a.tok", 100}, {"b", "b.tok", 300}}; }

double HandLoss(const std::vector<std::vector<float>>& x,
                const std::vector<std::vector<float>>& t) {
  double sum = 0;
  double n = 0;
  for (size_t l = 0; l < x.size(); ++l) {
    for (size_t i = 0; i < x[l].size(); ++i) {
      sum += (double(x[l][i]) - t[l][i]) * (double(x[l][i]) - t[l][i]);
      ++n;
    }
  }
  return 0.5 * sum / n;
}

TEST(SyntheticObjectiveTest, TargetsAreSeededAndShardsDiffer) {
  auto a = SyntheticObjective::Create(TinySpec(), TwoShards(), {});
  auto b = SyntheticObjective::Create(TinySpec(), TwoShards(), {});
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ((*a)->target(0), (*b)->target(0));
  EXPECT_EQ((*a)->target(1), (*b)->target(1));
  EXPECT_NE((*a)->target(0), (*a)->target(1));
  EXPECT_EQ((*a)->num_parameters(), 5u);
  SyntheticObjectiveOptions other;
  other.seed = 2;
  auto c = SyntheticObjective::Create(TinySpec(), TwoShards(), other);
  ASSERT_THAT(c, IsOk());
  EXPECT_NE((*a)->target(0), (*c)->target(0));
  // With no shard spread all shards share the common target.
  SyntheticObjectiveOptions same;
  same.shard_spread = 0;
  auto d = SyntheticObjective::Create(TinySpec(), TwoShards(), same);
  ASSERT_THAT(d, IsOk());
  EXPECT_EQ((*d)->target(0), (*d)->target(1));
}

TEST(SyntheticObjectiveTest, EvalLossIsTheSizeWeightedMeanOfShardLosses) {
  auto o = SyntheticObjective::Create(TinySpec(), TwoShards(), {});
  ASSERT_THAT(o, IsOk());
  const std::vector<std::vector<float>> x = {{0.1f, -0.2f, 0.3f}, {1.0f, 0.0f}};
  const double l0 = HandLoss(x, (*o)->target(0));
  const double l1 = HandLoss(x, (*o)->target(1));
  EXPECT_NEAR((*o)->Loss(0, x), l0, 1e-12);
  EXPECT_NEAR((*o)->Loss(1, x), l1, 1e-12);
  EXPECT_NEAR((*o)->EvalLoss(x), 0.25 * l0 + 0.75 * l1, 1e-12);
  EXPECT_NEAR((*o)->Loss(0, (*o)->target(0)), 0, 1e-15);
}

TEST(SyntheticObjectiveTest, RejectsBadInputs) {
  EXPECT_THAT(SyntheticObjective::Create(TinySpec(), {}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shards")));
  EXPECT_THAT(SyntheticObjective::Create(TinySpec(), {{"a", "a", 0}}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no tokens")));
  EXPECT_THAT(SyntheticObjective::Create(TinySpec(), {{"a", "a", 1}, {"a", "b", 1}}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("duplicate")));
  SyntheticObjectiveOptions bad;
  bad.lr = 1.5;
  EXPECT_THAT(SyntheticObjective::Create(TinySpec(), TwoShards(), bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lr")));
  EXPECT_THAT(SyntheticObjective::Create(v1::ModelSpec(), TwoShards(), {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no parameters")));
}

TEST(SyntheticTrainerTest, NoiselessStepsContractTowardTheShardTarget) {
  SyntheticObjectiveOptions options;
  options.noise_std = 0;
  options.lr = 0.25;
  options.tokens_per_step = 64;
  auto o = SyntheticObjective::Create(TinySpec(), TwoShards(), options);
  ASSERT_THAT(o, IsOk());
  SyntheticTrainer trainer(**o);
  const std::vector<std::vector<float>> base = {{0.1f, -0.2f, 0.3f}, {1.0f, 0.0f}};
  ASSERT_THAT(trainer.SetParameters(base), IsOk());
  TrainRequest request;
  request.shard_name = "b";
  request.steps = 3;
  request.seed = 9;
  auto stats = trainer.Train(request);
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->steps, 3u);
  EXPECT_EQ(stats->tokens, 3u * 64u);
  // x_k - t = (1 - lr)^k (x_0 - t); the loss before step k is (1 - lr)^(2k) f(x_0).
  const auto& t = (*o)->target(1);
  const double f0 = HandLoss(base, t);
  EXPECT_NEAR(stats->mean_loss, f0 * (1 + std::pow(0.75, 2) + std::pow(0.75, 4)) / 3, 1e-6);
  std::vector<std::vector<float>> g;
  ASSERT_THAT(trainer.PseudoGradient(base, &g), IsOk());
  ASSERT_EQ(g.size(), 2u);
  for (size_t l = 0; l < 2; ++l) {
    for (size_t i = 0; i < base[l].size(); ++i) {
      const double end = t[l][i] + std::pow(0.75, 3) * (double(base[l][i]) - t[l][i]);
      EXPECT_NEAR(trainer.parameters()[l][i], end, 1e-5);
      EXPECT_NEAR(g[l][i], base[l][i] - end, 1e-5);
    }
  }
  EXPECT_NEAR(*trainer.Evaluate({}), (*o)->EvalLoss(trainer.parameters()), 1e-12);
}

TEST(SyntheticTrainerTest, NoiseDependsOnlyOnTheSeed) {
  auto o = SyntheticObjective::Create(TinySpec(), TwoShards(), {});
  ASSERT_THAT(o, IsOk());
  const std::vector<std::vector<float>> base = {{0.1f, -0.2f, 0.3f}, {1.0f, 0.0f}};
  auto run = [&](uint64_t seed) {
    SyntheticTrainer trainer(**o);
    EXPECT_THAT(trainer.SetParameters(base), IsOk());
    TrainRequest request;
    request.shard_name = "a";
    request.steps = 4;
    request.seed = seed;
    EXPECT_THAT(trainer.Train(request), IsOk());
    return trainer.parameters();
  };
  EXPECT_EQ(run(1), run(1));
  EXPECT_NE(run(1), run(2));
}

TEST(SyntheticTrainerTest, RejectsUnknownShardsAndWrongShapes) {
  auto o = SyntheticObjective::Create(TinySpec(), TwoShards(), {});
  ASSERT_THAT(o, IsOk());
  SyntheticTrainer trainer(**o);
  TrainRequest request;
  request.shard_name = "zzz";
  request.steps = 1;
  EXPECT_THAT(trainer.Train(request),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("zzz")));
  EXPECT_THAT(trainer.SetParameters({{1, 2, 3}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1 layers")));
  EXPECT_THAT(trainer.SetParameters({{1, 2, 3}, {1}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 1 has 1 elements")));
  std::vector<std::vector<float>> g;
  EXPECT_THAT(trainer.PseudoGradient({{1, 2}}, &g),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("base")));
}

}  // namespace
}  // namespace aloe::sim
