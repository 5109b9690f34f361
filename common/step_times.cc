#include "common/step_times.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace aloe {

absl::StatusOr<double> ParsePositiveNumber(absl::string_view text, absl::string_view what) {
  double value = 0;
  if (!absl::SimpleAtod(absl::StripAsciiWhitespace(text), &value) || !std::isfinite(value) ||
      !(value > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": expected a finite number > 0, got '", text, "'"));
  }
  return value;
}

absl::StatusOr<int> ParseWorkerIndex(absl::string_view text, absl::string_view what) {
  int value = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &value) || value < 0 ||
      value >= kMaxTraceWorkers) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": expected a worker index in [0, ",
                                                   kMaxTraceWorkers, "), got '", text, "'"));
  }
  return value;
}

absl::StatusOr<StepTimeProfile> StepTimeProfile::Create(std::vector<double> seconds_per_step) {
  if (seconds_per_step.empty()) {
    return absl::InvalidArgumentError("a step-time profile needs at least one step time");
  }
  for (size_t i = 0; i < seconds_per_step.size(); ++i) {
    if (!std::isfinite(seconds_per_step[i]) || !(seconds_per_step[i] > 0)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "step time %d of the profile must be finite and > 0, got %g", i, seconds_per_step[i]));
    }
  }
  return StepTimeProfile(std::move(seconds_per_step));
}

absl::StatusOr<std::vector<StepTimeProfile>> ParseSpeeds(const std::string& text) {
  std::vector<StepTimeProfile> profiles;
  int index = 0;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    ALOE_ASSIGN_OR_RETURN(
        const double speed,
        ParsePositiveNumber(item, absl::StrFormat("speeds item %d (steps per second)", index)));
    ALOE_ASSIGN_OR_RETURN(StepTimeProfile profile, StepTimeProfile::Create({1.0 / speed}));
    profiles.push_back(std::move(profile));
    ++index;
  }
  if (profiles.size() > static_cast<size_t>(kMaxTraceWorkers)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("at most %d workers, got %d speeds", kMaxTraceWorkers, profiles.size()));
  }
  return profiles;
}

absl::StatusOr<std::vector<StepTimeProfile>> ParseTrace(const std::string& text,
                                                        const std::string& source) {
  std::map<int, std::vector<double>> cycles;
  int line_number = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line_number;
    const absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty() || line[0] == '#') continue;
    const std::string where = absl::StrFormat("%s line %d", source, line_number);
    std::vector<absl::string_view> fields = absl::StrSplit(line, ',');
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expected 'worker_index,seconds_per_step', got '", line, "'"));
    }
    ALOE_ASSIGN_OR_RETURN(const int worker, ParseWorkerIndex(fields[0], where));
    ALOE_ASSIGN_OR_RETURN(
        const double seconds,
        ParsePositiveNumber(fields[1], absl::StrCat(where, " (seconds_per_step)")));
    cycles[worker].push_back(seconds);
  }
  if (cycles.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": the trace has no step times"));
  }
  std::vector<StepTimeProfile> profiles;
  const int workers = cycles.rbegin()->first + 1;
  for (int w = 0; w < workers; ++w) {
    auto it = cycles.find(w);
    if (it == cycles.end()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: worker %d has no step times (workers must be numbered 0..%d without gaps)", source,
          w, workers - 1));
    }
    ALOE_ASSIGN_OR_RETURN(StepTimeProfile profile, StepTimeProfile::Create(it->second));
    profiles.push_back(std::move(profile));
  }
  return profiles;
}

absl::StatusOr<std::vector<StepTimeProfile>> LoadTrace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open trace file ", path));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return ParseTrace(buffer.str(), path);
}

absl::StatusOr<StepSlowdowns> StepSlowdowns::ForWorker(const std::vector<StepTimeProfile>& trace,
                                                       int worker) {
  if (worker < 0 || static_cast<size_t>(worker) >= trace.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("worker %d is not in the step-time trace (it has workers 0..%d)", worker,
                        static_cast<int>(trace.size()) - 1));
  }
  double fastest = std::numeric_limits<double>::infinity();
  for (const StepTimeProfile& profile : trace) {
    for (double seconds : profile.cycle()) fastest = std::min(fastest, seconds);
  }
  std::vector<double> factors;
  for (double seconds : trace[worker].cycle()) factors.push_back(seconds / fastest);
  return StepSlowdowns(std::move(factors));
}

double StepSlowdowns::Next() {
  const double factor = factors_[next_];
  next_ = (next_ + 1) % factors_.size();
  return factor;
}

absl::StatusOr<std::optional<StepSlowdowns>> LoadStepSlowdowns(const std::string& path,
                                                               int worker) {
  if (path.empty()) return std::nullopt;
  ALOE_ASSIGN_OR_RETURN(const std::vector<StepTimeProfile> trace, LoadTrace(path));
  ALOE_ASSIGN_OR_RETURN(StepSlowdowns slowdowns, StepSlowdowns::ForWorker(trace, worker));
  return slowdowns;
}

}  // namespace aloe
