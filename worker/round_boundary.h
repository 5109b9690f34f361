// HostRoundBoundary: the round boundary (common/trainer_interface.h RoundBoundary) of a trainer
// that has none on its device, through its host calls: the start goes in with SetParameters and
// the pseudo-gradient comes out with PseudoGradient, both on the trainer's thread. An eager
// start (delta_scale != 0) is summed on the host. What overlapped rounds did before trainers
// kept the boundary on their device, and still do on a CPU or a multi-rank node.
#pragma once

#include <atomic>
#include <vector>

#include "absl/status/status.h"
#include "common/trainer_interface.h"

namespace aloe::worker {

class HostRoundBoundary final : public RoundBoundary {
 public:
  // `trainer` must outlive this object.
  explicit HostRoundBoundary(TrainerInterface* trainer) : trainer_(trainer) {}

  // Keeps `layers`; their sizes are checked by StartStaged (the trainer's SetParameters).
  absl::Status StageStart(std::vector<std::vector<float>> layers) override;
  // Consumes the staged start also when SetParameters refuses it (kInvalidArgument).
  absl::Status StartStaged(float delta_scale) override;
  absl::Status EndRound() override;
  absl::Status TakePseudoGradient(std::vector<std::vector<float>>* out) override;

 private:
  TrainerInterface* const trainer_;
  std::vector<std::vector<float>> staged_;
  std::vector<std::vector<float>> base_;   // the started round's start
  std::vector<std::vector<float>> delta_;  // the last EndRound's, until taken
  // Set and cleared on the two threads that the round loop orders.
  std::atomic<bool> has_staged_{false};
  std::atomic<bool> has_delta_{false};
  bool has_base_ = false;
};

}  // namespace aloe::worker
