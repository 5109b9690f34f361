// Decides how much local work each task carries:
//   kFixed:      H steps for everybody;
//   kDyLU:       Dynamic Local Updates (paper 002 Eq. 6): steps(w) = floor(v(w) / max_w' v(w') *
//   H),
//                at least 1, where v is each worker's measured steps/s (an online EMA of its
//                reports); a worker not yet measured gets H; H is the fastest worker's steps;
//   kTimeBudget: A-EDiT (paper 000 Sec. 3.3): a wall-clock budget tau_time; the worker runs
//                steps until the first step end at or after the budget (capped at max_steps).
//
// DyLU round alignment (Options::align_rounds; the server turns it on for DyLU behind a finite
// grace window). Eq. 6 equalises the durations of tasks that start together, which is how the
// paper's DyLU "aligns the completion times across different workers" so that one grace window
// collects them all. Two things break that with a short grace window, and each task's update is
// then applied alone with the staleness of plain async:
//   - floor() quantises each worker's round to whole steps: a worker finishes up to one of its
//     own steps before the fastest one (a step of a 0.17x worker is ~6 fastest steps), longer
//     than a grace window of a fraction of a step; the rounds then have different periods and
//     the workers' phases drift apart for good;
//   - a worker that starts at another time (a new or unmeasured worker, one that missed the
//     window) runs a full round from its own start, so it never meets the others again.
// With alignment, the planner keeps a round: a cohort of tasks planned to end together at the
// round end T. The round period is P = H / max_w' v(w') (the fastest worker's H steps).
//   - A round begins when the window of the current round releases its workers, at the release
//     time C: T = C + P. Every worker released there gets exactly Eq. 6 (it plans from C, not
//     from the time its request arrives).
//   - Any other start at time s (a joiner, a worker released by a window of an older round, the
//     first task after the speed is measured) joins the round in flight: it gets
//     floor(v * (T + k P - s)) steps for the smallest k >= 0 that gives at least half of its
//     Eq. 6 steps (so a task is between 0.5x and 1.5x of Eq. 6) and belongs to round
//     (current + k).
//   - A worker whose speed is not measured yet joins the same way with a time budget of
//     T + k P - s (capped at H steps) instead of a step count.
//   - Before any speed is measured there is no P: the first tasks get H steps (Eq. 6 for
//     unmeasured workers) in round 1, whose end is unknown, and its window waits for all of
//     round 1 (infinite slack): the first round is synchronous, as in sync DiLoCo and in the
//     paper's setting where speeds are known a priori; every worker is measured when it ends.
//     First tasks of H steps applied one by one with growing staleness cost the whole run in
//     the simulations (the model falls behind while the per-data-shard LR schedule moves on). The
//     price is one wait for the slowest worker's first H steps. (A shorter calibration round,
//     ceil(H / 10) steps, avoided that wait and planned the later rounds exactly as designed,
//     but the small aloe-sim model left its bigram loss plateau later at equal and slight
//     speed differences (+2% to +64% perplexity over 8 seeds and levels; better at `very`),
//     also with the data stream held equal and with zero-size calibration updates: a worker-side
//     effect (AdamW state, task assignment), see README "Straggler simulations"; not used.)
//   - Each plan says its round and its slack (T + k P - s - steps / v: how long before the round
//     end the worker is expected to finish; 0 for budgets); the grace window uses them to wait
//     for the rest of a round (GracePeriodAggregation::Expect).
// Workers that start together therefore still get Eq. 6 exactly.
//
// Ungated tasks (Start::ungated: layer groups, where no window releases a task; each group's
// window holds only that group's merge): rounds follow a time grid instead of releases. The
// first start after a speed is known begins round 1 (T = s + P); a start at or after the end of
// the round in flight moves the grid on by whole periods (the round that contains s); every
// start joins the round in flight as above. A worker that asks for its next task as its last
// one ends therefore ends its tasks with the others, on the grid. Before any speed is known,
// tasks get Eq. 6 (H) and no round.
//
// Pure logic, no clock: speeds come from reports, times from the caller. Not thread-safe.
#pragma once

#include <cstdint>
#include <map>

#include "absl/time/time.h"

namespace aloe::server {

class LocalWorkPlanner {
 public:
  enum class Mode { kFixed, kDyLU, kTimeBudget };
  struct Options {
    Mode mode = Mode::kFixed;
    uint32_t local_steps = 50;       // H
    double time_budget_seconds = 0;  // tau_time, kTimeBudget only
    uint32_t max_steps = 0;          // cap for budgeted tasks; 0 = 100 * H
    double speed_ema_alpha = 0.3;    // weight of a new speed report
    bool align_rounds = false;       // kDyLU only: round alignment (see the file comment)
  };
  struct Plan {
    uint32_t steps = 0;              // exact steps, or the cap when budgeted
    double time_budget_seconds = 0;  // > 0: stop at the first step end after this
    uint64_t round = 0;              // aligned DyLU: the round the task belongs to; 0 = none
    double slack_seconds = 0;        // aligned DyLU: expected finish before the round end (inf:
                                     // the round's end is not known yet)
  };
  // When a task starts, for round alignment.
  struct Start {
    absl::Time at;  // the release time, or now for any other start
    // The round of the grace window that released the worker at `at`; 0 when the worker was not
    // released by a window of a round (a first task, a joiner, a window of unaligned tasks).
    uint64_t released_round = 0;
    // No window releases tasks (layer groups): rounds follow the time grid.
    bool ungated = false;
  };

  explicit LocalWorkPlanner(const Options& options) : options_(options) {}

  // Replaces H (and tau_time, in kTimeBudget mode) for the plans from now on: adaptive rank
  // scales them with the push bytes. h >= 1.
  void SetLocalSteps(uint32_t h, double time_budget_seconds) {
    options_.local_steps = h;
    if (options_.mode == Mode::kTimeBudget) options_.time_budget_seconds = time_budget_seconds;
  }

  // Folds a measured speed into the worker's estimate (ignored unless finite and > 0).
  void ReportSpeed(uint64_t worker, double steps_per_second);
  // The worker left: its speed no longer defines the fastest one.
  void Forget(uint64_t worker) { speeds_.erase(worker); }
  // Estimated steps/s of a worker; 0 when not measured yet.
  double speed(uint64_t worker) const;

  // The plan without round alignment (Eq. 6 as is).
  Plan PlanFor(uint64_t worker) const;
  // The plan for a task starting at `start`; with align_rounds in kDyLU mode it may begin a
  // round (see the file comment), otherwise it equals PlanFor(worker).
  Plan PlanFor(uint64_t worker, const Start& start);

  // Aligned DyLU: the current round (0 before the first) and its planned end.
  uint64_t round() const { return round_; }
  absl::Time round_end() const { return round_end_; }

 private:
  // max_w v(w); 0 when nobody is measured.
  double fastest() const;
  // Aligned DyLU, an ungated start (see the file comment).
  Plan PlanUngated(uint64_t worker, const Start& start, Plan plan);
  // The start at `start` joins the round in flight (or a later one): Eq. 6's `plan` becomes the
  // steps (or time budget) to a round end, with the round and slack. round_end_ is finite.
  Plan JoinRound(uint64_t worker, const Start& start, double period, Plan plan) const;

  Options options_;
  std::map<uint64_t, double> speeds_;
  uint64_t round_ = 0;
  absl::Time round_start_ = absl::InfinitePast();
  absl::Time round_end_ = absl::InfinitePast();
};

}  // namespace aloe::server
