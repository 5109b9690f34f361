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
#include "worker/backoff.h"

namespace aloe::worker {

// Not thread-safe.
class TaskDrops {
 public:
  // Waits between consecutive drops follow RetryBackoff(backoff). Drops for want of the server
  // (kUnavailable) are logged at most once per `log_interval`, with a count of the others.
  // `clock` must outlive this.
  TaskDrops(RetryBackoff::Options backoff, absl::Duration log_interval, const Clock& clock);

  // A task that ended in `status`. Returns nullopt when the status ends the run; else the task
  // was dropped (kFailedPrecondition, kNotFound, kUnavailable) and the result is how long to
  // wait before asking for work again. `log_prefix` starts the log line (e.g. the rank).
  std::optional<absl::Duration> Drop(const v1::Task& task, const absl::Status& status,
                                     const std::string& log_prefix);
  // A task done: the next drop waits nothing.
  void Done() { backoff_.Reset(); }
  // The wait the last drop returned; zero after Done.
  absl::Duration backoff() const { return backoff_.last(); }
  // Logs a drop of `task` in `status` that another path handles (an overlapped round's push),
  // under the same bounds as Drop's lines.
  void Note(const v1::Task& task, const absl::Status& status, const std::string& log_prefix);
  // The TRAIN task dropped on kFailedPrecondition (it cannot succeed when asked for again, e.g.
  // its base version is gone) that the next RequestTask names so that the server ends it; 0 for
  // none.
  uint64_t given_up() const { return given_up_; }
  // The server has been told (a RequestTask that named given_up() succeeded).
  void ClearGivenUp() { given_up_ = 0; }

 private:
  void Log(const v1::Task& task, const absl::Status& status, const std::string& log_prefix,
           absl::Duration delay);

  RetryBackoff backoff_;
  const absl::Duration log_interval_;
  const Clock& clock_;
  uint64_t given_up_ = 0;
  absl::Time next_log_ = absl::InfinitePast();
  uint64_t not_logged_ = 0;
};

}  // namespace aloe::worker
