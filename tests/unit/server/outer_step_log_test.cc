#include "server/core/outer_step_log.h"

#include <gtest/gtest.h>

namespace aloe::server {
namespace {

const absl::Time kStart = absl::FromUnixSeconds(1000);

TEST(OuterStepLogTest, StepsSlowerThanTheIntervalEachGetTheirLine) {
  OuterStepLog log(absl::Seconds(1));
  EXPECT_EQ(log.Step(kStart, 1, 3, 2.5),
            "version 1: outer step over 3 updates, mean train loss 2.5000");
  EXPECT_EQ(log.Step(kStart + absl::Seconds(5), 2, 1, 2.25),
            "version 2: outer step over 1 updates, mean train loss 2.2500");
  // Exactly one interval later: a line of its own.
  EXPECT_EQ(log.Step(kStart + absl::Seconds(6), 3, 2, 2.0),
            "version 3: outer step over 2 updates, mean train loss 2.0000");
  EXPECT_EQ(log.Flush(), std::nullopt);
}

TEST(OuterStepLogTest, FasterStepsAreFoldedIntoTheNextLine) {
  OuterStepLog log(absl::Seconds(1));
  ASSERT_TRUE(log.Step(kStart, 1, 1, 3.0).has_value());  // the first step always has a line
  // Versions 2-4 within the second: no line; version 5 at 1.2 s carries all four.
  EXPECT_EQ(log.Step(kStart + absl::Milliseconds(300), 2, 1, 2.0), std::nullopt);
  EXPECT_EQ(log.Step(kStart + absl::Milliseconds(600), 3, 2, 1.0), std::nullopt);
  EXPECT_EQ(log.Step(kStart + absl::Milliseconds(900), 4, 1, 4.0), std::nullopt);
  // Mean over the 5 updates of versions 2-5: (2 + 2 * 1 + 4 + 1 * 0.5) / 5 = 1.7.
  EXPECT_EQ(log.Step(kStart + absl::Milliseconds(1200), 5, 1, 0.5),
            "versions 2-5: 4 outer steps over 5 updates in the last 1.2 s, mean train loss 1.7000");
  // The interval counts from that line: 2.1 s is 0.9 s after it.
  EXPECT_EQ(log.Step(kStart + absl::Milliseconds(2100), 6, 4, 1.25), std::nullopt);
  EXPECT_EQ(log.Flush(), "version 6: outer step over 4 updates, mean train loss 1.2500");
  EXPECT_EQ(log.Flush(), std::nullopt);  // nothing pending any more
}

TEST(OuterStepLogTest, FlushNamesEveryFoldedStep) {
  OuterStepLog log(absl::Seconds(10));
  ASSERT_TRUE(log.Step(kStart, 7, 2, 1.0).has_value());
  EXPECT_EQ(log.Step(kStart + absl::Seconds(1), 8, 2, 3.0), std::nullopt);
  EXPECT_EQ(log.Step(kStart + absl::Seconds(2), 9, 6, 1.0), std::nullopt);
  // (2 * 3 + 6 * 1) / 8 = 1.5.
  EXPECT_EQ(log.Flush(), "versions 8-9: 2 outer steps over 8 updates, mean train loss 1.5000");
  // After a flush the next step is folded again until the interval since the last LINE passed.
  EXPECT_EQ(log.Step(kStart + absl::Seconds(3), 10, 1, 1.0), std::nullopt);
  EXPECT_EQ(log.Step(kStart + absl::Seconds(10), 11, 1, 2.0),
            "versions 10-11: 2 outer steps over 2 updates in the last 10.0 s, mean train loss "
            "1.5000");
}

}  // namespace
}  // namespace aloe::server
