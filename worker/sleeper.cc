#include "worker/sleeper.h"

#include <algorithm>

#include "absl/time/clock.h"

namespace aloe::worker {

bool RealSleeper::AwaitWithTimeout(absl::Mutex& mu, const absl::Condition& condition,
                                   absl::Duration timeout) {
  return mu.AwaitWithTimeout(condition, timeout);
}

// The caller's mutex is released around the registration, so that lock order is always this
// sleeper's mutex before a waiter's (Advance), never the reverse.
bool FakeSleeper::AwaitWithTimeout(absl::Mutex& mu, const absl::Condition& condition,
                                   absl::Duration timeout) {
  const absl::Time deadline = clock_.Now() + timeout;
  mu.Unlock();
  {
    absl::MutexLock lock(&mu_);
    waiting_.push_back(&mu);
    ++waits_;
  }
  mu.Lock();
  auto done = [&] { return condition.Eval() || clock_.Now() >= deadline; };
  mu.Await(absl::Condition(&done));
  mu.Unlock();
  {
    absl::MutexLock lock(&mu_);
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), &mu));
  }
  mu.Lock();
  return condition.Eval();
}

void FakeSleeper::Advance(absl::Duration d) {
  clock_.Advance(d);
  absl::MutexLock lock(&mu_);
  // Releasing a mutex re-evaluates the conditions of the threads that await on it.
  for (absl::Mutex* waiter : waiting_) {
    waiter->Lock();
    waiter->Unlock();
  }
}

bool FakeSleeper::AwaitWaits(uint64_t n, absl::Duration guard) {
  absl::MutexLock lock(&mu_);
  auto begun = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return waits_ >= n; };
  return mu_.AwaitWithTimeout(absl::Condition(&begun), guard);
}

uint64_t FakeSleeper::waits() const {
  absl::MutexLock lock(&mu_);
  return waits_;
}

void SleepUnlessStopped(absl::Duration d, const std::atomic<bool>& stop) {
  const absl::Time until = absl::Now() + d;
  for (absl::Time now = absl::Now(); now < until && !stop.load(); now = absl::Now()) {
    absl::SleepFor(std::min(until - now, absl::Milliseconds(50)));
  }
}

}  // namespace aloe::worker
