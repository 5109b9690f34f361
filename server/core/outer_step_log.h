// What the server logs about its outer steps: one line per step while steps come at most one per
// `min_interval`, as in a DiLoCo job with rounds of seconds or minutes; faster (many workers,
// short rounds) the steps in between are folded into the next line, so a job applying a hundred
// steps a second still writes about one line a second instead of flooding its log. The first
// step always has a line. Pure logic (docs/architecture.md, "Dependency rule"): the caller passes
// the time and logs the lines.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/time/time.h"

namespace aloe::server {

class OuterStepLog {
 public:
  explicit OuterStepLog(absl::Duration min_interval = absl::Seconds(1))
      : min_interval_(min_interval) {}

  // The outer step that produced `version` over `updates` updates whose mean train loss was
  // `mean_loss`, at `now`. Returns the line to log, or nullopt when the step is folded into a
  // later line (less than min_interval since the last line Step returned). A lone step's line:
  //   "version V: outer step over N updates, mean train loss L"
  // several steps' (the versions after the last line up to this one):
  //   "versions A-B: K outer steps over N updates in the last S s, mean train loss L"
  // where L is the mean over all N updates and S the time since the last line.
  std::optional<std::string> Step(absl::Time now, uint64_t version, uint64_t updates,
                                  double mean_loss);
  // The line for the steps folded since the last line, if any, without "in the last S s" (at the
  // end of a job, so that its last version appears in the log); nullopt when none is pending.
  std::optional<std::string> Flush();

 private:
  // The line for the pending steps (`span`: since the last line, when one was logged); resets
  // them.
  std::string Take(std::optional<absl::Duration> span);

  const absl::Duration min_interval_;
  std::optional<absl::Time> last_line_;  // when the last line was returned
  uint64_t first_version_ = 0;           // of the pending steps
  uint64_t last_version_ = 0;
  double last_mean_loss_ = 0;
  uint64_t steps_ = 0;  // pending: folded since the last line, plus the current one
  uint64_t updates_ = 0;
  double loss_sum_ = 0;  // sum over the pending updates of their train loss
};

}  // namespace aloe::server
