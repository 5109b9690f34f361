#include "worker/round_boundary.h"

#include <utility>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "kernels/cpu/outer_kernels.h"

namespace aloe::worker {

absl::Status HostRoundBoundary::StageStart(std::vector<std::vector<float>> layers) {
  staged_ = std::move(layers);
  has_staged_ = true;
  return absl::OkStatus();
}

absl::Status HostRoundBoundary::StartStaged(float delta_scale) {
  if (!has_staged_) return absl::FailedPreconditionError("no start staged for the next round");
  if (delta_scale != 0) {
    if (!has_delta_) {
      return absl::FailedPreconditionError(
          "an eager start needs the last round's pseudo-gradient, and there is none");
    }
    if (delta_.size() != staged_.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the staged start has %d layers, the pseudo-gradient %d", staged_.size(), delta_.size()));
    }
    for (size_t l = 0; l < staged_.size(); ++l) {
      if (delta_[l].size() != staged_[l].size()) {
        return absl::InvalidArgumentError(
            absl::StrFormat("layer %d: the staged start has %d elements, the pseudo-gradient %d", l,
                            staged_[l].size(), delta_[l].size()));
      }
    }
  }
  has_staged_ = false;
  std::vector<std::vector<float>> start = std::move(staged_);
  staged_.clear();
  if (delta_scale != 0) {
    for (size_t l = 0; l < start.size(); ++l) {
      kernels::WeightedAccumulate(delta_[l].data(), delta_scale, start[l].data(), start[l].size());
    }
  }
  ALOE_RETURN_IF_ERROR(trainer_->SetParameters(start));
  base_ = std::move(start);
  has_base_ = true;
  return absl::OkStatus();
}

absl::Status HostRoundBoundary::EndRound() {
  if (!has_base_) return absl::FailedPreconditionError("no round started (StartStaged)");
  ALOE_RETURN_IF_ERROR(trainer_->PseudoGradient(base_, &delta_));
  has_delta_ = true;
  return absl::OkStatus();
}

absl::Status HostRoundBoundary::TakePseudoGradient(std::vector<std::vector<float>>* out) {
  if (!has_delta_) return absl::FailedPreconditionError("no pseudo-gradient to take");
  *out = std::move(delta_);
  delta_.clear();
  has_delta_ = false;
  return absl::OkStatus();
}

}  // namespace aloe::worker
