// Decides how much local work each task carries:
//   kFixed:      H steps for everybody;
//   kDyLU:       Dynamic Local Updates (paper 002 Eq. 6): steps(w) = floor(v(w) / max_w' v(w') * H),
//                at least 1, where v is each worker's measured steps/s (an online EMA of its
//                reports); a worker not yet measured gets H; H is the fastest worker's steps;
//   kTimeBudget: A-EDiT (paper 000 Sec. 3.3): a wall-clock budget tau_time; the worker runs
//                steps until the first step end at or after the budget (capped at max_steps).
// Pure logic, no clock: speeds come from reports. Not thread-safe.
#pragma once

#include <cstdint>
#include <map>

namespace aloe::server {

class LocalWorkPlanner {
 public:
  enum class Mode { kFixed, kDyLU, kTimeBudget };
  struct Options {
    Mode mode = Mode::kFixed;
    uint32_t local_steps = 50;         // H
    double time_budget_seconds = 0;    // tau_time, kTimeBudget only
    uint32_t max_steps = 0;            // cap for budgeted tasks; 0 = 100 * H
    double speed_ema_alpha = 0.3;      // weight of a new speed report
  };
  struct Plan {
    uint32_t steps = 0;                // exact steps, or the cap when budgeted
    double time_budget_seconds = 0;    // > 0: stop at the first step end after this
  };

  explicit LocalWorkPlanner(const Options& options) : options_(options) {}

  // Folds a measured speed into the worker's estimate (ignored unless finite and > 0).
  void ReportSpeed(uint64_t worker, double steps_per_second);
  // The worker left: its speed no longer defines the fastest one.
  void Forget(uint64_t worker) { speeds_.erase(worker); }
  // Estimated steps/s of a worker; 0 when not measured yet.
  double speed(uint64_t worker) const;

  Plan PlanFor(uint64_t worker) const;

 private:
  Options options_;
  std::map<uint64_t, double> speeds_;
};

}  // namespace aloe::server
