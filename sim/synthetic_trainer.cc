#include "sim/synthetic_trainer.h"

#include <cmath>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace aloe::sim {
namespace {

// splitmix64 over (a, b): independent generator seeds for the common part and each shard.
uint64_t MixSeed(uint64_t a, uint64_t b) {
  uint64_t z = a * 0x9E3779B97F4A7C15ull + b + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

bool FiniteAtLeast(double v, double lo) { return std::isfinite(v) && v >= lo; }

}  // namespace

absl::StatusOr<std::unique_ptr<SyntheticObjective>> SyntheticObjective::Create(
    const v1::ModelSpec& spec, const std::vector<server::DataShard>& shards,
    const SyntheticObjectiveOptions& options) {
  if (shards.empty()) return absl::InvalidArgumentError("the synthetic objective needs shards");
  if (!FiniteAtLeast(options.target_std, 0)) {
    return absl::InvalidArgumentError("synthetic target_std must be finite and >= 0");
  }
  if (!FiniteAtLeast(options.shard_spread, 0)) {
    return absl::InvalidArgumentError("synthetic shard_spread must be finite and >= 0");
  }
  if (!(options.lr > 0 && options.lr <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("synthetic lr must be in (0, 1], got %g", options.lr));
  }
  if (!FiniteAtLeast(options.noise_std, 0)) {
    return absl::InvalidArgumentError("synthetic noise_std must be finite and >= 0");
  }
  std::unique_ptr<SyntheticObjective> o(new SyntheticObjective());
  o->options_ = options;
  for (const auto& layer : spec.layers()) {
    o->layer_sizes_.push_back(layer.num_elements());
    o->num_parameters_ += layer.num_elements();
  }
  if (o->num_parameters_ == 0) {
    return absl::InvalidArgumentError("the model spec has no parameters");
  }
  double total = 0;
  std::set<std::string> seen;
  for (const server::DataShard& s : shards) {
    if (s.tokens == 0) {
      return absl::InvalidArgumentError(absl::StrCat("shard '", s.name, "' has no tokens"));
    }
    if (!seen.insert(s.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate shard name '", s.name, "'"));
    }
    total += static_cast<double>(s.tokens);
  }
  // The common component c, then t_s = c + spread * e_s.
  std::vector<std::vector<float>> common;
  {
    std::mt19937_64 rng(MixSeed(options.seed, 0));
    std::normal_distribution<double> normal(0.0, 1.0);
    for (uint64_t n : o->layer_sizes_) {
      std::vector<float> layer(n);
      for (float& v : layer) v = static_cast<float>(options.target_std * normal(rng));
      common.push_back(std::move(layer));
    }
  }
  for (size_t s = 0; s < shards.size(); ++s) {
    o->names_.push_back(shards[s].name);
    o->weights_.push_back(static_cast<double>(shards[s].tokens) / total);
    std::mt19937_64 rng(MixSeed(options.seed, s + 1));
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<std::vector<float>> target = common;
    for (auto& layer : target) {
      for (float& v : layer) v += static_cast<float>(options.shard_spread * normal(rng));
    }
    o->targets_.push_back(std::move(target));
  }
  return o;
}

absl::StatusOr<size_t> SyntheticObjective::FindShard(const std::string& name) const {
  for (size_t i = 0; i < names_.size(); ++i) {
    if (names_[i] == name) return i;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown data shard '", name, "'"));
}

double SyntheticObjective::Loss(size_t shard, const std::vector<std::vector<float>>& x) const {
  double sum = 0;
  const auto& target = targets_[shard];
  for (size_t l = 0; l < target.size(); ++l) {
    for (size_t i = 0; i < target[l].size(); ++i) {
      const double d = static_cast<double>(x[l][i]) - target[l][i];
      sum += d * d;
    }
  }
  return 0.5 * sum / static_cast<double>(num_parameters_);
}

double SyntheticObjective::EvalLoss(const std::vector<std::vector<float>>& x) const {
  double loss = 0;
  for (size_t s = 0; s < targets_.size(); ++s) loss += weights_[s] * Loss(s, x);
  return loss;
}

SyntheticTrainer::SyntheticTrainer(const SyntheticObjective& objective) : objective_(objective) {
  for (uint64_t n : objective.layer_sizes()) params_.emplace_back(n, 0.0f);
}

absl::Status SyntheticTrainer::CheckLayout(const std::vector<std::vector<float>>& layers,
                                           const char* what) const {
  const auto& sizes = objective_.layer_sizes();
  if (layers.size() != sizes.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s has %d layers, the model has %d", what, layers.size(), sizes.size()));
  }
  for (size_t l = 0; l < sizes.size(); ++l) {
    if (layers[l].size() != sizes[l]) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s layer %d has %d elements, the model has %d", what, l, layers[l].size(), sizes[l]));
    }
  }
  return absl::OkStatus();
}

absl::Status SyntheticTrainer::SetParameters(const std::vector<std::vector<float>>& layers) {
  absl::Status status = CheckLayout(layers, "the parameters");
  if (!status.ok()) return status;
  params_ = layers;
  return absl::OkStatus();
}

absl::StatusOr<TrainStats> SyntheticTrainer::Train(const TrainRequest& request) {
  absl::StatusOr<size_t> shard = objective_.FindShard(request.shard_name);
  if (!shard.ok()) return shard.status();
  const auto& target = objective_.target(*shard);
  const SyntheticObjectiveOptions& o = objective_.options();
  const float lr = static_cast<float>(o.lr);
  const float noise = static_cast<float>(o.noise_std);
  std::mt19937_64 rng(request.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  double loss_sum = 0;
  for (uint32_t step = 0; step < request.steps; ++step) {
    double sq = 0;
    for (size_t l = 0; l < params_.size(); ++l) {
      float* x = params_[l].data();
      const float* t = target[l].data();
      for (size_t i = 0; i < params_[l].size(); ++i) {
        const float d = x[i] - t[i];
        sq += static_cast<double>(d) * d;
        const float z = noise > 0 ? normal(rng) : 0.0f;
        x[i] -= lr * (d + noise * z);
      }
    }
    loss_sum += 0.5 * sq / static_cast<double>(objective_.num_parameters());
  }
  TrainStats stats;
  stats.steps = request.steps;
  stats.tokens = static_cast<uint64_t>(request.steps) * o.tokens_per_step;
  stats.mean_loss = request.steps > 0 ? loss_sum / request.steps : 0;
  return stats;
}

absl::Status SyntheticTrainer::PseudoGradient(const std::vector<std::vector<float>>& base,
                                              std::vector<std::vector<float>>* out) const {
  absl::Status status = CheckLayout(base, "the base");
  if (!status.ok()) return status;
  out->resize(base.size());
  for (size_t l = 0; l < base.size(); ++l) {
    (*out)[l].resize(base[l].size());
    for (size_t i = 0; i < base[l].size(); ++i) (*out)[l][i] = base[l][i] - params_[l][i];
  }
  return absl::OkStatus();
}

absl::StatusOr<double> SyntheticTrainer::Evaluate(const EvalRequest& request) {
  return objective_.EvalLoss(params_);
}

}  // namespace aloe::sim
