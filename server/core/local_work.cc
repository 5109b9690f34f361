#include "server/core/local_work.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace aloe::server {

void LocalWorkPlanner::ReportSpeed(uint64_t worker, double steps_per_second) {
  if (!(steps_per_second > 0) || !std::isfinite(steps_per_second)) return;
  auto [it, inserted] = speeds_.emplace(worker, steps_per_second);
  if (!inserted) {
    const double a = options_.speed_ema_alpha;
    it->second = a * steps_per_second + (1 - a) * it->second;
  }
}

double LocalWorkPlanner::speed(uint64_t worker) const {
  auto it = speeds_.find(worker);
  return it == speeds_.end() ? 0.0 : it->second;
}

double LocalWorkPlanner::fastest() const {
  double fastest = 0;
  for (const auto& [id, s] : speeds_) fastest = std::max(fastest, s);
  return fastest;
}

LocalWorkPlanner::Plan LocalWorkPlanner::PlanFor(uint64_t worker) const {
  const uint32_t h = std::max<uint32_t>(1, options_.local_steps);
  Plan plan;
  switch (options_.mode) {
    case Mode::kFixed:
      plan.steps = h;
      break;
    case Mode::kDyLU: {
      const double v = speed(worker);
      const double fastest = this->fastest();
      if (v <= 0 || fastest <= 0) {
        plan.steps = h;  // not measured yet
      } else {
        // The epsilon keeps exact products (0.38 * 50 = 19) from rounding down to 18.
        const double steps = std::floor(v / fastest * h + 1e-9);
        plan.steps = static_cast<uint32_t>(std::clamp(steps, 1.0, static_cast<double>(h)));
      }
      break;
    }
    case Mode::kTimeBudget:
      plan.steps = options_.max_steps > 0 ? options_.max_steps : 100 * h;
      plan.time_budget_seconds = options_.time_budget_seconds;
      break;
  }
  return plan;
}

LocalWorkPlanner::Plan LocalWorkPlanner::PlanFor(uint64_t worker, const Start& start) {
  Plan plan = PlanFor(worker);
  if (options_.mode != Mode::kDyLU || !options_.align_rounds) return plan;
  if (start.ungated) return PlanUngated(worker, start, plan);
  const double fastest = this->fastest();
  if (!(fastest > 0) && (round_ == 0 || start.released_round >= round_)) {
    // Nobody measured yet: a round without a known end; its window waits for all of it.
    round_ = std::max(round_, start.released_round) + 1;
    round_start_ = start.at;
    round_end_ = absl::InfiniteFuture();
  }
  if (round_end_ == absl::InfiniteFuture() && start.released_round < round_) {
    // A round of unknown length is in flight: join it with Eq. 6 (H when not measured).
    plan.round = round_;
    plan.slack_seconds = std::numeric_limits<double>::infinity();
    return plan;
  }
  const double period = std::max<uint32_t>(1, options_.local_steps) / fastest;  // P
  if (round_ == 0 || start.released_round >= round_) {
    // The current round's window released its workers (or this is the first round).
    round_ = std::max(round_, start.released_round) + 1;
    round_start_ = start.at;
    round_end_ = start.at + absl::Seconds(period);
  }
  if (start.at == round_start_ && speed(worker) > 0) {
    // Released with the round's cohort: Eq. 6 itself (no rounding of the period in time units).
    plan.round = round_;
    plan.slack_seconds = std::max(0.0, period - plan.steps / speed(worker));
    return plan;
  }
  return JoinRound(worker, start, period, plan);
}

LocalWorkPlanner::Plan LocalWorkPlanner::PlanUngated(uint64_t worker, const Start& start,
                                                     Plan plan) {
  const double fastest = this->fastest();
  if (!(fastest > 0)) return plan;  // no period yet: Eq. 6 (H), no round
  const absl::Duration period =
      absl::Seconds(std::max<uint32_t>(1, options_.local_steps) / fastest);
  if (round_ == 0) {
    round_ = 1;
    round_start_ = start.at;
    round_end_ = start.at + period;
  }
  if (start.at >= round_end_) {
    // The rounds in between passed without a start: the grid moves on by whole periods.
    absl::Duration remainder;
    const int64_t passed = absl::IDivDuration(start.at - round_end_, period, &remainder);
    round_ += static_cast<uint64_t>(passed) + 1;
    round_start_ = round_end_ + passed * period;
    round_end_ = round_start_ + period;
  }
  return JoinRound(worker, start, absl::ToDoubleSeconds(period), plan);
}

LocalWorkPlanner::Plan LocalWorkPlanner::JoinRound(uint64_t worker, const Start& start,
                                                   double period, Plan plan) const {
  // Seconds from the start to the end of the round in flight (negative when it is over).
  const double until_end = absl::ToDoubleSeconds(round_end_ - start.at);
  const double v = speed(worker);
  if (!(v > 0)) {
    // Not measured yet: a time budget to the first round end at least P / 2 away, at most H
    // steps (an unaligned H would put the worker out of phase with everybody for good).
    const double k = std::max(0.0, std::ceil((period / 2 - until_end) / period - 1e-9));
    plan.round = round_ + static_cast<uint64_t>(k);
    plan.time_budget_seconds = until_end + k * period;
    return plan;
  }
  // The first round end that leaves at least half of Eq. 6's steps (and at least one).
  const double need = std::max(1.0, std::ceil(plan.steps / 2.0));
  double k = std::max(0.0, std::ceil((need / v - until_end) / period - 1e-9));
  double steps = std::floor(v * (until_end + k * period) + 1e-9);
  while (steps < need) {  // floor() may fall just short of the bound
    ++k;
    steps = std::floor(v * (until_end + k * period) + 1e-9);
  }
  plan.steps = static_cast<uint32_t>(std::min(steps, 1e9));
  plan.round = round_ + static_cast<uint64_t>(k);
  plan.slack_seconds = std::max(0.0, until_end + k * period - plan.steps / v);
  return plan;
}

}  // namespace aloe::server
