#include "server/core/local_work.h"

#include <gtest/gtest.h>

#include <cmath>
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
  planner.Forget(1);                          // the fastest leaves: 0.77 becomes the reference
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
  LocalWorkPlanner budget(
      {.mode = Mode::kTimeBudget, .local_steps = 7, .time_budget_seconds = 2.5});
  EXPECT_EQ(budget.PlanFor(1).steps, 700u);
  EXPECT_DOUBLE_EQ(budget.PlanFor(1).time_budget_seconds, 2.5);
}

// Round alignment (aligned DyLU): speeds (1, 0.77, 0.38, 0.17) steps/s, H = 20, so the round
// period is P = 20 s. Every number below is worked out by hand.
class AlignedDyLUTest : public ::testing::Test {
 protected:
  AlignedDyLUTest() : planner_({.mode = Mode::kDyLU, .local_steps = 20, .align_rounds = true}) {
    const double speeds[] = {1.0, 0.77, 0.38, 0.17};
    for (uint64_t w = 0; w < 4; ++w) planner_.ReportSpeed(w + 1, speeds[w]);
  }
  absl::Time At(double seconds) const { return t0_ + absl::Seconds(seconds); }

  const absl::Time t0_ = absl::FromUnixSeconds(1000);
  LocalWorkPlanner planner_;
};

TEST_F(AlignedDyLUTest, WorkersStartingTogetherGetEq6AndTheirSlack) {
  // The first plan begins round 1, ending at t0 + 20.
  const LocalWorkPlanner::Plan p1 = planner_.PlanFor(1, {.at = At(0)});
  EXPECT_EQ(p1.steps, 20u);
  EXPECT_EQ(p1.round, 1u);
  EXPECT_DOUBLE_EQ(p1.slack_seconds, 0.0);
  EXPECT_EQ(planner_.round_end(), At(20));
  // Eq. 6: floor(0.77 * 20) = 15, floor(0.38 * 20) = 7, floor(0.17 * 20) = 3; they finish
  // 20 - 15 / 0.77 = 0.519..., 20 - 7 / 0.38 = 1.578..., 20 - 3 / 0.17 = 2.352... s early.
  const LocalWorkPlanner::Plan p2 = planner_.PlanFor(2, {.at = At(0)});
  const LocalWorkPlanner::Plan p3 = planner_.PlanFor(3, {.at = At(0)});
  const LocalWorkPlanner::Plan p4 = planner_.PlanFor(4, {.at = At(0)});
  EXPECT_EQ(p2.steps, 15u);
  EXPECT_EQ(p3.steps, 7u);
  EXPECT_EQ(p4.steps, 3u);
  EXPECT_NEAR(p2.slack_seconds, 0.5194805, 1e-6);
  EXPECT_NEAR(p3.slack_seconds, 1.5789474, 1e-6);
  EXPECT_NEAR(p4.slack_seconds, 2.3529412, 1e-6);
  for (const auto& p : {p2, p3, p4}) EXPECT_EQ(p.round, 1u);
  // The same as unaligned Eq. 6.
  for (uint64_t w = 1; w <= 4; ++w) {
    EXPECT_EQ(planner_.PlanFor(w, {.at = At(0)}).steps, planner_.PlanFor(w).steps);
  }

  // The round's window releases its workers at t0 + 20.4 (round 1): round 2 begins there and
  // every released worker gets Eq. 6 again, however late its own request is handled.
  EXPECT_EQ(planner_.PlanFor(4, {.at = At(20.4), .released_round = 1}).steps, 3u);
  EXPECT_EQ(planner_.round(), 2u);
  EXPECT_EQ(planner_.round_end(), At(40.4));
  const LocalWorkPlanner::Plan again = planner_.PlanFor(1, {.at = At(20.4), .released_round = 1});
  EXPECT_EQ(again.steps, 20u);
  EXPECT_EQ(again.round, 2u);
  EXPECT_EQ(planner_.round(), 2u);  // not a third round
}

