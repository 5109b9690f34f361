// A shard process's side of following its coordinator's order log: keep one Follow stream open,
// hand each order to the process's state in stream order, and follow again after any end of the
// stream, backing off while the coordinator cannot be reached. The stream, the state and the
// wait between streams are interfaces (ShardServer implements them over gRPC), so the reconnect
// logic is tested without sockets or a clock (ShardFollowerTest).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/aloe.pb.h"

namespace aloe::server {

// One open Follow stream, as the shard process reads it.
class OrderStream {
 public:
  virtual ~OrderStream() = default;
  // Blocks for the next order; false once the stream ended (Finish then says how).
  virtual bool Read(v1::ShardOrder* order) = 0;
  // Ends the stream from this side. Thread-safe: called by ShardFollower::Stop while another
  // thread reads.
  virtual void Cancel() = 0;
  // After Read returned false (or after Cancel): the status the stream ended with.
  virtual absl::Status Finish() = 0;
};

// Opens Follow streams to the coordinator. The stream need not be connected before its first
// Read (it may be cancelled before that).
class FollowTransport {
 public:
  virtual ~FollowTransport() = default;
  virtual std::unique_ptr<OrderStream> Open(const v1::FollowRequest& request) = 0;
};

// The state the orders act on: the layers of the shard process. Thread-safe.
class FollowedState {
 public:
  virtual ~FollowedState() = default;
  // Fills what a Follow request says of the state: version, fresh and checkpoint_versions.
  virtual void Describe(v1::FollowRequest* request) = 0;
  virtual uint64_t version() = 0;
  // Applies one RESTORE, COMMIT, DISCARD or FORGET order. An error (a commit out of order, a
  // checkpoint that cannot be read) means this state cannot follow the log on.
  virtual absl::Status Apply(const v1::ShardOrder& order) = 0;
  // This state cannot follow the log on: the next request must say fresh, so that the processes
  // reassemble from a common checkpoint.
  virtual void MarkFresh() = 0;
};

// The wait between two Follow streams.
class ReconnectWait {
 public:
  virtual ~ReconnectWait() = default;
  // Waits `delay`, or less once Interrupt was called.
  virtual void Wait(absl::Duration delay) = 0;
  // Ends the current wait and every later one at once. Thread-safe.
  virtual void Interrupt() = 0;
};

// Capped exponential backoff over consecutive attempts that did not reach the coordinator: the
// first waits `initial`, each further one twice the one before, at most `max`. An attempt that
// reached it starts over at `initial`. Not thread-safe.
class ReconnectBackoff {
 public:
  ReconnectBackoff(absl::Duration initial, absl::Duration max) : initial_(initial), max_(max) {}
  // The wait after an attempt; `reached`: it got an order or the coordinator's own answer.
  absl::Duration After(bool reached);
  // Consecutive attempts so far that did not reach the coordinator.
  uint32_t unreached() const { return unreached_; }

 private:
  const absl::Duration initial_;
  const absl::Duration max_;
  uint32_t unreached_ = 0;
};

// Follows the coordinator until Stop, FINISH or a refusal for good. Thread-safe: Run on one
// thread, Stop from any.
class ShardFollower {
 public:
  struct Options {
    uint32_t shard_index = 0;
    std::string address;       // where workers reach this process
    std::string push_address;  // where it takes raw pushes; "" = none
    std::string fingerprint;   // ShardedModelFingerprint
    // ReconnectBackoff: after a stream that reached the coordinator the wait is always
    // retry_initial.
    absl::Duration retry_initial = absl::Milliseconds(200);
    absl::Duration retry_max = absl::Seconds(2);
  };
  // transport, state and wait must outlive the follower.
  ShardFollower(Options options, FollowTransport& transport, FollowedState& state,
                ReconnectWait& wait);
  ShardFollower(const ShardFollower&) = delete;
  ShardFollower& operator=(const ShardFollower&) = delete;

  // Follows, opening a new stream whenever one ends, until:
  //  - FINISH of the version the state is at (every order before it was applied): OK. A FINISH
  //    of another version is refused (logged; the state is unchanged) and the stream goes on;
  //  - the coordinator refuses this process for good (RefusedForGood: another config or a bad
  //    token): that refusal, since following again would be refused again;
  //  - Stop: OK.
  // An order the state cannot apply marks it fresh and ends the stream; the next one asks the
  // processes to reassemble.
  absl::Status Run() ABSL_LOCKS_EXCLUDED(mu_);
  // Ends Run: cancels the open stream and the wait, and no stream opens after it.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  // Streams opened so far.
  uint64_t streams() const { return streams_.load(); }

 private:
  // How one stream ended.
  struct Attempt {
    bool over = false;     // Run returns `status`
    bool reached = false;  // got an order or the coordinator's own answer
    absl::Status status;
  };
  // The request of the next stream.
  v1::FollowRequest Request();
  // Opens one stream and applies its orders until it ends.
  Attempt FollowOnce() ABSL_LOCKS_EXCLUDED(mu_);
  // Reads and applies the orders of `stream` until it ends.
  Attempt ReadOrders(OrderStream& stream);
  // A FINISH of `version` ends the job when the state is at it (every order before it was
  // applied); another version is refused and logged.
  bool JobOver(uint64_t version);
  // Applies `order`; false (logged, the state marked fresh) when the state cannot.
  bool Applied(const v1::ShardOrder& order);
  // How a stream that ended with `status` (not stopped, every order applied) ends the attempt.
  Attempt Ended(const absl::Status& status, bool reached);

  const Options options_;
  FollowTransport& transport_;
  FollowedState& state_;
  ReconnectWait& wait_;
  ReconnectBackoff backoff_;  // Run's thread only
  bool announced_ = false;    // Run's thread only
  std::atomic<uint64_t> streams_{0};
  std::atomic<bool> stopped_{false};
  absl::Mutex mu_;
  OrderStream* open_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace aloe::server
