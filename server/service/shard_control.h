// The coordinator's side of a layer-sharded server (aloe-server --role coordinator): shard
// processes report staged update parts (ReportStaged) and follow the order log (Follow). The
// gRPC adapter of ShardAssembly (server/core/shard_assembly.h), which decides when the shards
// (re)assemble and which stream may go on; this file runs the restore, streams the orders and
// tells the core the shards' addresses.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "proto/aloe.grpc.pb.h"
#include "server/core/order_journal.h"
#include "server/core/shard_assembly.h"
#include "server/service/auth.h"
#include "server/service/core_handle.h"

namespace aloe::server {

class ShardControlService final : public v1::ShardControl::Service {
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
    // Gets aloe_shard_checkpoint_copy_version per stored copy; null = none.
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
  grpc::Status StoreCheckpoint(grpc::ServerContext*, grpc::ServerReader<v1::CheckpointPiece>*,
                               v1::StoreCheckpointReply*) override ABSL_LOCKS_EXCLUDED(copies_mu_);
  grpc::Status FetchCheckpoint(grpc::ServerContext*, const v1::FetchCheckpointRequest*,
                               grpc::ServerWriter<v1::CheckpointPiece>*) override
      ABSL_LOCKS_EXCLUDED(copies_mu_);

  // The job is over at `version`: every Follow stream sends its remaining orders, then FINISH,
  // and ends. Waits until each shard process was sent FINISH, or `timeout` (a shard away now
  // keeps asking to follow until it is stopped); returns how many were.
  uint32_t Finish(uint64_t version, absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The caller is a shard process: with token auth, a token of options_.shard_identity
  // (UNAUTHENTICATED for a missing or unknown token, PERMISSION_DENIED for another identity's).
  grpc::Status CheckShardCaller(const grpc::ServerContext& context, const char* rpc) const;
  // What Admit and ReportStaged check first: the shard's token, that `identity` owns the worker,
  // and that the shards are assembled (UNAVAILABLE while they reassemble).
  grpc::Status CheckPartCall(const grpc::ServerContext& context, uint64_t worker_id,
                             const std::string& identity) ABSL_LOCKS_EXCLUDED(mu_);
  // Starts a new assembly (ends every stream). Requires mu_.
  void BeginAssembly() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completes the assembly when every shard joined it. Requires mu_.
  void MaybeCompleteAssembly() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Trims the coordinator's order log before absolute index `index` (ShardAssembly::Sent) when
  // that drops a batch.
  void TrimLog(uint64_t index);

  // The store of shard `shard`'s copies (options_.replica_dir must be set).
  std::string CopiesDir(uint32_t shard) const;

  CoreHandle& handle_;
  Authenticator& auth_;
  const Options options_;
  absl::Mutex copies_mu_;  // one copy written or read at a time
  absl::Mutex mu_;
  absl::CondVar assembled_;
  ShardAssembly assembly_ ABSL_GUARDED_BY(mu_);
};

}  // namespace aloe::server
