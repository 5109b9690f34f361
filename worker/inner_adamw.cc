#include "worker/inner_adamw.h"

#include <torch/version.h>

#include <cmath>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>

namespace aloe::worker {
namespace {

// LibTorch 2.1 added the multi-tensor product with a tensor scalar.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
#define ALOE_FOREACH_MUL_TENSOR 1
#endif
// LibTorch 2.3 has the fused AdamW kernel that reads its learning rate from a device tensor.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define ALOE_FUSED_ADAMW_TENSOR_LR 1
#endif

std::vector<torch::Tensor> Pick(const std::vector<torch::Tensor>& all,
                                const std::vector<size_t>& group) {
  std::vector<torch::Tensor> out;
  out.reserve(group.size());
  for (size_t i : group) out.push_back(all[i]);
  return out;
}

}  // namespace

AdamWKernel DefaultAdamWKernel(const torch::Device& device) {
  return device.is_cuda() ? AdamWKernel::kFused : AdamWKernel::kForEach;
}

torch::Tensor GradClipFactor(const std::vector<torch::Tensor>& params, double max_norm) {
  std::vector<torch::Tensor> grads;
  grads.reserve(params.size());
  for (const torch::Tensor& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return torch::Tensor();
  torch::NoGradGuard no_grad;
  const std::vector<torch::Tensor> norms = at::_foreach_norm(grads, 2);
  const torch::Tensor total = norms.size() == 1 ? norms[0] : torch::stack(norms).norm(2);
  return torch::clamp_max(max_norm / (total + 1e-6), 1.0);
}

std::unique_ptr<torch::optim::AdamW> LibTorchAdamW(const std::vector<torch::Tensor>& params,
                                                   const v1::InnerOptimizerConfig& inner) {
  std::vector<torch::Tensor> decay, no_decay;
  for (const torch::Tensor& p : params) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  const auto options = torch::optim::AdamWOptions(inner.lr())
                           .betas(std::make_tuple(inner.beta1(), inner.beta2()))
                           .eps(inner.eps())
                           .weight_decay(inner.weight_decay());
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(options));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(options).weight_decay(0)));
  return std::make_unique<torch::optim::AdamW>(std::move(groups), options);
}

struct InnerAdamW::Lists {
  std::vector<torch::Tensor> p, g, m, v;
};

InnerAdamW::Lists InnerAdamW::Gather(const std::vector<size_t>& group) const {
  Lists lists{Pick(params_, group), {}, Pick(m_, group), Pick(v_, group)};
  lists.g.reserve(group.size());
  for (size_t i : group) lists.g.push_back(params_[i].grad());
  return lists;
}

InnerAdamW::InnerAdamW(std::vector<torch::Tensor> params, std::vector<bool> decay,
                       const v1::InnerOptimizerConfig& inner, AdamWKernel kernel)
    : params_(std::move(params)),
      decay_(std::move(decay)),
      beta1_(inner.beta1()),
      beta2_(inner.beta2()),
      eps_(inner.eps()),
      weight_decay_(inner.weight_decay()),
      kernel_(kernel) {
  if (decay_.size() != params_.size()) {
    throw std::invalid_argument("InnerAdamW: one decay flag per parameter");
  }
  steps_.assign(params_.size(), 0);
  for (const torch::Tensor& p : params_) {
    if (kernel_ == AdamWKernel::kFused && !p.is_cuda()) {
      throw std::invalid_argument("InnerAdamW: the fused kernel needs CUDA parameters");
    }
    m_.push_back(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    v_.push_back(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    if (kernel_ == AdamWKernel::kFused) {
      step_tensors_.push_back(torch::zeros({}, p.options().dtype(torch::kFloat32)));
    }
  }
#if defined(ALOE_FUSED_ADAMW_TENSOR_LR)
  if (kernel_ == AdamWKernel::kFused && !params_.empty()) {
    device_lr_ = torch::zeros({}, params_.front().options().dtype(torch::kFloat32));
  }
#endif
}

void InnerAdamW::ZeroGrad() {
  if (!params_.empty() && params_.front().is_cuda()) {
    for (torch::Tensor& p : params_) p.mutable_grad() = torch::Tensor();
    return;
  }
  std::vector<torch::Tensor> grads;
  grads.reserve(params_.size());
  for (torch::Tensor& p : params_) {
    if (p.mutable_grad().defined()) {
      p.mutable_grad().detach_();
      grads.push_back(p.mutable_grad());
    }
  }
  if (!grads.empty()) at::_foreach_zero_(grads);
}

void InnerAdamW::Step(double lr, const torch::Tensor& clip) {
  if (capturable()) {
    SetLearningRate(lr);
    LaunchStep(clip);
    CountStep();
    return;
  }
  torch::NoGradGuard no_grad;
  // Parameters of one decay choice and one step count share their scalars: one group each.
  std::map<std::pair<bool, int64_t>, std::vector<size_t>> groups;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].grad().defined()) continue;
    groups[{decay_[i], ++steps_[i]}].push_back(i);
  }
  if (groups.empty()) return;
  // The fused kernel divides each gradient by its scale: the clip's reciprocal.
  const torch::Tensor scale =
      kernel_ == AdamWKernel::kFused && clip.defined() ? clip.reciprocal() : torch::Tensor();
  for (const auto& [key, group] : groups) {
    if (kernel_ == AdamWKernel::kFused) {
      StepFused(group, key.first, lr, scale);
    } else {
      StepForEach(group, key.first, lr, clip);
    }
  }
}

