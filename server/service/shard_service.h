// One shard process of a layer-sharded server (aloe-server --role shard): serves Pull and Push
// for the layers it owns and applies the coordinator's orders (ShardControl.Follow) to them.
//
// Push: waits for a staging slot (at most max_staged_updates updates are held; the stream is not
// read meanwhile, so gRPC flow control holds the pusher back), assembles and validates this
// shard's layers, stages them, reports the part to the coordinator and relays its answer. A
// part the coordinator refuses is dropped again. Pull: waits (up to 10 s) until the
// requested version is committed here, then streams this shard's layers of it; a RESTORE
// meanwhile (the processes reassembled at an older version) ends the wait with
// FAILED_PRECONDITION at once.
//
// The follow loop (RunFollowLoop) keeps a Follow stream to the coordinator open, reconnecting
// after any failure, and applies COMMIT (writing a checkpoint every checkpoint.every_versions),
// DISCARD and RESTORE orders in order. Thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <functional>
#include <memory>
#include <set>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "common/raw_push.h"
#include "proto/aloe.grpc.pb.h"
#include "server/core/checkpoint_store.h"
#include "server/core/shard_state.h"
#include "server/core/update_assembler.h"
#include "server/service/auth.h"
#include "server/service/checkpoint_copies.h"
#include "server/service/parameter_wire.h"
#include "server/service/push_ingest.h"

namespace aloe::server {

class ShardServer final : public PushIngestService {
 public:
  struct Options {
    uint32_t shard_index = 0;
    std::string address;       // where workers reach this process (told to the coordinator)
    std::string push_address;  // where it takes raw pushes (RawPushListener); "" = none
    std::string fingerprint;
    std::shared_ptr<grpc::Channel> coordinator;  // with its credentials
    std::string token;                           // x-aloe-token for calls to the coordinator
    CheckpointStore* checkpoints = nullptr;      // null = no checkpoints
    // checkpoint.replicate_shards: gets every checkpoint written; null = none.
    CheckpointUploader* uploader = nullptr;
    uint32_t every_versions = 0;
    uint32_t max_staged = 8;  // the ShardState's max_staged (slots incl. pushes being received)
    // The only shard process (shard_processes 1): its own slots bound what it stages, as the
    // coordinator's admission would, so a push is read without asking Admit first; the
    // coordinator admits the update when its part is reported (ServerCore::SubmitShardPart).
    bool admit_locally = false;
    // A fresh state at version 0 (the initial model), for RESTORE of version 0.
    std::function<absl::StatusOr<std::unique_ptr<ShardState>>()> make_initial;
  };
  // auth and metrics must outlive the server.
  ShardServer(v1::ModelSpec spec, std::unique_ptr<ShardState> state, Options options,
              Authenticator& auth, MetricsSink& metrics);

  grpc::Status ServePull(grpc::ServerContext*, const v1::PullRequest*, PullStreamWriter*) override;
  // Pushes (ServePush, ServeRawPush: PushIngestService) carry this shard's layers only.

  // Follows the coordinator until `stop` is set or the coordinator says the job is over (FINISH,
  // once every order was applied) (OK), reconnecting whenever the stream ends. The
  // coordinator refusing this process for good (another config: kInvalidArgument or
  // kFailedPrecondition; a missing or unknown token: kUnauthenticated or kPermissionDenied)
  // ends it with that refusal instead, since following again would be refused again.
  absl::Status RunFollowLoop(const std::atomic<bool>& stop) ABSL_LOCKS_EXCLUDED(follow_mu_);
  // Ends the follow stream open now, for a RunFollowLoop whose `stop` was just set (it returns
  // without waiting for the coordinator's next order).
  void CancelFollow() ABSL_LOCKS_EXCLUDED(follow_mu_);
  // At exit: checkpoints the current version unless it is on disk already (or the state is
  // still fresh, i.e. never assembled), so that a restart loses nothing that was applied.
  void WriteFinalCheckpoint();

  uint64_t version();
  // Payload bytes of the pushes received whole so far (raw_push_bytes(): the part that came raw).
  uint64_t received_bytes() const { return received_bytes_.load(); }
  // Layer updates of the outer steps applied so far, and those that wrote a fresh buffer
  // (ParameterStore::copied_layer_steps: an older version held for tasks, or a pull under way).
  uint64_t layer_steps() const { return layer_steps_.load(); }
  uint64_t copied_layer_steps() const { return copied_layer_steps_.load(); }

 private:
  std::atomic<uint64_t> received_bytes_{0};
  std::atomic<uint64_t> layer_steps_{0};
  std::atomic<uint64_t> copied_layer_steps_{0};
  // Applies one order; an error means this state cannot follow the log any more.
  absl::Status ApplyOrder(const v1::ShardOrder& order);
  absl::Status Restore(uint64_t version);
  // Asks the coordinator to admit the update `header` names (ShardControl.Admit) until it does,
  // refuses, the push is cancelled or kSlotWait passes.
  absl::Status AwaitAdmission(const std::function<bool()>& cancelled, const v1::PushHeader& header,
                              const std::string& identity);
  // Counts a refused push and returns its status.
  absl::Status Rejected(const absl::Status& status) override;
  // Admission, a staging slot, `read` (the transport's reader into the assembler), staging and
  // the report to the coordinator (PushIngestService::AcceptPush).
  absl::StatusOr<v1::PushReply> AcceptPush(const v1::PushHeader& header,
                                           const std::string& identity,
                                           const std::function<bool()>& cancelled,
                                           absl::FunctionRef<absl::Status(UpdateAssembler&)> read,
                                           absl::Time start) override;
  // Writes `checkpoint` (options_.checkpoints must be set) and hands it to the uploader; logs a
  // failure and carries on.
  void WriteCheckpoint(v1::ShardCheckpoint checkpoint);
  void Publish() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const v1::ModelSpec spec_;
  const Options options_;
  Authenticator& auth_;
  MetricsSink& metrics_;
  std::unique_ptr<v1::ShardControl::Stub> control_;
  absl::Mutex follow_mu_;
  grpc::ClientContext* follow_context_ ABSL_GUARDED_BY(follow_mu_) = nullptr;  // the open stream
  absl::Mutex mu_;
  absl::CondVar changed_;  // a commit, discard or restore happened, or a slot came free
  std::unique_ptr<ShardState> state_ ABSL_GUARDED_BY(mu_);
  uint32_t receiving_ ABSL_GUARDED_BY(mu_) = 0;  // pushes holding a slot, not staged yet
  // The process started (or lost its state): the coordinator must reassemble.
  bool fresh_ ABSL_GUARDED_BY(mu_) = true;
  std::set<uint64_t> unreadable_checkpoints_ ABSL_GUARDED_BY(mu_);
  // RESTOREs applied: a pull waiting for a version ends when this changes under it.
  uint64_t restores_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace aloe::server
