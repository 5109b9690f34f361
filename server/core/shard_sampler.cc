#include "server/core/shard_sampler.h"

namespace aloe::server {

ShardSampler::ShardSampler(std::vector<DataShard> shards, uint64_t seed)
    : shards_(std::move(shards)),
      steps_(shards_.size(), 0),
      tokens_(shards_.size(), 0),
      rng_(seed) {
  std::vector<double> weights;
  for (const DataShard& s : shards_) weights.push_back(static_cast<double>(s.tokens));
  by_size_ = std::discrete_distribution<size_t>(weights.begin(), weights.end());
}

size_t ShardSampler::Next() { return by_size_(rng_); }

void ShardSampler::RecordLearned(size_t i, uint64_t steps, uint64_t tokens) {
  steps_[i] += steps;
  tokens_[i] += tokens;
}

}  // namespace aloe::server
