// Serialises access to the ServerCore for the gRPC handlers and wakes long-polling task requests
// whenever the core's state changes. Thread-safe.
#pragma once

#include <memory>
#include <utility>

#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/core/server_core.h"

namespace aloe::server {

class CoreHandle {
 public:
  explicit CoreHandle(std::unique_ptr<ServerCore> core)
      : spec_(core->spec()), core_(std::move(core)) {}
  CoreHandle(const CoreHandle&) = delete;
  CoreHandle& operator=(const CoreHandle&) = delete;

  // Runs fn(core) under the lock, then wakes every waiting RequestTask.
  template <typename F>
  auto Run(F&& fn) {
    struct Wake {
      CoreHandle* h;
      ~Wake() { h->changed_.SignalAll(); }
    } wake{this};
    absl::MutexLock lock(&mu_);
    ++generation_;
    return fn(*core_);
  }

  // Runs fn(const core) under the lock without waking anybody or counting as a change, and sets
  // *generation to the generation it saw (for WaitForChange).
  template <typename F>
  auto Peek(uint64_t* generation, F&& fn) {
    absl::MutexLock lock(&mu_);
    *generation = generation_;
    return fn(static_cast<const ServerCore&>(*core_));
  }

  // Replaces the core (a sharded coordinator rolling back to a checkpoint): every worker of the
  // old one is forgotten and must join again (the new core hands out only ids the old one did
  // not). The new core must have the same model spec.
  void Replace(std::unique_ptr<ServerCore> core) {
    absl::MutexLock lock(&mu_);
    core->ContinueIdsOf(*core_);
    core_ = std::move(core);
    ++generation_;
    changed_.SignalAll();
  }

  // Waits until a Run or Replace after the Peek that saw generation `seen`, or until `timeout`.
  // Returns the generation now.
  uint64_t WaitForChange(uint64_t seen, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    const absl::Time deadline = absl::Now() + timeout;
    while (generation_ == seen) {
      if (changed_.WaitWithDeadline(&mu_, deadline)) break;
    }
    return generation_;
  }

  // A coordinator's: waits until its order log holds an order at absolute index `index` or later
  // (or the core was replaced), or until `timeout`. Unlike WaitForChange no other change wakes the
  // caller: whoever releases the lock evaluates the condition (absl::Mutex::Await), so a call
  // that adds no order wakes no follow stream.
  void WaitForOrder(uint64_t index, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    const ServerCore* current = core_.get();
    auto ready = [&] {
      const ShardCommitLog& log = *core_->shard_log();
      return core_.get() != current || log.first_order_index() + log.orders().size() > index;
    };
    mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  }

  // RequestTask that holds a WAIT answer for up to max_wait, retrying whenever the state changes.
  absl::StatusOr<v1::Task> RequestTask(const v1::TaskRequest& request, absl::Duration max_wait) {
    absl::MutexLock lock(&mu_);
    const absl::Time deadline = absl::Now() + max_wait;
    while (true) {
      ++generation_;
      absl::StatusOr<v1::Task> task = core_->RequestTask(request);
      if (!task.ok() || task->kind() != v1::Task::WAIT) {
        changed_.SignalAll();  // the answer may have changed the core (a round opened)
        return task;
      }
      if (changed_.WaitWithDeadline(&mu_, deadline)) return task;
    }
  }

  // ServerCore::AdmitPush, waiting up to max_wait for an admission to end whenever the core
  // says no (each change re-checks; a refusal changes nothing, so waiting callers do not wake
  // each other). kResourceExhausted when none ended in time.
  absl::Status AdmitPush(const v1::PushHeader& header, absl::Duration max_wait) {
    absl::MutexLock lock(&mu_);
    const absl::Time deadline = absl::Now() + max_wait;
    while (true) {
      absl::StatusOr<bool> admitted = core_->AdmitPush(header);
      if (!admitted.ok() || *admitted) {
        ++generation_;  // admitting (or refusing a stale push) changes the core
        changed_.SignalAll();
        return admitted.status();
      }
      if (changed_.WaitWithDeadline(&mu_, deadline)) {
        return absl::ResourceExhaustedError(absl::StrFormat(
            "%d updates are being pushed to the shards (max_staged_updates): push again later",
            core_->shard_log()->admitted_updates()));
      }
    }
  }

  // The model spec never changes (a replacing core has the same), so it is read without the lock.
  const v1::ModelSpec& spec() const { return spec_; }

 private:
  const v1::ModelSpec spec_;
  absl::Mutex mu_;
  absl::CondVar changed_;
  std::unique_ptr<ServerCore> core_;  // guarded by mu_, like the pointee
  uint64_t generation_ = 0;           // guarded by mu_: Run and Replace calls so far
};

}  // namespace aloe::server