void InnerAdamW::StepForEach(const std::vector<size_t>& group, bool decayed, double lr,
                             const torch::Tensor& clip) {
  auto [p, g, m, v] = Gather(group);
  if (clip.defined()) {
#if defined(ALOE_FOREACH_MUL_TENSOR)
    at::_foreach_mul_(g, clip);
#else
    for (torch::Tensor& grad : g) grad.mul_(clip);
#endif
  }
  const double t = static_cast<double>(steps_[group.front()]);
  const double bias_correction1 = 1 - std::pow(beta1_, t);
  const double bias_correction2 = 1 - std::pow(beta2_, t);
  if (decayed && weight_decay_ != 0) at::_foreach_mul_(p, 1 - lr * weight_decay_);
  at::_foreach_mul_(m, beta1_);
  at::_foreach_add_(m, g, 1 - beta1_);
  at::_foreach_mul_(v, beta2_);
  at::_foreach_addcmul_(v, g, g, 1 - beta2_);
  std::vector<torch::Tensor> denom = at::_foreach_sqrt(v);
  at::_foreach_div_(denom, std::sqrt(bias_correction2));
  at::_foreach_add_(denom, eps_);
  at::_foreach_addcdiv_(p, m, denom, -lr / bias_correction1);
}

void InnerAdamW::StepFused(const std::vector<size_t>& group, bool decayed, double lr,
                           const torch::Tensor& scale) {
  auto [p, g, m, v] = Gather(group);
  std::vector<torch::Tensor> t = Pick(step_tensors_, group);
  if (decayed && weight_decay_ != 0) at::_foreach_mul_(p, 1 - lr * weight_decay_);
  at::_foreach_add_(t, 1.0);
  // Adam without its L2 term (weight_decay 0): the decay above is AdamW's decoupled one.
  c10::optional<torch::Tensor> grad_scale;
  if (scale.defined()) grad_scale = scale;
  at::_fused_adam_(p, g, m, v, /*max_exp_avg_sqs=*/{}, t, lr, beta1_, beta2_,
                   /*weight_decay=*/0.0, eps_, /*amsgrad=*/false, /*maximize=*/false, grad_scale,
                   /*found_inf=*/c10::optional<torch::Tensor>());
}

void InnerAdamW::SetLearningRate(double lr) {
  if (!capturable()) throw std::logic_error("InnerAdamW: no device learning rate");
  device_lr_.fill_(lr);
}

void InnerAdamW::LaunchStep(const torch::Tensor& clip) {
  if (!capturable()) throw std::logic_error("InnerAdamW: no device learning rate");
  torch::NoGradGuard no_grad;
  launched_.clear();
  std::vector<size_t> plain, decayed;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].grad().defined()) continue;
    launched_.push_back(i);
    (decay_[i] ? decayed : plain).push_back(i);
  }
  // The fused kernel divides each gradient by its scale: the clip's reciprocal.
  c10::optional<torch::Tensor> grad_scale;
  if (clip.defined()) grad_scale = clip.reciprocal();
  for (const bool decay : {false, true}) {
    const std::vector<size_t>& group = decay ? decayed : plain;
    if (group.empty()) continue;
    auto [p, g, m, v] = Gather(group);
    std::vector<torch::Tensor> t = Pick(step_tensors_, group);
    at::_foreach_add_(t, 1.0);
#if defined(ALOE_FUSED_ADAMW_TENSOR_LR)
    // AdamW's decoupled decay inside the kernel: p -= lr * weight_decay * p before the update.
    at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, t, device_lr_, beta1_, beta2_,
                      decay ? weight_decay_ : 0.0, eps_, /*amsgrad=*/false, /*maximize=*/false,
                      grad_scale, /*found_inf=*/c10::optional<torch::Tensor>());
#endif
  }
}

void InnerAdamW::CountStep() {
  for (size_t i : launched_) ++steps_[i];
}

void InnerAdamW::Restore(int64_t steps, const std::vector<torch::Tensor>& first,
                         const std::vector<torch::Tensor>& second) {
  if (first.size() != params_.size() || second.size() != params_.size()) {
    throw std::invalid_argument("InnerAdamW::Restore: one moment tensor per parameter");
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (first[i].sizes() != params_[i].sizes() || second[i].sizes() != params_[i].sizes()) {
      throw std::invalid_argument("InnerAdamW::Restore: moment " + std::to_string(i) +
                                  " has another shape than its parameter");
    }
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    m_[i].copy_(first[i]);
    v_[i].copy_(second[i]);
    steps_[i] = steps;
    if (kernel_ == AdamWKernel::kFused) step_tensors_[i].fill_(static_cast<double>(steps));
  }
}

}  // namespace aloe::worker
