// Grace-period batching (paper 002 Alg. 2 / 5) on a hand-written arrival trace.
#include "server/core/grace_period_aggregation.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/status_matchers.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

PendingUpdate U(uint64_t worker, uint64_t base) {
  PendingUpdate u;
  u.worker_id = worker;
  u.base_version = base;
  return u;
}

TEST(GracePeriodAggregationTest, HandWrittenTraceFollowsAlgorithm2) {
  FakeClock clock;
  GracePeriodAggregation grace(clock, absl::Seconds(2));
  const std::vector<uint64_t> live = {1, 2, 3};
  uint64_t version = 0;
  // t=0: everybody starts from version 0.
  for (uint64_t w : live) EXPECT_EQ(grace.StartVersion(w, version, live), 0u);
  EXPECT_FALSE(grace.StartVersion(1, version, live).has_value());  // already working

  // t=1: worker 2 arrives, opens a window [1, 3); applied at once as its own step.
  clock.Advance(absl::Seconds(1));
  auto b = grace.Submit(U(2, 0), version);
  ASSERT_THAT(b, IsOk());
  ASSERT_EQ(b->updates.size(), 1u);
  EXPECT_FLOAT_EQ(b->weights[0], 1.0f);
  ++version;  // v1
  EXPECT_FALSE(grace.CloseExpired(version));
  EXPECT_EQ(grace.Deadline(), clock.Now() + absl::Seconds(2));
  EXPECT_FALSE(grace.StartVersion(2, version, live).has_value());  // waits for the window
  // t=2.5: worker 1 arrives inside the window: applied in arrival order, joins it.
  clock.Advance(absl::Seconds(1.5));
  ASSERT_THAT(grace.Submit(U(1, 0), version), IsOk());
  ++version;  // v2
  EXPECT_EQ(grace.window_size(), 2u);
  EXPECT_FALSE(grace.CloseExpired(version));  // worker 3 could still arrive until t=3
  // t=3: the window closes; 1 and 2 are released together, both from v2.
  clock.Advance(absl::Seconds(0.5));
  EXPECT_TRUE(grace.CloseExpired(version));
  EXPECT_EQ(grace.PendingStartVersion(), 2u);
  // t=3.2: worker 3 arrives after the window: opens a new one and is applied (v3) ...
  clock.Advance(absl::Seconds(0.2));
  ASSERT_THAT(grace.Submit(U(3, 0), version), IsOk());
  ++version;  // v3
  // ... but the released workers still start from v2, the version of their window.
  EXPECT_EQ(grace.StartVersion(1, version, live), 2u);
  EXPECT_EQ(grace.StartVersion(2, version, live), 2u);
  EXPECT_FALSE(grace.PendingStartVersion().has_value());
  // Worker 3's window [3.2, 5.2) stays open while 1 and 2 could still arrive.
  EXPECT_FALSE(grace.CloseExpired(version));
  clock.Advance(absl::Seconds(2));
  EXPECT_TRUE(grace.CloseExpired(version));
  EXPECT_EQ(grace.StartVersion(3, version, live), 3u);
  // A second push of the same work is refused.
  ASSERT_THAT(grace.Submit(U(1, 2), version), IsOk());
  EXPECT_THAT(grace.Submit(U(1, 2), version),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no work in progress")));
}

TEST(GracePeriodAggregationTest, ZeroGraceIsPlainAsync) {
  FakeClock clock;
  GracePeriodAggregation grace(clock, absl::ZeroDuration());
  const std::vector<uint64_t> live = {1, 2};
  EXPECT_EQ(grace.StartVersion(1, 0, live), 0u);
  EXPECT_EQ(grace.StartVersion(2, 0, live), 0u);
  ASSERT_THAT(grace.Submit(U(1, 0), 0), IsOk());
  // Released immediately, from the version after its own update.
  EXPECT_EQ(grace.StartVersion(1, 1, live), 1u);
}

TEST(GracePeriodAggregationTest, InfiniteGraceReleasesWhenNobodyElseCanArrive) {
  FakeClock clock;
  GracePeriodAggregation grace(clock, absl::InfiniteDuration());
  const std::vector<uint64_t> live = {1, 2};
  grace.StartVersion(1, 0, live);
  grace.StartVersion(2, 0, live);
  ASSERT_THAT(grace.Submit(U(1, 0), 0), IsOk());
  clock.Advance(absl::Hours(1));
  EXPECT_FALSE(grace.CloseExpired(1));  // 2 is still working: wait for it, however long
  EXPECT_FALSE(grace.Deadline().has_value());
  ASSERT_THAT(grace.Submit(U(2, 0), 1), IsOk());
  EXPECT_TRUE(grace.CloseExpired(2));
  EXPECT_EQ(grace.StartVersion(1, 2, live), 2u);
  EXPECT_EQ(grace.StartVersion(2, 2, live), 2u);
}

TEST(GracePeriodAggregationTest, DepartedWorkerIsNeverWaitedFor) {
  FakeClock clock;
  GracePeriodAggregation grace(clock, absl::InfiniteDuration());
  const std::vector<uint64_t> live = {1, 2};
  grace.StartVersion(1, 0, live);
  grace.StartVersion(2, 0, live);
  ASSERT_THAT(grace.Submit(U(1, 0), 0), IsOk());
  grace.OnWorkerGone(2);
  EXPECT_TRUE(grace.CloseExpired(1));
  EXPECT_EQ(grace.StartVersion(1, 1, {1}), 1u);
}

// Rounds of aligned DyLU: a window opened by a tagged push waits for the rest of the opener's
// round (until open + its slack + grace) and closes as soon as that round is in.
TEST(GracePeriodAggregationTest, RoundWindowWaitsForItsRoundOnly) {
  FakeClock clock;
  const absl::Time t0 = clock.Now();
  GracePeriodAggregation grace(clock, absl::Seconds(0.5));
  const std::vector<uint64_t> live = {1, 2, 3, 4};
  for (uint64_t w : live) EXPECT_EQ(grace.StartVersion(w, 0, live), 0u);
  EXPECT_FALSE(grace.StartedBy(1).has_value());  // a first start, no release
  grace.Expect(1, 1, absl::ZeroDuration());
  grace.Expect(2, 1, absl::Seconds(1.5));  // planned to finish 1.5 s before the round end
  grace.Expect(3, 2, absl::Seconds(0.2));  // belongs to the next round
  // Worker 4 is untagged (not measured when planned): not waited for by a round.
  uint64_t version = 0;
  // t=18.5: worker 2 opens the window; the round ends at 18.5 + 1.5 = 20, +0.5 grace.
  clock.Advance(absl::Seconds(18.5));
  ASSERT_THAT(grace.Submit(U(2, 0), version), IsOk());
  ++version;
  EXPECT_EQ(grace.Deadline(), t0 + absl::Seconds(20.5));
  // t=20.2: past a plain grace window (19.0), but worker 1 of the same round is still out.
  clock.Advance(absl::Seconds(1.7));
  EXPECT_FALSE(grace.CloseExpired(version));
  ASSERT_THAT(grace.Submit(U(1, 0), version), IsOk());
  ++version;
  // Round 1 is in (3 belongs to round 2, 4 is untagged): the window closes at once.
  EXPECT_TRUE(grace.CloseExpired(version));
  EXPECT_EQ(grace.StartVersion(1, version, live), 2u);
  ASSERT_TRUE(grace.StartedBy(1).has_value());
  EXPECT_EQ(grace.StartedBy(1)->at, t0 + absl::Seconds(20.2));
  EXPECT_EQ(grace.StartedBy(1)->round, 1u);
}

TEST(GracePeriodAggregationTest, RoundWindowClosesAfterSlackPlusGraceWithoutAStraggler) {
  FakeClock clock;
  const absl::Time t0 = clock.Now();
  GracePeriodAggregation grace(clock, absl::Seconds(0.5));
  const std::vector<uint64_t> live = {1, 2};
  for (uint64_t w : live) EXPECT_EQ(grace.StartVersion(w, 0, live), 0u);
  grace.Expect(1, 3, absl::ZeroDuration());
  grace.Expect(2, 3, absl::Seconds(2));
  clock.Advance(absl::Seconds(10));
  ASSERT_THAT(grace.Submit(U(2, 0), 0), IsOk());
  EXPECT_EQ(grace.Deadline(), t0 + absl::Seconds(12.5));
  clock.Advance(absl::Seconds(2.49));
  EXPECT_FALSE(grace.CloseExpired(1));
  clock.Advance(absl::Seconds(0.01));
  EXPECT_TRUE(grace.CloseExpired(1));  // worker 1 is late by more than grace: not waited for
  EXPECT_EQ(grace.StartVersion(2, 1, live), 1u);
  EXPECT_EQ(grace.StartedBy(2)->round, 3u);
  // Worker 1 arrives late (round 3, older than nobody): its window has nobody of its round
  // left out, so it is released at once instead of waiting for a grace window.
  clock.Advance(absl::Seconds(1));
  ASSERT_THAT(grace.Submit(U(1, 0), 1), IsOk());
  EXPECT_TRUE(grace.CloseExpired(2));
  EXPECT_EQ(grace.StartVersion(1, 2, live), 2u);
  EXPECT_EQ(grace.StartedBy(1)->at, t0 + absl::Seconds(13.5));
}

TEST(GracePeriodAggregationTest, RoundOfUnknownLengthWaitsForTheWholeRound) {
  FakeClock clock;
  GracePeriodAggregation grace(clock, absl::Seconds(0.5));
  const std::vector<uint64_t> live = {1, 2, 3};
  for (uint64_t w : live) EXPECT_EQ(grace.StartVersion(w, 0, live), 0u);
  for (uint64_t w : live) grace.Expect(w, 1, absl::InfiniteDuration());  // the first round
  ASSERT_THAT(grace.Submit(U(1, 0), 0), IsOk());
  EXPECT_FALSE(grace.Deadline().has_value());
  clock.Advance(absl::Seconds(100));
  EXPECT_FALSE(grace.CloseExpired(1));  // worker 2 and 3 are still out
  ASSERT_THAT(grace.Submit(U(2, 0), 1), IsOk());
  EXPECT_FALSE(grace.CloseExpired(2));
  EXPECT_TRUE(grace.OnWorkerGone(3).updates.empty());  // gone: not waited for any more
  EXPECT_TRUE(grace.CloseExpired(2));
  EXPECT_EQ(grace.StartVersion(1, 2, {1, 2}), 2u);
  EXPECT_EQ(grace.StartedBy(1)->at, clock.Now());
}

TEST(GracePeriodAggregationTest, UntaggedWindowKeepsPlainGrace) {
  FakeClock clock;
  const absl::Time t0 = clock.Now();
  GracePeriodAggregation grace(clock, absl::Seconds(0.5));
  const std::vector<uint64_t> live = {1, 2};
  for (uint64_t w : live) EXPECT_EQ(grace.StartVersion(w, 0, live), 0u);
  grace.Expect(2, 1, absl::Seconds(3));  // a tagged worker still out does not hold it open
  ASSERT_THAT(grace.Submit(U(1, 0), 0), IsOk());
  EXPECT_EQ(grace.Deadline(), t0 + absl::Seconds(0.5));
  EXPECT_FALSE(grace.CloseExpired(1));
  clock.Advance(absl::Seconds(0.5));
  EXPECT_TRUE(grace.CloseExpired(1));
  EXPECT_EQ(grace.StartVersion(1, 1, live), 1u);
  EXPECT_EQ(grace.StartedBy(1)->round, 0u);
}

// One-step-delay overlap: worker 1 starts its next work ahead from the current version while
// its first runs; once it has pushed, the work after that waits for the close of the window the
// push is in and starts from the version at the close, like worker 2's next work. Its second
// push (the work started ahead) joins the next window like any other.
TEST(GracePeriodAggregationTest, WorkStartedAheadWaitsForTheWindowOfTheLastPush) {
  FakeClock clock;
  GracePeriodAggregation grace(clock, absl::Seconds(2));
  const std::vector<uint64_t> live = {1, 2};
  EXPECT_FALSE(grace.StartAhead(1, 0, live).has_value());  // no work in progress
  ASSERT_EQ(grace.StartVersion(1, 0, live), 0u);
  ASSERT_EQ(grace.StartVersion(2, 0, live), 0u);
  EXPECT_EQ(grace.StartAhead(1, 0, live), 0u);
  ASSERT_THAT(grace.Submit(U(1, 0), 0), IsOk());  // v1, opens a window
  grace.PromoteAhead(1);
  EXPECT_FALSE(grace.StartAhead(1, 1, live).has_value());  // its push is in the open window
  ASSERT_THAT(grace.Submit(U(2, 0), 1), IsOk());           // v2: everyone is in
  EXPECT_TRUE(grace.CloseExpired(2));
  EXPECT_EQ(grace.StartAhead(1, 2, live), 2u);
  EXPECT_EQ(grace.StartVersion(2, 2, live), 2u);
  EXPECT_TRUE(grace.InProgress());
  clock.Advance(absl::Seconds(1));
  ASSERT_THAT(grace.Submit(U(1, 0), 2), IsOk());  // the work started ahead: v3, a new window
  EXPECT_EQ(grace.window_size(), 1u);
  EXPECT_EQ(grace.Deadline(), clock.Now() + absl::Seconds(2));
}

}  // namespace
}  // namespace aloe::server
