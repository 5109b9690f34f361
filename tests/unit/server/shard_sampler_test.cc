#include "server/core/shard_sampler.h"

#include <gtest/gtest.h>

#include <cmath>

namespace aloe::server {
namespace {

std::vector<DataShard> Shards() { return {{"a", "a", 100}, {"b", "b", 300}, {"c", "c", 600}}; }

TEST(DataShardSamplerTest, StartIsProportionalToSize) {
  DataShardSampler sampler(Shards(), 1);
  const auto p = sampler.Probabilities();
  EXPECT_DOUBLE_EQ(p[0], 0.1);
  EXPECT_DOUBLE_EQ(p[1], 0.3);
  EXPECT_DOUBLE_EQ(p[2], 0.6);
}

TEST(DataShardSamplerTest, ProbabilitiesFollowEquation2) {
  DataShardSampler sampler(Shards(), 1);
  // n = (50, 30, 20): shares (0.1, 0.3, 0.6), progress (0.5, 0.3, 0.2)
  // -> max(., 0) = (0, 0, 0.4) -> only c.
  sampler.RecordLearned(0, 0, 5, 50);
  sampler.RecordLearned(1, 0, 3, 30);
  sampler.RecordLearned(2, 0, 2, 20);
  auto p = sampler.Probabilities();
  EXPECT_DOUBLE_EQ(p[0], 0.0);
  EXPECT_DOUBLE_EQ(p[1], 0.0);
  EXPECT_DOUBLE_EQ(p[2], 1.0);
  // n = (0, 10, 10): progress (0, 0.5, 0.5) -> (0.1, 0, 0.1) -> (0.5, 0, 0.5).
  DataShardSampler second(Shards(), 1);
  second.RecordLearned(1, 0, 1, 10);
  second.RecordLearned(2, 0, 1, 10);
  p = second.Probabilities();
  EXPECT_NEAR(p[0], 0.5, 1e-12);
  EXPECT_DOUBLE_EQ(p[1], 0.0);
  EXPECT_NEAR(p[2], 0.5, 1e-12);
  EXPECT_EQ(second.lr_step(1), 1u);
}

TEST(DataShardSamplerTest, EmpiricalFrequenciesMatchWithinOnePercentAndOverSampledNeverDrawn) {
  DataShardSampler sampler({{"a", "a", 100}, {"b", "b", 300}, {"c", "c", 600}, {"d", "d", 1000}},
                           7);
  // n = (40, 10, 30, 20): shares (.05, .15, .3, .5), progress (.4, .1, .3, .2)
  // -> (0, .05, 0, .3) -> (0, 1/7, 0, 6/7).
  sampler.RecordLearned(0, 0, 1, 40);
  sampler.RecordLearned(1, 0, 1, 10);
  sampler.RecordLearned(2, 0, 1, 30);
  sampler.RecordLearned(3, 0, 1, 20);
  std::vector<int> counts(4, 0);
  const int draws = 100000;
  for (int i = 0; i < draws; ++i) ++counts[sampler.Next()];
  EXPECT_EQ(counts[0], 0);
  EXPECT_EQ(counts[2], 0);  // exactly at its share: p = 0
  EXPECT_NEAR(counts[1] / double(draws), 1.0 / 7, 0.01);
  EXPECT_NEAR(counts[3] / double(draws), 6.0 / 7, 0.01);
}

TEST(DataShardSamplerTest, InFlightWorkPreventsHerding) {
  DataShardSampler sampler({{"a", "a", 500}, {"b", "b", 500}}, 3);
  sampler.RecordLearned(0, 0, 1, 100);  // a is ahead: b is the only choice
  EXPECT_EQ(sampler.Next(), 1u);
  sampler.Assign(1, 100);  // one worker already on b: balanced now -> proportional
  auto p = sampler.Probabilities();
  EXPECT_DOUBLE_EQ(p[0], 0.5);
  sampler.Assign(1, 100);  // a second worker on b makes a the under-sampled one
  EXPECT_EQ(sampler.Next(), 0u);
  EXPECT_EQ(sampler.tokens_in_flight(1), 200u);
  sampler.Release(1, 100);               // dropped task
  sampler.RecordLearned(1, 100, 4, 90);  // returned task learned 90 of 100
  EXPECT_EQ(sampler.tokens_in_flight(1), 0u);
  EXPECT_EQ(sampler.tokens_learned(1), 90u);
  EXPECT_EQ(sampler.lr_step(1), 4u);
}

TEST(DataShardSamplerTest, SameSeedSameDraws) {
  DataShardSampler a(Shards(), 11), b(Shards(), 11);
  for (int i = 0; i < 100; ++i) ASSERT_EQ(a.Next(), b.Next());
}

}  // namespace
}  // namespace aloe::server
