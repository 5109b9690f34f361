#include "worker/task_drops.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "common/logging.h"

namespace aloe::worker {

TaskDrops::TaskDrops(RetryBackoff::Options backoff, absl::Duration log_interval, const Clock& clock)
    : backoff_(backoff), log_interval_(log_interval), clock_(clock) {}

std::optional<absl::Duration> TaskDrops::Drop(const v1::Task& task, const absl::Status& status,
                                              const std::string& log_prefix) {
  if (status.code() != absl::StatusCode::kFailedPrecondition &&
      status.code() != absl::StatusCode::kNotFound &&
      status.code() != absl::StatusCode::kUnavailable) {
    return std::nullopt;
  }
  // The server dropped this round (stale version, expired lease) or went away meanwhile
  // (restart, a shard process down): ask again, waiting longer after each drop in a row.
  if (task.kind() == v1::Task::TRAIN && status.code() == absl::StatusCode::kFailedPrecondition) {
    given_up_ = task.task_id();
  }
  const absl::Duration delay = backoff_.Failure();
  Log(task, status, log_prefix, delay);
  return delay;
}

void TaskDrops::Note(const v1::Task& task, const absl::Status& status,
                     const std::string& log_prefix) {
  Log(task, status, log_prefix, backoff_.last());
}

void TaskDrops::Log(const v1::Task& task, const absl::Status& status, const std::string& log_prefix,
                    absl::Duration delay) {
  // Each drop the server decided is logged; a server or shard process away (kUnavailable)
  // fails every try alike, so those are logged at a bounded rate with a count.
  const bool unavailable = status.code() == absl::StatusCode::kUnavailable;
  if (!unavailable || clock_.Now() >= next_log_) {
    ALOE_LOG_WARNING(
        "worker", "%stask %d dropped: %s%s", log_prefix, task.task_id(), status.message(),
        not_logged_ == 0 ? std::string()
                         : absl::StrFormat(" (%d more dropped since the last note; asking again "
                                           "in %.2f s)",
                                           not_logged_, absl::ToDoubleSeconds(delay)));
    not_logged_ = 0;
    if (unavailable) next_log_ = clock_.Now() + log_interval_;
  } else {
    ++not_logged_;
  }
}

}  // namespace aloe::worker
