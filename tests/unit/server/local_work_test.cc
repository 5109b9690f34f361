#include "server/core/local_work.h"

#include <gtest/gtest.h>

#include <random>

namespace aloe::server {
namespace {

using Mode = LocalWorkPlanner::Mode;

TEST(LocalWorkPlannerTest, DyLUGoldenStepsForVeryHeterogeneousWorkers) {
  LocalWorkPlanner planner({.mode = Mode::kDyLU, .local_steps = 50});
  const double speeds[] = {1.0, 0.77, 0.38, 0.17};
  for (uint64_t w = 0; w < 4; ++w) planner.ReportSpeed(w + 1, speeds[w]);
  // paper 002 Eq. 6: floor(v / v_max * H) = (50, 38.5, 19, 8.5) floored.
  EXPECT_EQ(planner.PlanFor(1).steps, 50u);
  EXPECT_EQ(planner.PlanFor(2).steps, 38u);
  EXPECT_EQ(planner.PlanFor(3).steps, 19u);
  EXPECT_EQ(planner.PlanFor(4).steps, 8u);
  EXPECT_EQ(planner.PlanFor(99).steps, 50u);  // unmeasured worker gets H
  planner.Forget(1);  // the fastest leaves: 0.77 becomes the reference
  EXPECT_EQ(planner.PlanFor(2).steps, 50u);
  EXPECT_EQ(planner.PlanFor(4).steps, 11u);  // floor(0.17 / 0.77 * 50) = floor(11.04)
}

TEST(LocalWorkPlannerTest, DyLUNeverGivesZeroSteps) {
  LocalWorkPlanner planner({.mode = Mode::kDyLU, .local_steps = 10});
  planner.ReportSpeed(1, 100.0);
  planner.ReportSpeed(2, 0.5);
  EXPECT_EQ(planner.PlanFor(2).steps, 1u);
}

TEST(LocalWorkPlannerTest, SpeedEstimateConvergesAfterNoisyReports) {
  LocalWorkPlanner planner({.mode = Mode::kDyLU, .local_steps = 50});
  std::mt19937 rng(5);
  std::normal_distribution<double> noise(0, 0.05);
  planner.ReportSpeed(1, 1.0);
  for (int i = 0; i < 200; ++i) planner.ReportSpeed(2, 0.4 * (1 + noise(rng)));
  EXPECT_NEAR(planner.speed(2), 0.4, 0.02);
  EXPECT_GE(planner.PlanFor(2).steps, 19u);
  EXPECT_LE(planner.PlanFor(2).steps, 20u);
  planner.ReportSpeed(2, -1);  // garbage is ignored
  planner.ReportSpeed(2, std::nan(""));
  EXPECT_NEAR(planner.speed(2), 0.4, 0.02);
}

TEST(LocalWorkPlannerTest, FixedAndTimeBudget) {
  LocalWorkPlanner fixed({.mode = Mode::kFixed, .local_steps = 7});
  fixed.ReportSpeed(1, 3.0);
  EXPECT_EQ(fixed.PlanFor(1).steps, 7u);
  EXPECT_EQ(fixed.PlanFor(1).time_budget_seconds, 0.0);
  LocalWorkPlanner budget({.mode = Mode::kTimeBudget, .local_steps = 7, .time_budget_seconds = 2.5});
  EXPECT_EQ(budget.PlanFor(1).steps, 700u);
  EXPECT_DOUBLE_EQ(budget.PlanFor(1).time_budget_seconds, 2.5);
}

}  // namespace
}  // namespace aloe::server
