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

// One-step-delay overlap: worker 1 starts round 1 ahead from version 0 while round 0 is open.
// Its round-1 push, arriving before round 0 closed, is held for round 1 (applied at version 1)
// and not counted in round 0; round 1 opens as soon as round 0 closed and waits for worker 2.
TEST(SyncRoundAggregationTest, WorkStartedAheadJoinsTheNextRound) {
  SyncRoundAggregation sync(2);
  ASSERT_TRUE(sync.StartVersion(1, 0, {1, 2}).has_value());
  ASSERT_TRUE(sync.StartVersion(2, 0, {1, 2}).has_value());
  EXPECT_FALSE(sync.StartAhead(3, 0, {1, 2, 3}).has_value());  // no work in this round
  EXPECT_EQ(sync.StartAhead(1, 0, {1, 2}), std::optional<uint64_t>(0));
  EXPECT_FALSE(sync.StartAhead(1, 0, {1, 2}).has_value());  // one round ahead at most
  EXPECT_EQ(sync.TargetVersion(1, 0, 0), 0u);               // its round-0 work
  ASSERT_THAT(sync.Submit(U(1, 0), 0), IsOk());
  sync.PromoteAhead(1);
  EXPECT_EQ(sync.TargetVersion(1, 0, 0), 1u);  // its round-1 work
  auto early = sync.Submit(U(1, 0), 0);
  ASSERT_THAT(early, IsOk());
  EXPECT_TRUE(early->updates.empty());
  EXPECT_THAT(sync.Submit(U(1, 0), 0),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already pushed")));
  auto round0 = sync.Submit(U(2, 0), 0);
  ASSERT_THAT(round0, IsOk());
  EXPECT_EQ(round0->updates.size(), 2u);  // not 3: the early push waits for round 1
  EXPECT_TRUE(sync.InProgress());
  EXPECT_TRUE(sync.BeginAhead(1, {1, 2}).updates.empty());  // round 1 waits for worker 2
  EXPECT_EQ(sync.active_workers(), 2u);
  // Worker 1 pushed into round 1 already: it stays one step behind, its round-2 work starting
  // from version 1 at once (and once).
  EXPECT_EQ(sync.StartVersion(1, 1, {1, 2}), std::optional<uint64_t>(1));
  EXPECT_FALSE(sync.StartVersion(1, 1, {1, 2}).has_value());
  ASSERT_EQ(sync.StartVersion(2, 1, {1, 2}), std::optional<uint64_t>(1));
  auto round1 = sync.Submit(U(2, 1), 1);
  ASSERT_THAT(round1, IsOk());
  ASSERT_EQ(round1->updates.size(), 2u);
  EXPECT_EQ(round1->updates[0].worker_id, 1u);
  EXPECT_EQ(round1->updates[0].base_version, 0u);
}

// Work started ahead whose predecessor in the open round ends without an update takes its
// place in that round (it began at the round's version); a departed worker's ahead work is
// forgotten and the next round does not wait for it.
TEST(SyncRoundAggregationTest, AheadWorkReplacesEndedWorkAndDepartedWorkersAreNotAwaited) {
  SyncRoundAggregation sync(1);
  ASSERT_TRUE(sync.StartVersion(1, 0, {1, 2}).has_value());
  ASSERT_TRUE(sync.StartVersion(2, 0, {1, 2}).has_value());
  ASSERT_TRUE(sync.StartAhead(1, 0, {1, 2}).has_value());
  EXPECT_TRUE(sync.OnWorkEnded(1).updates.empty());
  sync.PromoteAhead(1);
  EXPECT_EQ(sync.TargetVersion(1, 0, 0), 0u);
  ASSERT_THAT(sync.Submit(U(1, 0), 0), IsOk());
  ASSERT_TRUE(sync.StartAhead(2, 0, {1, 2}).has_value());
  ASSERT_EQ(sync.Submit(U(2, 0), 0)->updates.size(), 2u);
  EXPECT_TRUE(sync.InProgress());  // worker 2's round-1 work
  EXPECT_TRUE(sync.OnWorkerGone(2).updates.empty());
  EXPECT_FALSE(sync.InProgress());
  EXPECT_TRUE(sync.BeginAhead(1, {1}).updates.empty());
  EXPECT_EQ(sync.StartVersion(1, 1, {1}), std::optional<uint64_t>(1));
  EXPECT_EQ(sync.Submit(U(1, 1), 1)->updates.size(), 1u);
}

// No work starts ahead for a round past the last version: with last_version 2, round 0 may
// start round 1's work (it makes v2), round 1 may not start round 2's, whether asked ahead or
// by a worker one step behind.
TEST(SyncRoundAggregationTest, NoWorkStartsAheadPastTheLastVersion) {
  SyncRoundAggregation sync(1, /*last_version=*/2);
  const std::vector<uint64_t> live = {1, 2};
  ASSERT_TRUE(sync.StartVersion(1, 0, live).has_value());
  ASSERT_TRUE(sync.StartVersion(2, 0, live).has_value());
  ASSERT_EQ(sync.StartAhead(1, 0, live), std::optional<uint64_t>(0));  // round 1 makes v2
  ASSERT_THAT(sync.Submit(U(1, 0), 0), IsOk());
  ASSERT_THAT(sync.Submit(U(1, 0), 0), IsOk());            // held for round 1
  ASSERT_EQ(sync.Submit(U(2, 0), 0)->updates.size(), 2u);  // v1
  ASSERT_TRUE(sync.BeginAhead(1, live).updates.empty());
  EXPECT_FALSE(sync.StartVersion(1, 1, live).has_value());  // one step behind: round 2 is past
  ASSERT_EQ(sync.StartVersion(2, 1, live), std::optional<uint64_t>(1));
  EXPECT_FALSE(sync.StartAhead(2, 1, live).has_value());
  ASSERT_EQ(sync.Submit(U(2, 1), 1)->updates.size(), 2u);  // v2
  EXPECT_FALSE(sync.InProgress());
}

}  // namespace
}  // namespace aloe::server
