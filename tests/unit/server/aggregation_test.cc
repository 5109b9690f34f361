#include "server/core/aggregation.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/status_matchers.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

PendingUpdate U(uint64_t worker, uint64_t version) {
  PendingUpdate u;
  u.worker_id = worker;
  u.base_version = version;
  return u;
}

TEST(SyncRoundAggregationTest, RoundIsABarrierOverItsParticipants) {
  SyncRoundAggregation sync(/*min_workers=*/2);
  EXPECT_FALSE(sync.StartVersion(1, 0, {1}).has_value());  // below min_workers
  EXPECT_FALSE(sync.InProgress());
  EXPECT_TRUE(sync.StartVersion(1, 0, {1, 2}).has_value());
  EXPECT_FALSE(sync.StartVersion(1, 0, {1, 2}).has_value());     // starts once per round
  EXPECT_FALSE(sync.StartVersion(3, 0, {1, 2, 3}).has_value());  // joined mid-round: next round
  EXPECT_TRUE(sync.StartVersion(2, 0, {1, 2, 3}).has_value());
  EXPECT_EQ(sync.active_workers(), 2u);

  auto first = sync.Submit(U(1, 0), 0);
  ASSERT_THAT(first, IsOk());
  EXPECT_TRUE(first->updates.empty());
  EXPECT_THAT(sync.Submit(U(1, 0), 0),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already pushed")));
  auto second = sync.Submit(U(2, 0), 0);
  ASSERT_THAT(second, IsOk());
  ASSERT_EQ(second->updates.size(), 2u);
  EXPECT_FLOAT_EQ(second->weights[0], 0.5f);
  EXPECT_FLOAT_EQ(second->weights[1], 0.5f);
  EXPECT_FALSE(sync.InProgress());
  EXPECT_EQ(sync.active_workers(), 0u);

  // The next round includes the late joiner; min_workers applies to the first round only.
  EXPECT_TRUE(sync.StartVersion(3, 1, {3}).has_value());
  EXPECT_THAT(sync.Submit(U(3, 0), 1),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("stale")));
  auto third = sync.Submit(U(3, 1), 1);
  ASSERT_THAT(third, IsOk());
  EXPECT_EQ(third->updates.size(), 1u);
  EXPECT_FLOAT_EQ(third->weights[0], 1.0f);
}

TEST(SyncRoundAggregationTest, DepartedParticipantCompletesOrClosesTheRound) {
  SyncRoundAggregation sync(1);
  ASSERT_TRUE(sync.StartVersion(1, 0, {1, 2, 3}).has_value());
  ASSERT_TRUE(sync.StartVersion(2, 0, {1, 2, 3}).has_value());
  ASSERT_THAT(sync.Submit(U(1, 0), 0), IsOk());
  EXPECT_TRUE(sync.OnWorkerGone(3).updates.empty());  // 2 still owes its push
  ApplyBatch batch = sync.OnWorkerGone(2);
  ASSERT_EQ(batch.updates.size(), 1u);
  EXPECT_EQ(batch.updates[0].worker_id, 1u);

  ASSERT_TRUE(sync.StartVersion(1, 1, {1}).has_value());
  EXPECT_TRUE(sync.OnWorkerGone(1).updates.empty());
  EXPECT_FALSE(sync.InProgress());  // nobody left: the round closes without a step
}

}  // namespace
}  // namespace aloe::server
