// The inner step's optimizer arithmetic over all of a model's parameters at once: AdamW and
// the global gradient-norm clip as multi-tensor operations (one kernel launch per operation for
// the whole model on a GPU, instead of one per parameter tensor), with no host synchronisation.
//
// The arithmetic is LibTorch's torch::optim::AdamW and torch::nn::utils::clip_grad_norm_ (the
// inner optimizer of docs/algorithms.md). On the CPU the kForEach kernels compute exactly what
// those do, bit for bit (each multi-tensor operation runs the same per-tensor kernel there). On
// a CUDA device kFused runs LibTorch's fused AdamW kernel once for the decayed tensors and once
// for the rest, with the learning rate and the step counts read from device tensors and the clip
// folded into the kernel as its gradient scale (LibTorch < 2.3: the fused Adam kernel per step
// count, after one multi-tensor product for the decay): the same formulas, in a different float
// rounding order.
//
// Includes <torch/torch.h>: only for translation units that use LibTorch anyway.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "proto/aloe.pb.h"

namespace aloe::worker {

enum class AdamWKernel {
  kForEach,  // multi-tensor operations (_foreach_*), on every device
  kFused,    // LibTorch's fused AdamW kernel: CUDA tensors only
};

// The kernel for parameters on `device`: kFused on CUDA, kForEach elsewhere.
AdamWKernel DefaultAdamWKernel(const torch::Device& device);

// The factor clip_grad_norm_(params, max_norm) scales every gradient by, as a 0-dim float32
// tensor on the gradients' device, computed without reading it back to the host:
//   min(1, max_norm / (||g||_2 + 1e-6)), ||g||_2 the L2 norm of all defined gradients together
// (the norm of the per-tensor norms, one multi-tensor pass). Undefined when no parameter has
// a gradient. Does not change the gradients.
torch::Tensor GradClipFactor(const std::vector<torch::Tensor>& params, double max_norm);

// LibTorch's own AdamW over `params` with InnerAdamW's groups: matrices (dim >= 2) decay, the
// rest do not. The reference InnerAdamW is checked and measured against.
std::unique_ptr<torch::optim::AdamW> LibTorchAdamW(const std::vector<torch::Tensor>& params,
                                                   const v1::InnerOptimizerConfig& inner);

// Not thread-safe. Holds the first and second moments of every parameter and the number of
// steps each has taken (a parameter without a gradient in a step does not step, as in
// torch::optim::AdamW).
class InnerAdamW {
 public:
  // `params`: the parameters, all on one device; `decay[i]`: whether params[i] gets the
  // decoupled weight decay. betas, eps and weight_decay come from `inner`. kFused on a non-CUDA
  // device throws std::invalid_argument.
  InnerAdamW(std::vector<torch::Tensor> params, std::vector<bool> decay,
             const v1::InnerOptimizerConfig& inner, AdamWKernel kernel);

  // Clears the gradients before a backward pass. On the CPU every defined gradient is zeroed in
  // place (torch::optim::Optimizer::zero_grad of LibTorch 1.13: a parameter left out of a
  // step's loss then steps on a zero gradient). On a GPU they are dropped (LibTorch 2.x's
  // zero_grad): the backward pass writes fresh ones without first reading zeros, and a
  // parameter left out of the loss takes no step.
  void ZeroGrad();

  // One AdamW step with learning rate `lr` on every parameter that has a gradient:
  //   p *= 1 - lr * wd (decayed parameters); g *= clip; m = b1 m + (1 - b1) g;
  //   v = b2 v + (1 - b2) g^2; p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
  // with t the parameter's step count after this step. `clip` is GradClipFactor's tensor, or
  // undefined for none; the gradients themselves may be left scaled by it.
  // With a device learning rate (capturable()) this is SetLearningRate(lr), LaunchStep(clip),
  // CountStep().
  void Step(double lr, const torch::Tensor& clip);

  // Whether the step can be captured in a CUDA graph (worker/step_graph.h): the fused kernel of a
  // LibTorch that takes its learning rate as a device tensor, so that nothing the step launches
  // depends on a host value that changes from step to step (the step counts live on the device
  // too). On such an optimizer a step may be split in three:
  bool capturable() const { return device_lr_.defined(); }
  // Writes lr into the device tensor the next launched (or replayed) step reads.
  void SetLearningRate(double lr);
  // Launches one step of every parameter that has a gradient now, with the learning rate of the
  // device tensor; counts nothing on the host. The parameters it stepped are remembered.
  void LaunchStep(const torch::Tensor& clip);
  // Counts one step on the host for each parameter the last LaunchStep stepped: after Step's
  // launch, or after each replay of a graph that captured LaunchStep.
  void CountStep();

  AdamWKernel kernel() const { return kernel_; }
  size_t size() const { return params_.size(); }
  // Steps parameter i has taken (0: none; its moments are then zeros).
  int64_t steps(size_t i) const { return steps_[i]; }
  const torch::Tensor& exp_avg(size_t i) const { return m_[i]; }
  const torch::Tensor& exp_avg_sq(size_t i) const { return v_[i]; }

  // Sets every parameter's step count to `steps` and its moments to copies of first[i] and
  // second[i] (each of params[i]'s shape; throws std::invalid_argument otherwise).
  void Restore(int64_t steps, const std::vector<torch::Tensor>& first,
               const std::vector<torch::Tensor>& second);

 private:
  struct Lists;  // one group's parameters, gradients and moments
  Lists Gather(const std::vector<size_t>& group) const;
  void StepForEach(const std::vector<size_t>& group, bool decayed, double lr,
                   const torch::Tensor& clip);
  void StepFused(const std::vector<size_t>& group, bool decayed, double lr,
                 const torch::Tensor& clip);

  std::vector<torch::Tensor> params_;
  std::vector<bool> decay_;
  double beta1_, beta2_, eps_, weight_decay_;
  AdamWKernel kernel_;
  std::vector<torch::Tensor> m_, v_;
  std::vector<int64_t> steps_;
  std::vector<torch::Tensor> step_tensors_;  // kFused: float32 step counts on the device
  torch::Tensor device_lr_;       // capturable(): the learning rate, float32 on the device
  std::vector<size_t> launched_;  // capturable(): what the last LaunchStep stepped
};

}  // namespace aloe::worker
