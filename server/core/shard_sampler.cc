#include "server/core/shard_sampler.h"

#include <algorithm>
#include <sstream>

#include "absl/strings/str_format.h"

namespace aloe::server {

DataShardSampler::DataShardSampler(std::vector<DataShard> shards, uint64_t seed, Mode mode)
    : shards_(std::move(shards)),
      mode_(mode),
      steps_(shards_.size(), 0),
      learned_(shards_.size(), 0),
      in_flight_(shards_.size(), 0),
      rng_(seed) {
  for (const DataShard& s : shards_) total_size_ += static_cast<double>(s.tokens);
}

std::vector<double> DataShardSampler::Probabilities() const {
  const size_t k = shards_.size();
  std::vector<double> p(k, 0.0);
  if (k == 0 || total_size_ <= 0) return p;
  double total_n = 0;
  for (size_t i = 0; i < k; ++i) total_n += static_cast<double>(learned_[i] + in_flight_[i]);
  double sum = 0;
  if (mode_ == Mode::kLearningProgress && total_n > 0) {
    for (size_t i = 0; i < k; ++i) {
      const double share = static_cast<double>(shards_[i].tokens) / total_size_;
      const double progress = static_cast<double>(learned_[i] + in_flight_[i]) / total_n;
      p[i] = std::max(share - progress, 0.0);
      sum += p[i];
    }
  }
  // Start, exact balance (every p_i = 0, up to rounding) or proportional mode: ∝ |D_i|.
  if (sum <= 1e-12) {
    for (size_t i = 0; i < k; ++i) p[i] = static_cast<double>(shards_[i].tokens);
    sum = total_size_;
  }
  for (double& x : p) x /= sum;
  return p;
}

size_t DataShardSampler::Next() {
  const std::vector<double> p = Probabilities();
  // Inverse CDF with a 53-bit uniform: deterministic across standard libraries.
  const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53;
  double cumulative = 0;
  size_t last_positive = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] <= 0) continue;
    last_positive = i;
    cumulative += p[i];
    if (u < cumulative) return i;
  }
  return last_positive;  // u landed in the rounding gap at the top
}

void DataShardSampler::Assign(size_t i, uint64_t tokens) { in_flight_[i] += tokens; }

void DataShardSampler::Release(size_t i, uint64_t tokens) {
  in_flight_[i] -= std::min(in_flight_[i], tokens);
}

void DataShardSampler::RecordLearned(size_t i, uint64_t assigned, uint64_t steps, uint64_t tokens) {
  Release(i, assigned);
  steps_[i] += steps;
  learned_[i] += tokens;
}

std::string DataShardSampler::RngState() const {
  std::ostringstream out;
  out << rng_;
  return out.str();
}

absl::Status DataShardSampler::Restore(const std::vector<uint64_t>& steps,
                                       const std::vector<uint64_t>& tokens,
                                       const std::string& rng_state) {
  if (steps.size() != shards_.size() || tokens.size() != shards_.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("checkpoint has progress for %d/%d data shards, the corpus has %d",
                        steps.size(), tokens.size(), shards_.size()));
  }
  std::mt19937_64 rng;
  std::istringstream in(rng_state);
  in >> rng;
  if (in.fail()) return absl::InvalidArgumentError("checkpoint: bad data-shard sampler state");
  steps_ = steps;
  learned_ = tokens;
  std::fill(in_flight_.begin(), in_flight_.end(), 0);
  rng_ = rng;
  return absl::OkStatus();
}

}  // namespace aloe::server
