#include "common/step_times.h"

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace aloe {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(ParseTraceTest, BuildsPerWorkerCyclesInFileOrder) {
  auto profiles = ParseTrace("0, 0.5\n1,2\n\n# comment\n0,1.5\n", "trace.txt");
  ASSERT_THAT(profiles, IsOk());
  ASSERT_EQ(profiles->size(), 2u);
  EXPECT_THAT((*profiles)[0].cycle(), ElementsAre(0.5, 1.5));
  EXPECT_THAT((*profiles)[1].cycle(), ElementsAre(2.0));
}

TEST(ParseTraceTest, ErrorsNameTheLine) {
  EXPECT_THAT(ParseTrace("0,1\n1,abc\n", "trace.txt"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("trace.txt line 2")));
  EXPECT_THAT(ParseTrace("0,1\n\n0,1,2\n", "trace.txt"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("trace.txt line 3: expected 'worker_index,seconds_per_step'")));
  EXPECT_THAT(ParseTrace("0,-1\n", "trace.txt"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("trace.txt line 1")));
  EXPECT_THAT(ParseTrace("0,inf\n", "trace.txt"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("trace.txt line 1")));
  EXPECT_THAT(ParseTrace("x,1\n", "trace.txt"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("trace.txt line 1")));
  EXPECT_THAT(ParseTrace("0,1\n2,1\n", "trace.txt"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("worker 1 has no step")));
  EXPECT_THAT(ParseTrace("# nothing\n", "trace.txt"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no step times")));
  EXPECT_THAT(LoadTrace("/nonexistent/trace.txt"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("/nonexistent/trace.txt")));
}

TEST(ParseSpeedsTest, ConvertsStepsPerSecondToStepTimes) {
  auto profiles = ParseSpeeds("1,0.5,4");
  ASSERT_THAT(profiles, IsOk());
  ASSERT_EQ(profiles->size(), 3u);
  EXPECT_THAT((*profiles)[1].cycle(), ElementsAre(2.0));
  EXPECT_THAT((*profiles)[2].cycle(), ElementsAre(0.25));
  EXPECT_THAT(ParseSpeeds("1,0,2"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("speeds item 1")));
  EXPECT_THAT(ParseSpeeds("1,,2"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("speeds item 1")));
  EXPECT_THAT(ParseSpeeds(""), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("item 0")));
}

TEST(StepSlowdownsTest, FactorsAreStepTimesOverTheFastestStepOfTheWholeTrace) {
  // Worker 0 alternates 0.5 s and 1.5 s steps; worker 1 runs 2 s steps; the fastest step of the
  // trace (0.5 s, worker 0) runs at the hardware's own speed.
  auto trace = ParseTrace("0,0.5\n1,2\n0,1.5\n", "t");
  ASSERT_THAT(trace, IsOk());
  auto w0 = StepSlowdowns::ForWorker(*trace, 0);
  auto w1 = StepSlowdowns::ForWorker(*trace, 1);
  ASSERT_THAT(w0, IsOk());
  ASSERT_THAT(w1, IsOk());
  EXPECT_THAT(w0->factors(), ElementsAre(1.0, 3.0));
  EXPECT_THAT(w1->factors(), ElementsAre(4.0));
  // The cycle continues where the last call left it.
  EXPECT_EQ(w0->Next(), 1.0);
  EXPECT_EQ(w0->Next(), 3.0);
  EXPECT_EQ(w0->Next(), 1.0);
  EXPECT_EQ(w1->Next(), 4.0);
  EXPECT_EQ(w1->Next(), 4.0);
}

TEST(StepSlowdownsTest, ConstantSpeedsReduceToTheSlowdownFlag) {
  // Speeds 1, 0.5, 0.25: --slowdown = fastest speed / own speed = 1, 2, 4.
  auto trace = ParseSpeeds("1,0.5,0.25");
  ASSERT_THAT(trace, IsOk());
  for (int w = 0; w < 3; ++w) {
    auto slowdowns = StepSlowdowns::ForWorker(*trace, w);
    ASSERT_THAT(slowdowns, IsOk());
    EXPECT_THAT(slowdowns->factors(), ElementsAre(static_cast<double>(1 << w)));
  }
}

TEST(StepSlowdownsTest, RefusesAWorkerOutsideTheTrace) {
  auto trace = ParseTrace("0,1\n1,2\n", "t");
  ASSERT_THAT(trace, IsOk());
  EXPECT_THAT(StepSlowdowns::ForWorker(*trace, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("worker 2")));
  EXPECT_THAT(StepSlowdowns::ForWorker(*trace, -1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("workers 0..1")));
}

TEST(StepSlowdownsTest, LoadsFromAFileOrNothing) {
  auto none = LoadStepSlowdowns("", 0);
  ASSERT_THAT(none, IsOk());
  EXPECT_FALSE(none->has_value());
  const std::string path = ::testing::TempDir() + "/step_trace.txt";
  {
    std::ofstream out(path);
    out << "# two workers\n0,0.25\n1,1\n1,0.5\n";
  }
  auto loaded = LoadStepSlowdowns(path, 1);
  ASSERT_THAT(loaded, IsOk());
  ASSERT_TRUE(loaded->has_value());
  EXPECT_THAT((*loaded)->factors(), ElementsAre(4.0, 2.0));
  EXPECT_THAT(LoadStepSlowdowns(path, 5),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("worker 5")));
  EXPECT_THAT(LoadStepSlowdowns(path + ".missing", 0),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("step_trace.txt.missing")));
  std::remove(path.c_str());
}

}  // namespace
}  // namespace aloe
