// Timed waits of the worker's background threads (the heartbeat), measured on the time the
// worker is given: real time in a process, a FakeClock that a test advances by hand. A test
// thereby drives a thread's periodic work deterministically, without the wall clock.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace aloe::worker {

// Thread-safe.
class Sleeper {
 public:
  virtual ~Sleeper() = default;
  // As absl::Mutex::AwaitWithTimeout: releases `mu` until `condition` holds or `timeout` has
  // passed, then holds it again. Returns whether `condition` holds. REQUIRES: the caller holds
  // `mu`; `condition` reads only state guarded by `mu`.
  virtual bool AwaitWithTimeout(absl::Mutex& mu, const absl::Condition& condition,
                                absl::Duration timeout) = 0;
};

// Waits in real time. Thread-safe.
class RealSleeper final : public Sleeper {
 public:
  bool AwaitWithTimeout(absl::Mutex& mu, const absl::Condition& condition,
                        absl::Duration timeout) override;
};

// Waits in the time of a FakeClock: a wait ends once its condition holds, or once Advance has
// moved the clock to its deadline. Thread-safe.
class FakeSleeper final : public Sleeper {
 public:
  // `clock` must outlive this.
  explicit FakeSleeper(FakeClock& clock) : clock_(clock) {}

  bool AwaitWithTimeout(absl::Mutex& mu, const absl::Condition& condition,
                        absl::Duration timeout) ABSL_NO_THREAD_SAFETY_ANALYSIS override;
  // Advances the clock by `d` and wakes the waits whose deadline it reached. When it returns,
  // every wait it did not wake is still waiting.
  void Advance(absl::Duration d) ABSL_NO_THREAD_SAFETY_ANALYSIS;
  // Blocks until `n` waits have begun since construction; false if they have not after `guard`
  // of real time (a test's guard against a hang).
  bool AwaitWaits(uint64_t n, absl::Duration guard = absl::Seconds(30));
  uint64_t waits() const;

 private:
  FakeClock& clock_;
  mutable absl::Mutex mu_;
  // The mutexes of the waits under way, locked and released by Advance to re-check them.
  std::vector<absl::Mutex*> waiting_ ABSL_GUARDED_BY(mu_);
  uint64_t waits_ ABSL_GUARDED_BY(mu_) = 0;
};

// Sleeps `d` of wall time, or until `stop` is set (checked every 50 ms): AgentEnv::sleep for a
// real process.
void SleepUnlessStopped(absl::Duration d, const std::atomic<bool>& stop);

}  // namespace aloe::worker
