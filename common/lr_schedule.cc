#include "common/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_format.h"

namespace aloe {
namespace {

constexpr double kPi = 3.14159265358979323846;

absl::Status Check(bool ok, const char* field, const char* requirement, double value) {
  if (ok && std::isfinite(value)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrFormat("inner_optimizer.%s must be %s, got %g", field, requirement, value));
}

}  // namespace

double InnerLearningRate(const v1::InnerOptimizerConfig& c, uint64_t t) {
  const double eta_max = c.lr();
  const double eta_min = c.min_lr();
  const uint64_t warmup = c.warmup_steps();
  if (t < warmup) return static_cast<double>(t) * eta_max / static_cast<double>(warmup);
  const double span =
      c.total_steps() > warmup ? static_cast<double>(c.total_steps() - warmup) : 1.0;
  const double r = std::clamp(static_cast<double>(t - warmup) / span, 0.0, 1.0);
  return eta_min + 0.5 * (eta_max - eta_min) * (1.0 + std::cos(kPi * r));
}

void FillInnerOptimizerDefaults(v1::InnerOptimizerConfig* c) {
  if (c->lr() == 0) c->set_lr(3e-3f);
  if (c->min_lr() == 0) c->set_min_lr(c->lr() / 10);
  if (c->warmup_steps() == 0) c->set_warmup_steps(50);
  if (c->total_steps() == 0) c->set_total_steps(10000);
  if (c->weight_decay() == 0) c->set_weight_decay(0.1f);
  if (c->beta1() == 0) c->set_beta1(0.9f);
  if (c->beta2() == 0) c->set_beta2(0.95f);
  if (c->eps() == 0) c->set_eps(1e-8f);
  if (c->grad_clip() == 0) c->set_grad_clip(1.0f);
  if (c->batch_size() == 0) c->set_batch_size(8);
}

absl::Status ValidateInnerOptimizerConfig(const v1::InnerOptimizerConfig& c) {
  for (absl::Status s : {
           Check(c.lr() > 0, "lr", "> 0", c.lr()),
           Check(c.min_lr() > 0 && c.min_lr() <= c.lr(), "min_lr",
                 absl::StrFormat("in (0, inner_optimizer.lr = %g]", c.lr()).c_str(), c.min_lr()),
           Check(c.total_steps() > 0, "total_steps", "> 0", c.total_steps()),
           Check(c.weight_decay() >= 0, "weight_decay", ">= 0", c.weight_decay()),
           Check(c.beta1() >= 0 && c.beta1() < 1, "beta1", "in [0, 1)", c.beta1()),
           Check(c.beta2() >= 0 && c.beta2() < 1, "beta2", "in [0, 1)", c.beta2()),
           Check(c.eps() > 0, "eps", "> 0", c.eps()),
           Check(c.grad_clip() >= 0, "grad_clip", ">= 0 (0 = off)", c.grad_clip()),
           Check(c.batch_size() > 0, "batch_size", "> 0", c.batch_size()),
       }) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace aloe
