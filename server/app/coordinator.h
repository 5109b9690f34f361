// aloe-server --role coordinator: the membership, tasks and update order of a layer-sharded
// server (config.shard_processes > 0). Serves the Coordinator API to workers and the
// ShardControl API to the shard processes, which hold the parameters and follow its order log;
// when the shard processes (re)assemble it replaces its core by one restored to the version
// they agree on.
//
// Start and Shutdown may be called from any thread, once each; the destructor shuts down a
// server still running (no drain).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "server/app/core_runner.h"
#include "server/core/order_journal.h"
#include "server/service/grpc_services.h"
#include "server/service/shard_control.h"

namespace aloe::server {

class CoordinatorServer final : public CoreServerRole {
 public:
  struct Options {
    // core.config with shard_processes > 0; its listen_address may name port 0.
    CoreRunner::Options core;
    // Append every order sent to the shard processes to this file (OrderJournal); "" = none.
    std::string order_journal;
  };

  explicit CoordinatorServer(Options options) : options_(std::move(options)) {}
  ~CoordinatorServer() override;

  // kInvalidArgument for shard_processes 0, or a token file without a token of
  // security.shard_identity; CoreRunner's and the journal's errors.
  absl::Status Start() override;
  // When the job is over, tells the shard processes to stop (and awaits their last checkpoints'
  // copies with checkpoint.replicate_shards); else drains (CoreRunner::Drain) and leaves them
  // following, for a restarted coordinator to resume. Then stops listening and writes the final
  // checkpoint and the summary (CoreRunner::Finish).
  absl::Status Shutdown(absl::string_view why, absl::FunctionRef<bool()> cut_short) override;
  using ServerRole::Shutdown;

 private:
  // The versions the coordinator can restart from: its checkpoints' and its current one.
  std::vector<uint64_t> Versions();
  // Replaces the core by one at `version`: the current state, a checkpoint or the initial model.
  // Its workers are forgotten (they join again): their tasks may start from versions undone.
  absl::Status Restore(uint64_t version);
  // Tells the shard processes the job is over at the current version.
  void FinishShards();

  const Options options_;
  std::unique_ptr<OrderJournal> journal_;
  std::unique_ptr<CoordinatorService> coordinator_;
  std::unique_ptr<ShardControlService> shard_control_;
  bool stopped_ = false;
};

}  // namespace aloe::server
