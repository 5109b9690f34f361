// Keeps a worker's lease at the server alive: a background thread sends a Heartbeat once every
// third of the lease, with the worker id and the training speed it was last given. A Heartbeat
// answered kNotFound means the server no longer knows the worker (its lease expired, or the
// server restarted): lease_lost() tells the agent to join again.
#pragma once

#include <cstdint>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/server_api.h"
#include "worker/sleeper.h"

namespace aloe::worker {

// Thread-safe. Stops and joins its thread in Shutdown and the destructor.
class Heartbeat {
 public:
  // Starts the thread; the first heartbeat goes one interval after. `server` and `sleeper` must
  // outlive this.
  Heartbeat(ServerApi& server, Sleeper& sleeper, absl::Duration lease);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  // The wait between heartbeats for `lease`: a third of it, at least 50 ms.
  static absl::Duration Interval(absl::Duration lease);

  // The worker the heartbeats are for, after a join: its speed is unknown again and its lease is
  // not lost. An answer to a heartbeat sent before this call is not held against it.
  void SetWorker(uint64_t worker_id);
  // Local steps per second of wall time, as measured over the last round.
  void SetSpeed(double steps_per_second);
  // Whether the server answered a heartbeat of the current worker with kNotFound.
  bool lease_lost() const;
  // Stops the thread at once (a wait under way ends) and joins it: no Heartbeat call is made
  // after it returns. Idempotent.
  void Shutdown();

 private:
  void Loop();

  ServerApi& server_;
  Sleeper& sleeper_;
  const absl::Duration interval_;
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t worker_id_ ABSL_GUARDED_BY(mu_) = 0;
  // Counts SetWorker calls: tells an answer about the current worker from one about an earlier.
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  double steps_per_second_ ABSL_GUARDED_BY(mu_) = 0;
  bool lease_lost_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace aloe::worker
