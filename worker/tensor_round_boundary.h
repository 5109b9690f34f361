// TensorRoundBoundary: the round boundary (common/trainer_interface.h RoundBoundary) kept on the
// device of a trainer's parameters. The round's base, the pseudo-gradient and the staged start
// live there as flat float32 buffers (three model copies); the eager start and the
// pseudo-gradient are a few element-wise kernels over them. On a GPU:
//   - StageStart copies the start into page-locked memory and then to the device on a stream of
//     its own, on the caller's thread, beside the training kernels;
//   - EndRound queues the difference on the training stream and its copy to page-locked memory
//     on another stream: the next round's kernels queue behind the difference, not the copy;
//   - TakePseudoGradient waits for that copy only.
// So the training stream stops between rounds for the difference and the start (about four
// passes over the parameters in device memory), not for the transfers to and from the host.
// On a CPU the same steps run in order on the calling thread.
//
// Includes LibTorch: for the trainers' translation units.
#pragma once

#include <torch/torch.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/trainer_interface.h"
#include "proto/aloe.pb.h"

namespace aloe::worker {

class TensorRoundBoundary final : public RoundBoundary {
 public:
  // `params`: the trainer's parameters in spec order, float32, contiguous, all on one device
  // (they must outlive this object and keep their storage). Allocates the device buffers and,
  // on a GPU, the page-locked ones and two streams. kInvalidArgument when `params` do not hold
  // exactly the spec's elements or are not float32 on one device; kInternal on a LibTorch
  // error.
  static absl::StatusOr<std::unique_ptr<TensorRoundBoundary>> Create(
      std::vector<torch::Tensor> params, const v1::ModelSpec& spec);
  ~TensorRoundBoundary() override;

  // kInvalidArgument (CheckLayerSizes) when `layers` do not fit the spec.
  absl::Status StageStart(std::vector<std::vector<float>> layers) override;
  absl::Status StartStaged(float delta_scale) override;
  absl::Status EndRound() override;
  absl::Status TakePseudoGradient(std::vector<std::vector<float>>* out) override;

 private:
  TensorRoundBoundary() = default;

  v1::ModelSpec spec_;
  torch::Device device_{torch::kCPU};
  std::vector<torch::Tensor> params_;
  // Flat buffers in spec order (= the layers concatenated) and views of them shaped as params_.
  torch::Tensor staged_, base_, delta_;
  std::vector<torch::Tensor> base_views_, delta_views_;
  // A GPU's: the page-locked ends of the two transfers, the streams they run on, and the
  // pseudo-gradient's copy (the next EndRound's difference waits for it).
  torch::Tensor host_staged_, host_delta_;
  std::optional<c10::Stream> to_device_, to_host_;
  std::optional<c10::Event> delta_ready_, delta_copied_;
  // Set and cleared on the two threads that the round loop orders.
  std::atomic<bool> has_staged_{false};
  std::atomic<bool> has_delta_{false};
  bool has_base_ = false;
};

}  // namespace aloe::worker
