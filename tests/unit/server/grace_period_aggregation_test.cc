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

}  // namespace
}  // namespace aloe::server
