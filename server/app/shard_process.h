// aloe-server --role shard: one shard process of a layer-sharded server. Holds the parameters
// and outer optimizer state of its layers, serves Pull and Push for them to workers (and raw
// pushes with a push listener) and follows the coordinator's order log (ShardServer).
//
// The destructor stops a process still running (without a final checkpoint).
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/executor.h"
#include "common/metrics.h"
#include "proto/aloe.grpc.pb.h"
#include "server/app/server_role.h"
#include "server/app/status_page.h"
#include "server/core/checkpoint_store.h"
#include "server/core/commit_record.h"
#include "server/core/shard_state.h"
#include "server/service/auth.h"
#include "server/service/checkpoint_copies.h"
#include "server/service/raw_push_listener.h"
#include "server/service/shard_service.h"

namespace aloe::server {

class ShardProcess final : public ServerRole {
 public:
  struct Options {
    // Validated (common/config.h), with shard_processes > shard_index. Its listen_address is the
    // coordinator's; its metrics_address this process's ("off" = none).
    v1::ServerConfig config;
    uint32_t shard_index = 0;
    // Where this process listens for workers (HOST:PORT), and where workers are told to reach it
    // (advertise, "" = listen): an address they can dial.
    std::string listen;
    std::string advertise;
    // The coordinator's address ("" = config.listen_address).
    std::string coordinator;
    // Also take raw pushes on this HOST:PORT ("" = none), told to workers as advertise_push
    // ("" = push_listen).
    std::string push_listen;
    std::string advertise_push;
    // File whose first line is the token presented to the coordinator ("" = none).
    std::string token_file;
    // Restore the newest checkpoint of checkpoint.dir/shard-<index> (or, with none and
    // checkpoint.replicate_shards, the coordinator's newest copy of it).
    bool resume = false;
    // Testing: append every committed update to this file (server/core/commit_record.h; "" =
    // none), for aloe-replay.
    std::string record_commits;
  };

  explicit ShardProcess(Options options) : options_(std::move(options)) {}
  ~ShardProcess() override;

  // Builds this process's layers (resuming when asked), listens and starts following the
  // coordinator. The model's, the checkpoint's, the credentials' and the listeners' errors.
  absl::Status Start() override;
  int grpc_port() const override { return grpc_port_; }
  int metrics_port() const override { return metrics_port_; }
  // The job is over, or the coordinator refuses this process for good (Shutdown says which).
  bool finished() const override { return ended_.load(); }
  // Stops following and listening, writes the final checkpoint (and awaits its copy at the
  // coordinator with checkpoint.replicate_shards). Returns the follow loop's refusal, if any
  // (ShardServer::RunFollowLoop). No drain: the coordinator's tasks go on without this process
  // only once it is back.
  absl::Status Shutdown(absl::string_view why, absl::FunctionRef<bool()> cut_short) override;
  using ServerRole::Shutdown;

 private:
  // --resume: restores `state` from the newest checkpoint of checkpoint.dir/shard-<index>, or,
  // with none and checkpoint.replicate_shards, from the coordinator's newest copy (fetched with
  // `token` and written there first); with neither, the initial model stays (a warning).
  // kInvalidArgument without checkpoint.dir; the store's, the fetch's and Restore's errors.
  absl::Status Resume(ShardState& state, const std::string& fingerprint, const std::string& token);

  const Options options_;
  std::unique_ptr<ThreadPoolExecutor> executor_;
  // Served on metrics_, which goes first (and stops serving it).
  std::unique_ptr<StatusPage> status_;
  std::unique_ptr<MetricsSink> metrics_;
  std::unique_ptr<Authenticator> auth_;
  std::unique_ptr<CheckpointStore> checkpoints_;
  std::shared_ptr<CommitRecorder> recorder_;  // --record_commits; null = none
  std::unique_ptr<v1::ShardControl::Stub> copies_stub_;
  std::unique_ptr<CheckpointUploader> uploader_;
  std::unique_ptr<ShardServer> shard_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<RawPushListener> raw_pushes_;
  int grpc_port_ = 0;
  int metrics_port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<bool> ended_{false};
  absl::Status followed_;  // written by the follow thread before ended_
  std::thread follow_;
  bool stopped_ = false;
};

}  // namespace aloe::server
