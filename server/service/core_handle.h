// Serialises access to the ServerCore for the gRPC handlers and wakes long-polling task requests
// whenever the core's state changes. Thread-safe.
#pragma once

#include <memory>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/core/server_core.h"

namespace aloe::server {

class CoreHandle {
 public:
  explicit CoreHandle(std::unique_ptr<ServerCore> core) : core_(std::move(core)) {}
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
    return fn(*core_);
  }

  // RequestTask that holds a WAIT answer for up to max_wait, retrying whenever the state changes.
  absl::StatusOr<v1::Task> RequestTask(const v1::TaskRequest& request, absl::Duration max_wait) {
    absl::MutexLock lock(&mu_);
    const absl::Time deadline = absl::Now() + max_wait;
    while (true) {
      absl::StatusOr<v1::Task> task = core_->RequestTask(request);
      if (!task.ok() || task->kind() != v1::Task::WAIT) {
        changed_.SignalAll();  // the answer may have changed the core (a round opened)
        return task;
      }
      if (changed_.WaitWithDeadline(&mu_, deadline)) return task;
    }
  }

  // The model spec never changes after creation, so it is read without the lock.
  const v1::ModelSpec& spec() const { return core_->spec(); }

 private:
  absl::Mutex mu_;
  absl::CondVar changed_;
  const std::unique_ptr<ServerCore> core_;  // the pointee is guarded by mu_
};

}  // namespace aloe::server