TEST_F(AlignedDyLUTest, LateStartsAreCutOrStretchedToFinishWithTheRound) {
  planner_.PlanFor(1, {.at = At(0)});  // round 1 ends at t0 + 20
  // Worker 2 (0.77 steps/s) starts at t0 + 8.3: 11.7 s are left, floor(0.77 * 11.7) = 9 >= 15/2
  // steps: it joins round 1 with 9 steps and finishes 11.7 - 9 / 0.77 = 0.0116... s early
  // (unaligned it would run 15 steps and end at t0 + 27.8).
  const LocalWorkPlanner::Plan cut = planner_.PlanFor(2, {.at = At(8.3)});
  EXPECT_EQ(cut.steps, 9u);
  EXPECT_EQ(cut.round, 1u);
  EXPECT_NEAR(cut.slack_seconds, 11.7 - 9 / 0.77, 1e-9);
  // Worker 3 (0.38 steps/s) starts at t0 + 13: 7 s left give floor(2.66) = 2 < ceil(7 / 2) = 4
  // steps, too short: it runs to the next round end, t0 + 40: floor(0.38 * 27) = 10 steps.
  const LocalWorkPlanner::Plan stretched = planner_.PlanFor(3, {.at = At(13)});
  EXPECT_EQ(stretched.steps, 10u);
  EXPECT_EQ(stretched.round, 2u);
  EXPECT_NEAR(stretched.slack_seconds, 27 - 10 / 0.38, 1e-9);
  EXPECT_EQ(planner_.round(), 1u);  // a late start never begins a round
  // Round 1's window releases worker 1 at t0 + 20: round 2 runs to t0 + 40.
  EXPECT_EQ(planner_.PlanFor(1, {.at = At(20), .released_round = 1}).round, 2u);
  // Worker 4 missed round 1's window; its own window (still round 1) releases it at t0 + 26. It
  // joins round 2 like any late start: 14 s left, floor(0.17 * 14) = 2 >= ceil(3 / 2) steps.
  const LocalWorkPlanner::Plan straggler = planner_.PlanFor(4, {.at = At(26), .released_round = 1});
  EXPECT_EQ(straggler.steps, 2u);
  EXPECT_EQ(straggler.round, 2u);
  EXPECT_NEAR(straggler.slack_seconds, 14 - 2 / 0.17, 1e-9);
  EXPECT_EQ(planner_.round(), 2u);
  EXPECT_EQ(planner_.round_end(), At(40));
}

TEST_F(AlignedDyLUTest, UnmeasuredWorkerGetsATimeBudgetToTheRoundEnd) {
  planner_.PlanFor(1, {.at = At(0)});
  // Not measured yet: H steps at most, stopping at the round end (12.5 s >= P / 2 away) ...
  const LocalWorkPlanner::Plan p = planner_.PlanFor(99, {.at = At(7.5)});
  EXPECT_EQ(p.steps, 20u);
  EXPECT_DOUBLE_EQ(p.time_budget_seconds, 12.5);
  EXPECT_EQ(p.round, 1u);
  // ... or at the next one when the round end is closer than P / 2: 20 - 15 + 20 = 25 s.
  const LocalWorkPlanner::Plan q = planner_.PlanFor(98, {.at = At(15)});
  EXPECT_DOUBLE_EQ(q.time_budget_seconds, 25.0);
  EXPECT_EQ(q.round, 2u);
  // Without alignment it gets H steps and no budget (paper 002: H until measured).
  EXPECT_EQ(planner_.PlanFor(99).steps, 20u);
  EXPECT_EQ(planner_.PlanFor(99).time_budget_seconds, 0.0);
}

