// The coordinator's side of its shard processes' Follow streams: it checks that a shard process
// belongs to this coordinator, (re)assembles the processes (ShardAssembly decides when), restores
// the coordinator where the assembly says so, and sends each stream RESTORE, the order log and
// FINISH. The stream, the coordinator's core and the waits are interfaces (ShardControlService
// implements them over gRPC and CoreHandle), so whole streams are tested without sockets or a
// clock (OrderFeedTest).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "proto/aloe.pb.h"
#include "server/core/shard_assembly.h"

namespace aloe::server {

// One Follow stream, as the coordinator writes it.
class OrderSink {
 public:
  virtual ~OrderSink() = default;
  // False when the shard process is gone.
  virtual bool Write(const v1::ShardOrder& order) = 0;
  virtual bool Cancelled() = 0;
};

// Where workers reach one shard process.
struct ShardAddress {
  uint32_t shard = 0;
  std::string address;
  std::string push_address;
};

// What the feed needs of the coordinator. Called with the feed's lock held, but for
// WaitForOrder.
class FeedHost {
 public:
  virtual ~FeedHost() = default;
  // The version the coordinator's core is at.
  virtual uint64_t version() = 0;
  // The versions the coordinator can restart from: its current one and its checkpoints.
  virtual std::vector<uint64_t> RestartVersions() = 0;
  // Goes back to `version` (one of RestartVersions, or 0).
  virtual absl::Status Restore(uint64_t version) = 0;
  // Tells the core where workers reach these shard processes, all at once; "" for both while a
  // process is not assembled.
  virtual void SetAddresses(const std::vector<ShardAddress>& addresses) = 0;
  // The processes assembled at `version`: the order log starts anew (the journal's RESTORE).
  virtual void Assembled(uint64_t version) = 0;
  // Absolute index of the first order after `version` in the log; nullopt when the log no
  // longer reaches back to it.
  virtual std::optional<uint64_t> OrderIndexAfter(uint64_t version) = 0;
  // The orders from absolute index `cursor` to the end of the log, every COMMIT with the
  // versions to keep; journaled before they are returned.
  virtual std::vector<v1::ShardOrder> OrdersFrom(uint64_t cursor) = 0;
  // The log may drop the orders before absolute index `index`.
  virtual void TrimOrdersBefore(uint64_t index) = 0;
  // Waits until the log holds absolute index `cursor`, or `timeout`.
  virtual void WaitForOrder(uint64_t cursor, absl::Duration timeout) = 0;
};

// How the feed's streams wait for each other.
class FeedWaits {
 public:
  virtual ~FeedWaits() = default;
  // Releases `mu` until WakeAll or `timeout`, then holds it again.
  virtual void Wait(absl::Mutex& mu, absl::Duration timeout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) = 0;
  virtual void WakeAll() = 0;
};

// Thread-safe: one thread per Follow stream.
class OrderFeed {
 public:
  struct Options {
    uint32_t shard_processes = 0;
    std::string fingerprint;  // ShardedModelFingerprint of the coordinator
    // How soon a waiting stream notices a reassembly, a newer connection or a cancel.
    absl::Duration poll = absl::Milliseconds(200);
  };
  // host, waits and clock must outlive the feed.
  OrderFeed(Options options, FeedHost& host, FeedWaits& waits, const Clock& clock);
  OrderFeed(const OrderFeed&) = delete;
  OrderFeed& operator=(const OrderFeed&) = delete;

  // Every shard process follows the current assembly: workers may be served.
  bool ready() ABSL_LOCKS_EXCLUDED(mu_);

  // Serves one Follow stream until it ends. A process that lost only its connection follows on
  // after its version; any other joins an assembly (a new one, when the processes were
  // assembled), waits for the others, and gets RESTORE of the chosen version before the new log.
  // Returns OK once FINISH was sent; kAborted when a newer connection of the process or a new
  // assembly takes over (follow again); kCancelled when the process is gone;
  // kInvalidArgument for a shard index out of range or no address; kFailedPrecondition for
  // another fingerprint.
  absl::Status Serve(const v1::FollowRequest& request, OrderSink& sink) ABSL_LOCKS_EXCLUDED(mu_);

  // The job is over at `version`: every stream sends its remaining orders, then FINISH, and
  // ends. Waits until each shard process was sent FINISH, or `timeout`; returns how many were.
  uint32_t Finish(uint64_t version, absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);

  // The current assembly (ShardAssembly::current_epoch), for tests and logs.
  uint64_t epoch() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Where a stream stands in the log once it follows.
  struct Position {
    uint64_t connection = 0;
    uint64_t epoch = 0;
    uint64_t cursor = 0;              // absolute index of the next order to send
    std::optional<uint64_t> restore;  // RESTORE to send first
  };
  absl::Status Check(const v1::FollowRequest& request) const;
  // Follows on, or joins and waits for the assembly to complete.
  absl::StatusOr<Position> Connect(const v1::FollowRequest& request, OrderSink& sink)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Sends the log from `at` until the stream ends.
  absl::Status Stream(uint32_t shard, Position at, OrderSink& sink) ABSL_LOCKS_EXCLUDED(mu_);
  void BeginAssembly() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeCompleteAssembly() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  FeedHost& host_;
  FeedWaits& waits_;
  const Clock& clock_;
  absl::Mutex mu_;
  ShardAssembly assembly_ ABSL_GUARDED_BY(mu_);
};

}  // namespace aloe::server
