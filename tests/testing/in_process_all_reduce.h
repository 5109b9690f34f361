// The all-reduce of a node whose ranks are threads of the test process, without a process group:
// for collective code that takes a sum over ranks (common/low_rank_fsdp.h). Sums in rank order,
// so every rank receives the same bits, and counts the all-reduces. Header-only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace aloe::testing {

// Thread-safe.
class InProcessAllReduce {
 public:
  explicit InProcessAllReduce(int size) : size_(size), buffers_(size) {}

  // Rank `rank`'s part of one all-reduce: blocks until every rank has called, then every rank's
  // values hold the sum over the ranks' values, added in rank order. kInvalidArgument on every
  // rank when the lengths differ (nothing written then).
  absl::Status AllReduce(int rank, absl::Span<float> values) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    const uint64_t generation = generation_;
    buffers_[rank] = values;
    if (++arrived_ < size_) {
      auto summed = [this, generation]()
                        ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return generation_ != generation; };
      mu_.Await(absl::Condition(&summed));
      return status_;
    }
    // The last rank to arrive sums for everyone while the others wait.
    status_ = absl::OkStatus();
    for (int r = 0; r < size_; ++r) {
      if (buffers_[r].size() != values.size()) {
        status_ = absl::InvalidArgumentError(
            absl::StrFormat("all-reduce: rank %d gave %d floats, rank %d %d", r, buffers_[r].size(),
                            rank, values.size()));
      }
    }
    if (status_.ok()) {
      std::vector<float> sum(buffers_[0].begin(), buffers_[0].end());
      for (int r = 1; r < size_; ++r) {
        for (size_t i = 0; i < sum.size(); ++i) sum[i] += buffers_[r][i];
      }
      for (int r = 0; r < size_; ++r) std::copy(sum.begin(), sum.end(), buffers_[r].begin());
      ++calls_;
    }
    arrived_ = 0;
    ++generation_;
    return status_;
  }

  // The all-reduces completed.
  int calls() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return calls_;
  }

 private:
  const int size_;
  mutable absl::Mutex mu_;
  std::vector<absl::Span<float>> buffers_ ABSL_GUARDED_BY(mu_);
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// Runs fn(rank) on `size` threads, rank r on thread r, and joins them.
inline void RunRankThreads(int size, const std::function<void(int rank)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) threads.emplace_back([&fn, r] { fn(r); });
  for (std::thread& t : threads) t.join();
}

}  // namespace aloe::testing