TEST_F(AlignedDyLUTest, UngatedStartsFollowATimeGrid) {
  // Layer groups: no window releases a task. The first start begins round 1 at t0 + 3 (ends
  // t0 + 23); worker 2 asking just before that end is stretched to the next one: floor(0.77 *
  // 20.5) = 15 steps of round 2.
  const LocalWorkPlanner::Plan first = planner_.PlanFor(1, {.at = At(3), .ungated = true});
  EXPECT_EQ(first.steps, 20u);
  EXPECT_EQ(first.round, 1u);
  EXPECT_EQ(planner_.round_end(), At(23));
  const LocalWorkPlanner::Plan early = planner_.PlanFor(2, {.at = At(22.5), .ungated = true});
  EXPECT_EQ(early.steps, 15u);
  EXPECT_EQ(early.round, 2u);
  EXPECT_EQ(planner_.round(), 1u);
  // Worker 1 asking just after round 1 ended moves the grid on one period: round 2 is
  // [t0 + 23, t0 + 43), 19.8 s left, floor(1 x 19.8) = 19 steps.
  const LocalWorkPlanner::Plan late = planner_.PlanFor(1, {.at = At(23.2), .ungated = true});
  EXPECT_EQ(late.steps, 19u);
  EXPECT_EQ(late.round, 2u);
  EXPECT_EQ(planner_.round_end(), At(43));
  // Nobody asked for two periods: at t0 + 90 the grid is in round 5, [t0 + 83, t0 + 103); 13 s
  // left give worker 3 floor(0.38 x 13) = 4 >= ceil(7 / 2) steps.
  const LocalWorkPlanner::Plan after = planner_.PlanFor(3, {.at = At(90), .ungated = true});
  EXPECT_EQ(planner_.round(), 5u);
  EXPECT_EQ(planner_.round_end(), At(103));
  EXPECT_EQ(after.steps, 4u);
  EXPECT_EQ(after.round, 5u);
  EXPECT_NEAR(after.slack_seconds, 13 - 4 / 0.38, 1e-9);
  // Before any speed is known there is no grid: Eq. 6 (H) and no round.
  LocalWorkPlanner fresh({.mode = Mode::kDyLU, .local_steps = 20, .align_rounds = true});
  const LocalWorkPlanner::Plan unknown = fresh.PlanFor(1, {.at = At(0), .ungated = true});
  EXPECT_EQ(unknown.steps, 20u);
  EXPECT_EQ(unknown.round, 0u);
  EXPECT_EQ(fresh.round(), 0u);
}

TEST(LocalWorkPlannerTest, AlignmentNeedsAMeasuredSpeedAndDyLU) {
  LocalWorkPlanner planner({.mode = Mode::kDyLU, .local_steps = 20, .align_rounds = true});
  // Nobody measured: no period; H steps (paper 002: H until measured) in round 1, whose end is
  // unknown (infinite slack: its window waits for the whole round).
  const LocalWorkPlanner::Plan first = planner.PlanFor(1, {.at = absl::FromUnixSeconds(5)});
  EXPECT_EQ(first.steps, 20u);
  EXPECT_EQ(first.round, 1u);
  EXPECT_EQ(first.time_budget_seconds, 0.0);
  EXPECT_TRUE(std::isinf(first.slack_seconds));
  EXPECT_EQ(planner.round(), 1u);
  EXPECT_EQ(planner.round_end(), absl::InfiniteFuture());
  // A worker measured meanwhile joins round 1 with Eq. 6 (no period to cut it to yet).
  planner.ReportSpeed(2, 1.0);
  planner.ReportSpeed(3, 0.5);
  const LocalWorkPlanner::Plan joiner = planner.PlanFor(3, {.at = absl::FromUnixSeconds(9)});
  EXPECT_EQ(joiner.steps, 10u);
  EXPECT_EQ(joiner.round, 1u);
  // Round 1's window releases worker 2 at t = 30: round 2 has P = 20 / 1 s.
  const LocalWorkPlanner::Plan second =
      planner.PlanFor(2, {.at = absl::FromUnixSeconds(30), .released_round = 1});
  EXPECT_EQ(second.steps, 20u);
  EXPECT_EQ(second.round, 2u);
  EXPECT_EQ(planner.round_end(), absl::FromUnixSeconds(50));
  LocalWorkPlanner fixed({.mode = Mode::kFixed, .local_steps = 7, .align_rounds = true});
  fixed.ReportSpeed(1, 3.0);
  const LocalWorkPlanner::Plan p = fixed.PlanFor(1, {.at = absl::FromUnixSeconds(5)});
  EXPECT_EQ(p.steps, 7u);
  EXPECT_EQ(p.round, 0u);
}

}  // namespace
}  // namespace aloe::server
