#include "server/core/local_work.h"

#include <algorithm>
#include <cmath>

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

LocalWorkPlanner::Plan LocalWorkPlanner::PlanFor(uint64_t worker) const {
  const uint32_t h = std::max<uint32_t>(1, options_.local_steps);
  Plan plan;
  switch (options_.mode) {
    case Mode::kFixed:
      plan.steps = h;
      break;
    case Mode::kDyLU: {
      const double v = speed(worker);
      double fastest = 0;
      for (const auto& [id, s] : speeds_) fastest = std::max(fastest, s);
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

}  // namespace aloe::server
