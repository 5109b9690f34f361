// What the worker agent does with a task that failed: whether the failure drops the task (the
// agent asks for work again) or ends the run, how long to wait before asking again, which task
// to give up, and a bounded log of the drops.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "proto/aloe.pb.h"

namespace aloe::worker {

// Capped exponential backoff over consecutive failures: no wait after the first, then `initial`,
// doubling up to `max`. Not thread-safe.
class Backoff {
 public:
  Backoff(absl::Duration initial, absl::Duration max) : initial_(initial), max_(max) {}
  // Counts one more failure and returns how long to wait before the next try.
  absl::Duration Failure();
  // A success: the next failure waits nothing again.
  void Reset() { failures_ = 0; }
  uint64_t failures() const { return failures_; }

 private:
  const absl::Duration initial_;
  const absl::Duration max_;
  uint64_t failures_ = 0;
};

// Not thread-safe.
class TaskDrops {
 public:
  // Waits between consecutive drops follow Backoff(backoff_initial, backoff_max). Drops for want
  // of the server (kUnavailable) are logged at most once per `log_interval`, with a count of the
  // others. `clock` must outlive this.
  TaskDrops(absl::Duration backoff_initial, absl::Duration backoff_max, absl::Duration log_interval,
            const Clock& clock);

  // A task that ended in `status`. Returns nullopt when the status ends the run; else the task
  // was dropped (kFailedPrecondition, kNotFound, kUnavailable) and the result is how long to
  // wait before asking for work again. `log_prefix` starts the log line (e.g. the rank).
  std::optional<absl::Duration> Drop(const v1::Task& task, const absl::Status& status,
                                     const std::string& log_prefix);
  // A task done: the next drop waits nothing.
  void Done() { backoff_.Reset(); }
  // The TRAIN task dropped on kFailedPrecondition (it cannot succeed when asked for again, e.g.
  // its base version is gone) that the next RequestTask names so that the server ends it; 0 for
  // none.
  uint64_t given_up() const { return given_up_; }
  // The server has been told (a RequestTask that named given_up() succeeded).
  void ClearGivenUp() { given_up_ = 0; }

 private:
  Backoff backoff_;
  const absl::Duration log_interval_;
  const Clock& clock_;
  uint64_t given_up_ = 0;
  absl::Time next_log_ = absl::InfinitePast();
  uint64_t not_logged_ = 0;
};

}  // namespace aloe::worker
