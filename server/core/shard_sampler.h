// Chooses the data shard of each training task. Today: sampling proportional to shard size with
// a seeded generator (deterministic). Learning-progress sampling (paper 002 Eq. 2) replaces it
// behind the same interface. Also keeps each shard's LR schedule position (paper 002 Eq. 3):
// the number of local steps learned on that shard, advanced when an update is applied.
// Not thread-safe.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace aloe::server {

struct DataShard {
  std::string name;
  std::string file;  // relative to the corpus directory
  uint64_t tokens = 0;
};

class ShardSampler {
 public:
  ShardSampler(std::vector<DataShard> shards, uint64_t seed);

  // Index of the shard for the next task. Precondition: at least one shard with tokens.
  size_t Next();

  const DataShard& shard(size_t i) const { return shards_[i]; }
  size_t size() const { return shards_.size(); }

  // LR schedule position of shard i: local steps learned on it so far.
  uint64_t lr_step(size_t i) const { return steps_[i]; }
  // Records an applied update's work on shard i.
  void RecordLearned(size_t i, uint64_t steps, uint64_t tokens);
  uint64_t tokens_learned(size_t i) const { return tokens_[i]; }

 private:
  std::vector<DataShard> shards_;
  std::vector<uint64_t> steps_;
  std::vector<uint64_t> tokens_;
  std::mt19937_64 rng_;
  std::discrete_distribution<size_t> by_size_;
};

}  // namespace aloe::server
