#include "worker/tensor_round_boundary.h"

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cstring>
#include <exception>
#include <optional>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/model_spec.h"
#include "common/status_macros.h"
#include "worker/torch_util.h"
#include "worker/transformer.h"

namespace aloe::worker {

absl::StatusOr<std::unique_ptr<TensorRoundBoundary>> TensorRoundBoundary::Create(
    std::vector<torch::Tensor> params, const v1::ModelSpec& spec) {
  std::unique_ptr<TensorRoundBoundary> b(new TensorRoundBoundary());
  b->spec_ = spec;
  int64_t total = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& p = params[i];
    if (p.scalar_type() != torch::kFloat32 || !p.is_contiguous() ||
        p.device() != params[0].device()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "parameter %d: the round boundary needs contiguous float32 parameters on one device", i));
    }
    total += p.numel();
  }
  if (params.empty() || static_cast<uint64_t>(total) != TotalElements(spec)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the parameters hold %d elements, the model spec %d", total, TotalElements(spec)));
  }
  try {
    torch::NoGradGuard no_grad;
    b->device_ = params[0].device();
    const auto on_device = torch::TensorOptions().dtype(torch::kFloat32).device(b->device_);
    b->staged_ = torch::empty({total}, on_device);
    b->base_ = torch::empty({total}, on_device);
    b->delta_ = torch::empty({total}, on_device);
    int64_t offset = 0;
    for (const torch::Tensor& p : params) {
      b->base_views_.push_back(b->base_.narrow(0, offset, p.numel()).view(p.sizes()));
      b->delta_views_.push_back(b->delta_.narrow(0, offset, p.numel()).view(p.sizes()));
      offset += p.numel();
    }
    if (b->device_.is_cuda()) {
      const auto pinned = torch::TensorOptions().dtype(torch::kFloat32).pinned_memory(true);
      b->host_staged_ = torch::empty({total}, pinned);
      b->host_delta_ = torch::empty({total}, pinned);
      const c10::impl::DeviceGuardImplInterface* cuda =
          c10::impl::getDeviceGuardImpl(b->device_.type());
      b->to_device_ = cuda->getStreamFromGlobalPool(b->device_);
      b->to_host_ = cuda->getStreamFromGlobalPool(b->device_);
      b->delta_ready_.emplace(b->device_.type());
      b->delta_copied_.emplace(b->device_.type());
    }
  } catch (const std::exception& e) {
    return LibTorchError("allocating the round boundary", e);
  }
  b->params_ = std::move(params);
  return b;
}

TensorRoundBoundary::~TensorRoundBoundary() {
  // A copy still in flight must not outlive the buffers it writes.
  try {
    if (to_device_.has_value()) to_device_->synchronize();
    if (to_host_.has_value()) to_host_->synchronize();
  } catch (const std::exception&) {
  }
}

absl::Status TensorRoundBoundary::StageStart(std::vector<std::vector<float>> layers) {
  ALOE_RETURN_IF_ERROR(CheckLayerSizes(layers, spec_));
  has_staged_ = false;
  try {
    // A GPU's start goes through page-locked memory: an asynchronous copy, on a stream of its
    // own, that does not wait for the training kernels.
    float* host = device_.is_cuda() ? host_staged_.data_ptr<float>() : staged_.data_ptr<float>();
    for (const std::vector<float>& layer : layers) {
      std::memcpy(host, layer.data(), layer.size() * sizeof(float));
      host += layer.size();
    }
    if (device_.is_cuda()) {
      torch::NoGradGuard no_grad;
      c10::StreamGuard on_copy_stream(*to_device_);
      staged_.copy_(host_staged_, /*non_blocking=*/true);
      to_device_->synchronize();
    }
  } catch (const std::exception& e) {
    return LibTorchError("staging the next round's start", e);
  }
  has_staged_ = true;
  return absl::OkStatus();
}

absl::Status TensorRoundBoundary::StartStaged(float delta_scale) {
  if (!has_staged_) return absl::FailedPreconditionError("no start staged for the next round");
  if (delta_scale != 0 && !has_delta_) {
    return absl::FailedPreconditionError(
        "an eager start needs the last round's pseudo-gradient, and there is none");
  }
  try {
    torch::NoGradGuard no_grad;
    // base = staged + s * delta, one pass; the parameters become copies of it.
    if (delta_scale != 0) {
      at::add_out(base_, staged_, delta_, delta_scale);
    } else {
      base_.copy_(staged_);
    }
    for (size_t i = 0; i < params_.size(); ++i) params_[i].copy_(base_views_[i]);
  } catch (const std::exception& e) {
    return LibTorchError("starting the round", e);
  }
  has_staged_ = false;
  has_base_ = true;
  return absl::OkStatus();
}

absl::Status TensorRoundBoundary::EndRound() {
  if (!has_base_) return absl::FailedPreconditionError("no round started (StartStaged)");
  try {
    torch::NoGradGuard no_grad;
    std::optional<c10::Stream> training;
    if (device_.is_cuda()) {
      // The last pseudo-gradient's copy to the host reads delta_: the difference waits for it.
      training = c10::impl::getDeviceGuardImpl(device_.type())->getStream(device_);
      delta_copied_->block(*training);
    }
    for (size_t i = 0; i < params_.size(); ++i) {
      at::sub_out(delta_views_[i], base_views_[i], params_[i]);
    }
    if (training.has_value()) {
      delta_ready_->record(*training);
      delta_ready_->block(*to_host_);
      c10::StreamGuard on_copy_stream(*to_host_);
      host_delta_.copy_(delta_, /*non_blocking=*/true);
      delta_copied_->record(*to_host_);
    }
  } catch (const std::exception& e) {
    return LibTorchError("computing the pseudo-gradient", e);
  }
  has_delta_ = true;
  return absl::OkStatus();
}

absl::Status TensorRoundBoundary::TakePseudoGradient(std::vector<std::vector<float>>* out) {
  if (!has_delta_) return absl::FailedPreconditionError("no pseudo-gradient to take");
  try {
    if (device_.is_cuda()) to_host_->synchronize();
    const float* from =
        device_.is_cuda() ? host_delta_.data_ptr<float>() : delta_.data_ptr<float>();
    out->resize(spec_.layers_size());
    for (int l = 0; l < spec_.layers_size(); ++l) {
      std::vector<float>& layer = (*out)[l];
      layer.resize(spec_.layers(l).num_elements());
      std::memcpy(layer.data(), from, layer.size() * sizeof(float));
      from += layer.size();
    }
  } catch (const std::exception& e) {
    return LibTorchError("reading the pseudo-gradient", e);
  }
  has_delta_ = false;
  return absl::OkStatus();
}

}  // namespace aloe::worker
