// Step-time profiles: how long each step of a worker takes, as a constant speed or a replayed
// trace. aloe-sim runs them on its virtual clock; aloe-worker replays one worker's trace on real
// hardware (StepSlowdowns), so simulations and real processes run the same stragglers.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace aloe {

// The most workers a speed list or a trace may name.
inline constexpr int kMaxTraceWorkers = 4096;

// A finite number > 0, or kInvalidArgument whose message starts with `what`.
absl::StatusOr<double> ParsePositiveNumber(absl::string_view text, absl::string_view what);
// A worker index in [0, kMaxTraceWorkers), or kInvalidArgument whose message starts with `what`.
absl::StatusOr<int> ParseWorkerIndex(absl::string_view text, absl::string_view what);

// Per-step compute time of one worker: a cycle of seconds-per-step values replayed forever
// across its tasks (a constant speed is a cycle of one). Immutable.
class StepTimeProfile {
 public:
  // kInvalidArgument unless `seconds_per_step` is non-empty and every value is finite and > 0.
  static absl::StatusOr<StepTimeProfile> Create(std::vector<double> seconds_per_step);

  const std::vector<double>& cycle() const { return cycle_; }

 private:
  explicit StepTimeProfile(std::vector<double> cycle) : cycle_(std::move(cycle)) {}
  std::vector<double> cycle_;
};

// Parses --speeds: comma-separated steps per second, one per worker ("1,0.77,0.38,0.17"), into
// constant profiles (seconds per step = 1 / speed). kInvalidArgument naming the bad item when an
// item is not a finite number > 0 or the list is empty.
absl::StatusOr<std::vector<StepTimeProfile>> ParseSpeeds(const std::string& text);

// Parses a step-time trace: one "worker_index,seconds_per_step" per line; each worker's lines,
// in file order, form its cycle. Blank lines and lines starting with '#' are skipped; spaces
// around fields are ignored. Workers must be numbered 0..k-1 without gaps (k <= kMaxTraceWorkers).
// kInvalidArgument whose message starts with "<source> line <n>:" for a malformed line, a bad
// index or a seconds value that is not finite and > 0, or names the missing worker.
absl::StatusOr<std::vector<StepTimeProfile>> ParseTrace(const std::string& text,
                                                        const std::string& source);
// Reads `path` and parses it with ParseTrace. kNotFound when it cannot be opened.
absl::StatusOr<std::vector<StepTimeProfile>> LoadTrace(const std::string& path);

// One worker's profile replayed on real hardware: the k-th step (counted across rounds) is
// slowed by the factor cycle[k mod n] / fastest, where `fastest` is the shortest step time in
// the whole trace, so the trace's fastest step runs at the hardware's own speed and a constant
// trace of speeds reduces to aloe-worker --slowdown = fastest speed / own speed. Not thread-safe.
class StepSlowdowns {
 public:
  // kInvalidArgument naming the worker when `worker` is not an index of `trace`.
  static absl::StatusOr<StepSlowdowns> ForWorker(const std::vector<StepTimeProfile>& trace,
                                                 int worker);

  // The factor (>= 1) of the next step; advances the cycle.
  double Next();
  const std::vector<double>& factors() const { return factors_; }

 private:
  explicit StepSlowdowns(std::vector<double> factors) : factors_(std::move(factors)) {}
  std::vector<double> factors_;
  size_t next_ = 0;
};

// StepSlowdowns::ForWorker(LoadTrace(path), worker); nullopt when `path` is empty.
absl::StatusOr<std::optional<StepSlowdowns>> LoadStepSlowdowns(const std::string& path, int worker);

}  // namespace aloe
