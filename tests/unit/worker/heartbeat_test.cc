// The heartbeat thread in fake time (FakeSleeper): no network, no wall clock.
#include "worker/heartbeat.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "tests/unit/worker/fake_server.h"
#include "worker/sleeper.h"

namespace aloe::worker {
namespace {

class HeartbeatTest : public ::testing::Test {
 protected:
  FakeServer server_;
  FakeClock clock_;
  FakeSleeper sleeper_{clock_};
};

TEST_F(HeartbeatTest, IntervalIsAThirdOfTheLeaseAndAtLeast50Ms) {
  EXPECT_EQ(Heartbeat::Interval(absl::Seconds(30)), absl::Seconds(10));
  EXPECT_EQ(Heartbeat::Interval(absl::Milliseconds(90)), absl::Milliseconds(50));
}

TEST_F(HeartbeatTest, SendsOneHeartbeatPerIntervalOfFakeTime) {
  Heartbeat heartbeat(server_, sleeper_, absl::Seconds(3));
  heartbeat.SetWorker(7);
  heartbeat.SetSpeed(1.5);
  ASSERT_TRUE(sleeper_.AwaitWaits(1));
  sleeper_.Advance(absl::Milliseconds(999));
  EXPECT_TRUE(server_.heartbeats().empty());
  sleeper_.Advance(absl::Milliseconds(1));
  ASSERT_TRUE(sleeper_.AwaitWaits(2));
  std::vector<v1::HeartbeatRequest> sent = server_.heartbeats();
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].worker_id(), 7u);
  EXPECT_DOUBLE_EQ(sent[0].steps_per_second(), 1.5);
  for (uint64_t i = 2; i <= 10; ++i) {
    sleeper_.Advance(absl::Seconds(1));
    ASSERT_TRUE(sleeper_.AwaitWaits(i + 1));
  }
  EXPECT_EQ(server_.heartbeats().size(), 10u);
  EXPECT_FALSE(heartbeat.lease_lost());
}

TEST_F(HeartbeatTest, NotFoundLosesTheLeaseOfThatWorkerOnly) {
  server_.SetHeartbeatError(7, absl::NotFoundError("worker 7 is not a member"));
  server_.SetHeartbeatError(8, absl::UnavailableError("connection refused"));
  Heartbeat heartbeat(server_, sleeper_, absl::Seconds(3));
  heartbeat.SetWorker(8);
  ASSERT_TRUE(sleeper_.AwaitWaits(1));
  sleeper_.Advance(absl::Seconds(1));
  ASSERT_TRUE(sleeper_.AwaitWaits(2));
  EXPECT_FALSE(heartbeat.lease_lost());  // a server away is no verdict on the lease
  heartbeat.SetWorker(7);
  sleeper_.Advance(absl::Seconds(1));
  ASSERT_TRUE(sleeper_.AwaitWaits(3));
  EXPECT_TRUE(heartbeat.lease_lost());
  heartbeat.SetWorker(9);  // joined again
  EXPECT_FALSE(heartbeat.lease_lost());
  sleeper_.Advance(absl::Seconds(1));
  ASSERT_TRUE(sleeper_.AwaitWaits(4));
  EXPECT_FALSE(heartbeat.lease_lost());
  EXPECT_EQ(server_.heartbeats().size(), 3u);
}

TEST_F(HeartbeatTest, AnAnswerAboutTheWorkerBeforeAJoinIsNotHeldAgainstTheNext) {
  server_.SetHeartbeatError(7, absl::NotFoundError("worker 7 is not a member"));
  Heartbeat heartbeat(server_, sleeper_, absl::Seconds(3));
  heartbeat.SetWorker(7);
  // The worker joins again as 7 while the heartbeat of the earlier 7 is under way.
  server_.set_on_heartbeat([&](const v1::HeartbeatRequest&) { heartbeat.SetWorker(7); });
  ASSERT_TRUE(sleeper_.AwaitWaits(1));
  sleeper_.Advance(absl::Seconds(1));
  ASSERT_TRUE(sleeper_.AwaitWaits(2));
  EXPECT_FALSE(heartbeat.lease_lost());
  server_.set_on_heartbeat(nullptr);
  sleeper_.Advance(absl::Seconds(1));
  ASSERT_TRUE(sleeper_.AwaitWaits(3));
  EXPECT_TRUE(heartbeat.lease_lost());
}

TEST_F(HeartbeatTest, ShutdownEndsTheWaitAtOnceAndNoCallFollows) {
  Heartbeat heartbeat(server_, sleeper_, absl::Seconds(3));
  heartbeat.SetWorker(1);
  ASSERT_TRUE(sleeper_.AwaitWaits(1));
  sleeper_.Advance(absl::Seconds(1));
  ASSERT_TRUE(sleeper_.AwaitWaits(2));
  heartbeat.Shutdown();  // returns with the fake clock standing still
  sleeper_.Advance(absl::Hours(1));
  EXPECT_EQ(server_.heartbeats().size(), 1u);
  EXPECT_EQ(sleeper_.waits(), 2u);
  heartbeat.Shutdown();  // idempotent
}

TEST(FakeSleeperTest, AWaitEndsAtItsDeadlineOrWhenItsConditionHolds) {
  FakeClock clock;
  FakeSleeper sleeper(clock);
  absl::Mutex mu;
  bool ready = false;
  std::vector<bool> results;
  std::thread waiter([&] {
    absl::MutexLock lock(&mu);
    results.push_back(sleeper.AwaitWithTimeout(mu, absl::Condition(&ready), absl::Seconds(5)));
    results.push_back(sleeper.AwaitWithTimeout(mu, absl::Condition(&ready), absl::Seconds(5)));
    ready = false;
    results.push_back(sleeper.AwaitWithTimeout(mu, absl::Condition(&ready), absl::Seconds(5)));
  });
  ASSERT_TRUE(sleeper.AwaitWaits(1));
  sleeper.Advance(absl::Seconds(4));
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(results.empty());  // 4 of 5 s
    ready = true;
  }
  ASSERT_TRUE(sleeper.AwaitWaits(3));  // the second wait ended at once: ready holds
  sleeper.Advance(absl::Seconds(5));
  waiter.join();
  EXPECT_THAT(results, ::testing::ElementsAre(true, true, false));
}

}  // namespace
}  // namespace aloe::worker
