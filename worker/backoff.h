// The worker's waits between retries of a failed call: exponential over the failures in a row,
// capped, and jittered from a seeded generator so that workers that failed together (a server or
// shard process went away under all of them) do not retry in step.
#pragma once

#include <cstdint>
#include <random>

#include "absl/time/time.h"

namespace aloe::worker {

// Not thread-safe.
class RetryBackoff {
 public:
  struct Options {
    // The wait after the first failure (the second when first_at_once); doubling after each
    // further failure in a row, up to `max`.
    absl::Duration initial = absl::Milliseconds(100);
    absl::Duration max = absl::Seconds(5);
    // Each wait is drawn uniformly from [(1 - jitter) d, d], d the capped exponential wait: 0 =
    // exactly d, 1 = full jitter. Clamped to [0, 1].
    double jitter = 0.5;
    // The first failure after a success is retried at once (one failure is often the server's
    // ordinary refusal, e.g. a stale task, not an outage).
    bool first_at_once = false;
    // Seeds the jitter: the same seed draws the same waits.
    uint64_t seed = 0;
  };

  explicit RetryBackoff(Options options);

  // Counts one more failure and returns how long to wait before the next try.
  absl::Duration Failure();
  // A success: the next failure starts over.
  void Reset();
  uint64_t failures() const { return failures_; }
  // The wait the last Failure returned; zero after Reset.
  absl::Duration last() const { return last_; }

 private:
  const Options options_;
  std::mt19937_64 random_;
  uint64_t failures_ = 0;
  absl::Duration last_ = absl::ZeroDuration();
};

}  // namespace aloe::worker
