// Chooses the data shard of each training task by learning progress (paper 002 Eq. 2):
//   p_i ∝ max(|D_i| / sum_j |D_j| - n_i / sum_j n_j, 0)
// where |D_i| is data shard i's size in tokens and n_i the tokens of it learned so far PLUS the
// tokens already assigned to open tasks but not yet returned ("in flight"). Counting in-flight
// work means that many workers asking at once do not all get the same under-sampled data shard
// (herding); a dropped task releases its tokens. When sum n = 0 (start) or every p_i = 0
// (exact balance) the draw is proportional to |D_i|. An over-sampled data shard (p_i = 0) is never
// drawn. kProportional ignores progress and always draws ∝ |D_i|.
//
// Also keeps each data shard's LR schedule position (paper 002 Eq. 3): the local steps learned on
// it, advanced when an update is applied. Deterministic for a seed. Not thread-safe.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace aloe::server {

struct DataShard {
  std::string name;
  std::string file;  // relative to the corpus directory
  uint64_t tokens = 0;
};

class DataShardSampler {
 public:
  enum class Mode { kLearningProgress, kProportional };

  // Precondition: at least one data shard with tokens > 0 (ServerCore::Create checks).
  DataShardSampler(std::vector<DataShard> shards, uint64_t seed,
                   Mode mode = Mode::kLearningProgress);

  // Index of the data shard for the next task (draws; does not record anything).
  size_t Next();
  // The distribution Next() draws from now (sums to 1).
  std::vector<double> Probabilities() const;

  // A task on data shard i is expected to learn `tokens`: counted as in flight until it returns.
  void Assign(size_t i, uint64_t tokens);
  // The task was dropped (its worker left or expired): its in-flight tokens are released.
  void Release(size_t i, uint64_t tokens);
  // An applied update of a task that had `assigned` tokens in flight on data shard i learned
  // `tokens` in `steps` local steps.
  void RecordLearned(size_t i, uint64_t assigned, uint64_t steps, uint64_t tokens);

  // Checkpoint support: the generator state, and a restore of the learned counters and the
  // generator (in-flight counts restart at zero: tasks do not survive a restart).
  // kInvalidArgument when the sizes do not match the data shards or the generator state is bad.
  std::string RngState() const;
  absl::Status Restore(const std::vector<uint64_t>& steps, const std::vector<uint64_t>& tokens,
                       const std::string& rng_state);

  const DataShard& shard(size_t i) const { return shards_[i]; }
  size_t size() const { return shards_.size(); }
  uint64_t lr_step(size_t i) const { return steps_[i]; }
  uint64_t tokens_learned(size_t i) const { return learned_[i]; }
  uint64_t tokens_in_flight(size_t i) const { return in_flight_[i]; }

 private:
  std::vector<DataShard> shards_;
  Mode mode_;
  std::vector<uint64_t> steps_;
  std::vector<uint64_t> learned_;
  std::vector<uint64_t> in_flight_;
  double total_size_ = 0;
  std::mt19937_64 rng_;
};

}  // namespace aloe::server
