#include "worker/agent_options.h"

#include <cmath>

namespace aloe::worker {

absl::Status ValidateAgentOptions(const AgentOptions& o) {
  if (!(o.slowdown >= 1.0) || !std::isfinite(o.slowdown)) {
    return absl::InvalidArgumentError("--slowdown must be a finite number >= 1");
  }
  if (o.threads < 1) return absl::InvalidArgumentError("--threads must be >= 1");
  if (o.eval_sequences < 1) return absl::InvalidArgumentError("--eval_sequences must be >= 1");
  if (o.overlap != AgentOptions::Overlap::kOff && o.evaluator) {
    return absl::InvalidArgumentError("--overlap is for trainers (not evaluators)");
  }
  return absl::OkStatus();
}

}  // namespace aloe::worker
