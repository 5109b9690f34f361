#include "worker/backoff.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

namespace aloe::worker {
namespace {

using absl::Milliseconds;
using absl::Seconds;

TEST(RetryBackoffTest, WithoutJitterDoublesFromTheInitialWaitUpToTheCap) {
  RetryBackoff backoff({.initial = Milliseconds(100), .max = Seconds(1), .jitter = 0});
  EXPECT_EQ(backoff.Failure(), Milliseconds(100));
  EXPECT_EQ(backoff.Failure(), Milliseconds(200));
  EXPECT_EQ(backoff.Failure(), Milliseconds(400));
  EXPECT_EQ(backoff.Failure(), Milliseconds(800));
  EXPECT_EQ(backoff.Failure(), Seconds(1));
  for (int i = 0; i < 100; ++i) backoff.Failure();
  EXPECT_EQ(backoff.Failure(), Seconds(1));
  EXPECT_EQ(backoff.last(), Seconds(1));
  EXPECT_EQ(backoff.failures(), 106u);
}

TEST(RetryBackoffTest, FirstAtOnceRetriesTheFirstFailureWithoutWaitAndResetStartsOver) {
  RetryBackoff backoff(
      {.initial = Milliseconds(100), .max = Seconds(1), .jitter = 0, .first_at_once = true});
  EXPECT_EQ(backoff.Failure(), absl::ZeroDuration());
  EXPECT_EQ(backoff.Failure(), Milliseconds(100));
  EXPECT_EQ(backoff.Failure(), Milliseconds(200));
  backoff.Reset();
  EXPECT_EQ(backoff.last(), absl::ZeroDuration());
  EXPECT_EQ(backoff.failures(), 0u);
  EXPECT_EQ(backoff.Failure(), absl::ZeroDuration());
  EXPECT_EQ(backoff.Failure(), Milliseconds(100));
}

TEST(RetryBackoffTest, JitteredWaitsStayWithinTheirBoundsAndSpreadOut) {
  RetryBackoff backoff({.initial = Milliseconds(100), .max = Seconds(5), .jitter = 0.5, .seed = 3});
  absl::Duration lowest = absl::InfiniteDuration();
  absl::Duration highest = absl::ZeroDuration();
  for (int i = 0; i < 200; ++i) {
    const absl::Duration ceiling = std::min(Milliseconds(100) * (1 << std::min(i, 10)), Seconds(5));
    const absl::Duration wait = backoff.Failure();
    ASSERT_GE(wait, ceiling / 2) << i;
    ASSERT_LE(wait, ceiling) << i;
    if (ceiling == Seconds(5)) {
      lowest = std::min(lowest, wait);
      highest = std::max(highest, wait);
    }
  }
  // Capped waits are drawn over most of [2.5, 5] s, not one value.
  EXPECT_LT(lowest, Seconds(2.75));
  EXPECT_GT(highest, Seconds(4.75));
}

TEST(RetryBackoffTest, TheSameSeedDrawsTheSameWaitsAndAnotherSeedOthers) {
  auto waits = [](uint64_t seed) {
    RetryBackoff backoff({.initial = Seconds(1), .max = Seconds(1), .jitter = 1, .seed = seed});
    std::vector<absl::Duration> out;
    for (int i = 0; i < 8; ++i) out.push_back(backoff.Failure());
    return out;
  };
  EXPECT_EQ(waits(11), waits(11));
  EXPECT_NE(waits(11), waits(12));
  // Full jitter: waits in [0, 1] s.
  for (absl::Duration w : waits(11)) {
    EXPECT_GE(w, absl::ZeroDuration());
    EXPECT_LE(w, Seconds(1));
  }
}

}  // namespace
}  // namespace aloe::worker
