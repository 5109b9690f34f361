// The inner (AdamW) learning-rate schedule and the inner optimizer's configuration defaults.
// Each data shard has its own step counter t (steps learned on that shard); the server hands a
// worker the data shard's t at task start (Task.lr_step) and the worker advances it per local step
// (docs/algorithms.md, "Data shards and the LR schedule"). Pure functions: no clock, no state.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "proto/aloe.pb.h"

namespace aloe {

// Linear warmup then cosine decay, paper 002 Eq. 3:
//   eta_t = t * eta_max / t_warmup                               if t < t_warmup
//   eta_t = eta_min + 0.5 * (eta_max - eta_min) * (1 + cos(pi * r))  otherwise,
//   r = clamp((t - t_warmup) / max(T - t_warmup, 1), 0, 1),
// with eta_max = c.lr, eta_min = c.min_lr, t_warmup = c.warmup_steps, T = c.total_steps.
// Past T the rate stays at eta_min. With warmup_steps 0 the schedule starts at eta_max.
double InnerLearningRate(const v1::InnerOptimizerConfig& c, uint64_t t);

// Sets every zero field of `c` to its default: lr 3e-3, min_lr lr/10 (of the filled lr),
// warmup_steps 50, total_steps 10000, weight_decay 0.1, beta1 0.9, beta2 0.95, eps 1e-8,
// grad_clip 1.0, batch_size 8. (A zero weight_decay or grad_clip thus means "default"; use a
// tiny positive value to get effectively none.)
void FillInnerOptimizerDefaults(v1::InnerOptimizerConfig* c);

// Returns kInvalidArgument naming the field ("inner_optimizer.lr", ...) unless: lr finite > 0;
// 0 < min_lr <= lr; total_steps > 0; weight_decay >= 0; beta1, beta2 in [0, 1); eps > 0;
// grad_clip >= 0 (0 = no clipping); batch_size > 0. All finite.
absl::Status ValidateInnerOptimizerConfig(const v1::InnerOptimizerConfig& c);

}  // namespace aloe
