#include "worker/agent_options.h"

#include <cmath>

namespace aloe::worker {

absl::Status ValidateAgentOptions(const AgentOptions& o) {
  if (!(o.slowdown >= 1.0) || !std::isfinite(o.slowdown)) {
    return absl::InvalidArgumentError("--slowdown must be a finite number >= 1");
  }
  if (o.threads < 1) return absl::InvalidArgumentError("--threads must be >= 1");
  if (o.eval_sequences < 1) return absl::InvalidArgumentError("--eval_sequences must be >= 1");
  if (o.state_every_rounds < 1) {
    return absl::InvalidArgumentError("--state_every_rounds must be >= 1");
  }
  if (!o.state_dir.empty() && o.evaluator) {
    return absl::InvalidArgumentError(
        "--state_dir is for trainers (an evaluator has no optimizer)");
  }
  if (o.overlap != AgentOptions::Overlap::kOff && o.evaluator) {
    return absl::InvalidArgumentError("--overlap is for trainers (not evaluators)");
  }
  return absl::OkStatus();
}

}  // namespace aloe::worker
