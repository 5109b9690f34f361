#include "server/core/outer_step_log.h"

#include "absl/strings/str_format.h"

namespace aloe::server {

std::optional<std::string> OuterStepLog::Step(absl::Time now, uint64_t version, uint64_t updates,
                                              double mean_loss) {
  if (steps_ == 0) first_version_ = version;
  last_version_ = version;
  last_mean_loss_ = mean_loss;
  ++steps_;
  updates_ += updates;
  loss_sum_ += mean_loss * static_cast<double>(updates);
  if (last_line_.has_value() && now - *last_line_ < min_interval_) return std::nullopt;
  std::optional<absl::Duration> span;
  if (last_line_.has_value()) span = now - *last_line_;
  last_line_ = now;
  return Take(span);
}

std::optional<std::string> OuterStepLog::Flush() {
  if (steps_ == 0) return std::nullopt;
  return Take(std::nullopt);
}

std::string OuterStepLog::Take(std::optional<absl::Duration> span) {
  std::string line;
  if (steps_ == 1) {
    line = absl::StrFormat("version %d: outer step over %d updates, mean train loss %.4f",
                           last_version_, updates_, last_mean_loss_);
  } else {
    const std::string in_the_last =
        span.has_value() ? absl::StrFormat(" in the last %.1f s", absl::ToDoubleSeconds(*span))
                         : "";
    line = absl::StrFormat("versions %d-%d: %d outer steps over %d updates%s, mean train loss %.4f",
                           first_version_, last_version_, steps_, updates_, in_the_last,
                           loss_sum_ / static_cast<double>(updates_));
  }
  steps_ = 0;
  updates_ = 0;
  loss_sum_ = 0;
  return line;
}

}  // namespace aloe::server
