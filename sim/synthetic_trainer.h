// A cheap synthetic objective for simulator tests and quick straggler studies: no LibTorch,
// microseconds per step on tiny models, yet with the structure that makes asynchronous
// Local-SGD interesting (data shards pull the model in different directions, local steps drift,
// stale pseudo-gradients hurt).
//
// Every data shard s has a target t_s with the model's shapes (one flat buffer per ModelSpec
// layer): t_s = c + shard_spread * e_s, where c (common to all shards, std target_std) and e_s
// (std 1) are Gaussian vectors drawn from seeded std::mt19937_64 generators. The per-shard loss
// is the mean squared distance over the D parameters,
//   f_s(x) = 0.5 / D * ||x - t_s||^2,
// and a local step on shard s is noisy SGD on D * f_s (so the step is per coordinate):
//   x <- x - lr * ((x - t_s) + noise_std * z),  z ~ N(0, I) from the round's seed.
// The held-out loss is the size-weighted mean over shards, sum_s |D_s| / sum |D| * f_s(x); it is
// minimised by the size-weighted mean of the targets, where it equals the weighted spread of the
// targets (> 0). The pseudo-gradient is base - end (DiLoCo sign). The inner "optimizer" is
// stateless, so a worker's trainer state is just its current parameters.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/trainer_interface.h"
#include "proto/aloe.pb.h"
#include "server/core/shard_sampler.h"

namespace aloe::sim {

struct SyntheticObjectiveOptions {
  double target_std = 1.0;       // std of the common target component c
  double shard_spread = 0.5;     // std of each shard's own offset (times e_s)
  double lr = 0.05;              // per-coordinate SGD step size, in (0, 1]
  double noise_std = 0.1;        // gradient noise per coordinate, >= 0
  uint64_t tokens_per_step = 1;  // tokens a step reports as learned (shard sampler accounting)
  uint64_t seed = 1;             // seeds the targets
};

// The targets and the loss. Immutable after Create, so trainers may share one. Memory: one float
// per parameter per shard.
class SyntheticObjective {
 public:
  // kInvalidArgument for no shards, a shard with 0 tokens, duplicate shard names, a spec without
  // parameters, or options out of range (naming the option).
  static absl::StatusOr<std::unique_ptr<SyntheticObjective>> Create(
      const v1::ModelSpec& spec, const std::vector<server::DataShard>& shards,
      const SyntheticObjectiveOptions& options);

  // Index of the shard named `name`; kInvalidArgument for an unknown name.
  absl::StatusOr<size_t> FindShard(const std::string& name) const;
  // f_s(x) for shard `shard` (precondition: < num_shards(), x has the spec's layout).
  double Loss(size_t shard, const std::vector<std::vector<float>>& x) const;
  // The size-weighted mean of f_s over the shards.
  double EvalLoss(const std::vector<std::vector<float>>& x) const;

  const std::vector<std::vector<float>>& target(size_t shard) const { return targets_[shard]; }
  size_t num_shards() const { return targets_.size(); }
  const std::vector<uint64_t>& layer_sizes() const { return layer_sizes_; }
  uint64_t num_parameters() const { return num_parameters_; }
  const SyntheticObjectiveOptions& options() const { return options_; }

 private:
  SyntheticObjective() = default;

  SyntheticObjectiveOptions options_;
  std::vector<std::string> names_;
  std::vector<double> weights_;  // |D_s| / sum |D|
  std::vector<uint64_t> layer_sizes_;
  uint64_t num_parameters_ = 0;
  std::vector<std::vector<std::vector<float>>> targets_;  // [shard][layer][element]
};

// One simulated worker's (or the evaluator's) trainer on a SyntheticObjective. Deterministic:
// the noise of a round comes only from its seed. Not thread-safe.
class SyntheticTrainer final : public TrainerInterface {
 public:
  // `objective` must outlive the trainer. The parameters start at zero.
  explicit SyntheticTrainer(const SyntheticObjective& objective);

  absl::Status SetParameters(const std::vector<std::vector<float>>& layers) override;
  // Loss reported per step is f_s before the step; tokens = steps * tokens_per_step.
  absl::StatusOr<TrainStats> Train(const TrainRequest& request) override;
  absl::Status PseudoGradient(const std::vector<std::vector<float>>& base,
                              std::vector<std::vector<float>>* out) const override;
  // objective.EvalLoss(current parameters); the request is not used.
  absl::StatusOr<double> Evaluate(const EvalRequest& request) override;

  const std::vector<std::vector<float>>& parameters() const { return params_; }

 private:
  absl::Status CheckLayout(const std::vector<std::vector<float>>& layers, const char* what) const;

  const SyntheticObjective& objective_;
  std::vector<std::vector<float>> params_;
};

}  // namespace aloe::sim
