// The coordinator's side of a layer-sharded server (aloe-server --role coordinator): shard
// processes report staged update parts (ReportStaged) and follow the order log (Follow). Follow
// is the gRPC adapter of OrderFeed (server/core/order_feed.h), which assembles the shard
// processes and streams the orders; this file gives it the core's order log, the restore and the
// shard processes' addresses (FeedHost) and keeps the copies of their checkpoints.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "proto/aloe.grpc.pb.h"
#include "server/core/order_feed.h"
#include "server/core/order_journal.h"
#include "server/service/auth.h"
#include "server/service/core_handle.h"

namespace aloe::server {

// FeedWaits on a condition variable (real time). Thread-safe.
class CondVarWaits final : public FeedWaits {
 public:
  void Wait(absl::Mutex& mu, absl::Duration timeout) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    changed_.WaitWithTimeout(&mu, timeout);
  }
  void WakeAll() override { changed_.SignalAll(); }

 private:
  absl::CondVar changed_;
};

class ShardControlService final : public v1::ShardControl::Service, private FeedHost {
 public:
  struct Options {
    uint32_t shard_processes = 0;
    std::string fingerprint;  // ShardedModelFingerprint of this server
    // With token auth: the only identity that may call these RPCs (security.shard_identity).
    std::string shard_identity = "shards";
    // The versions the coordinator can restart from: its current one and its checkpoints.
    std::function<std::vector<uint64_t>()> coordinator_versions;
    // Replaces the handle's core by one at `version` (one of coordinator_versions, or 0).
    std::function<absl::Status(uint64_t version)> restore;
    // Receives every order before it is sent and a RESTORE per assembly; null = none.
    OrderJournal* journal = nullptr;
    // checkpoint.replicate_shards: where the copies of the shards' checkpoints go
    // (<replica_dir>/shard-<i>, the newest `keep` each); "" = none are kept.
    std::string replica_dir;
    uint32_t keep = 3;
    // Gets aloe_shard_checkpoint_copy_version per stored copy and aloe_shard_applied_version per
    // ReportApplied; null = none.
    MetricsSink* metrics = nullptr;
  };
  // handle and auth must outlive the service.
  ShardControlService(CoreHandle& handle, Authenticator& auth, Options options);

  grpc::Status Admit(grpc::ServerContext*, const v1::AdmitRequest*, v1::AdmitReply*) override;
  grpc::Status ReportStaged(grpc::ServerContext*, const v1::StagedReport*, v1::PushReply*) override;
  grpc::Status Follow(grpc::ServerContext*, const v1::FollowRequest*,
                      grpc::ServerWriter<v1::ShardOrder>*) override;
  // checkpoint.replicate_shards: waits until a copy of `version` of every shard process's
  // checkpoints is kept, up to `timeout`; false on timeout (true when none are kept).
  bool AwaitCopies(uint64_t version, absl::Duration timeout) ABSL_LOCKS_EXCLUDED(copies_mu_);
  grpc::Status ReportApplied(grpc::ServerContext*, const v1::AppliedReport*,
                             v1::AppliedAck*) override;
  grpc::Status StoreCheckpoint(grpc::ServerContext*, grpc::ServerReader<v1::CheckpointPiece>*,
                               v1::StoreCheckpointReply*) override ABSL_LOCKS_EXCLUDED(copies_mu_);
  grpc::Status FetchCheckpoint(grpc::ServerContext*, const v1::FetchCheckpointRequest*,
                               grpc::ServerWriter<v1::CheckpointPiece>*) override
      ABSL_LOCKS_EXCLUDED(copies_mu_);

  // The job is over at `version`: every Follow stream sends its remaining orders, then FINISH,
  // and ends. Waits until each shard process was sent FINISH, or `timeout` (a shard away now
  // keeps asking to follow until it is stopped); returns how many were.
  uint32_t Finish(uint64_t version, absl::Duration timeout) {
    return feed_.Finish(version, timeout);
  }

 private:
  // The caller is a shard process: with token auth, a token of options_.shard_identity
  // (UNAUTHENTICATED for a missing or unknown token, PERMISSION_DENIED for another identity's).
  grpc::Status CheckShardCaller(const grpc::ServerContext& context, const char* rpc) const;
  // What Admit and ReportStaged check first: the shard process's token, that `identity` owns
  // the worker, and that the shard processes are assembled (UNAVAILABLE while they reassemble).
  grpc::Status CheckPartCall(const grpc::ServerContext& context, uint64_t worker_id,
                             const std::string& identity);

  // FeedHost over the handle's core and the journal.
  uint64_t version() override;
  std::vector<uint64_t> RestartVersions() override { return options_.coordinator_versions(); }
  absl::Status Restore(uint64_t version) override { return options_.restore(version); }
  void SetAddresses(const std::vector<ShardAddress>& addresses) override;
  void Assembled(uint64_t version) override;
  std::optional<uint64_t> OrderIndexAfter(uint64_t version) override;
  std::vector<v1::ShardOrder> OrdersFrom(uint64_t cursor) override;
  // Only when that drops a batch (a Run wakes every stream).
  void TrimOrdersBefore(uint64_t index) override;
  void WaitForOrder(uint64_t cursor, absl::Duration timeout) override {
    handle_.WaitForOrder(cursor, timeout);
  }

  // The store of shard `shard`'s copies (options_.replica_dir must be set).
  std::string CopiesDir(uint32_t shard) const;

  CoreHandle& handle_;
  Authenticator& auth_;
  const Options options_;
  absl::Mutex copies_mu_;  // one copy written or read at a time
  RealClock clock_;
  CondVarWaits waits_;
  OrderFeed feed_;
};

}  // namespace aloe::server
