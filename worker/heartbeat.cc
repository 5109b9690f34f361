#include "worker/heartbeat.h"

#include <algorithm>

#include "absl/status/statusor.h"
#include "common/logging.h"
#include "proto/aloe.pb.h"

namespace aloe::worker {

Heartbeat::Heartbeat(ServerApi& server, Sleeper& sleeper, absl::Duration lease)
    : server_(server), sleeper_(sleeper), interval_(Interval(lease)) {
  thread_ = std::thread([this] { Loop(); });
}

Heartbeat::~Heartbeat() { Shutdown(); }

absl::Duration Heartbeat::Interval(absl::Duration lease) {
  return std::max(absl::Milliseconds(50), lease / 3);
}

void Heartbeat::SetWorker(uint64_t worker_id) {
  absl::MutexLock lock(&mu_);
  worker_id_ = worker_id;
  ++generation_;
  steps_per_second_ = 0;
  lease_lost_ = false;
}

void Heartbeat::SetSpeed(double steps_per_second) {
  absl::MutexLock lock(&mu_);
  steps_per_second_ = steps_per_second;
}

bool Heartbeat::lease_lost() const {
  absl::MutexLock lock(&mu_);
  return lease_lost_;
}

void Heartbeat::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void Heartbeat::Loop() {
  absl::MutexLock lock(&mu_);
  while (!sleeper_.AwaitWithTimeout(mu_, absl::Condition(&stop_), interval_)) {
    v1::HeartbeatRequest request;
    request.set_worker_id(worker_id_);
    request.set_steps_per_second(steps_per_second_);
    const uint64_t generation = generation_;
    mu_.Unlock();
    absl::StatusOr<v1::HeartbeatReply> reply = server_.Heartbeat(request);
    mu_.Lock();
    if (reply.ok()) continue;
    if (reply.status().code() == absl::StatusCode::kNotFound && generation == generation_) {
      lease_lost_ = true;
    }
    if (reply.status().code() != absl::StatusCode::kUnavailable) {
      ALOE_LOG_WARNING("worker", "heartbeat: %s", reply.status().ToString());
    }
  }
}

}  // namespace aloe::worker
