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
// Following the coordinator (RunFollowLoop) is ShardFollower's (server/core/shard_follower.h):
// this process is the state it applies the orders to (COMMIT, writing a checkpoint every
// checkpoint.every_versions; DISCARD; FORGET; RESTORE), over a Follow stream of gRPC.
// Thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "common/raw_push.h"
#include "proto/aloe.grpc.pb.h"
#include "server/core/checkpoint_store.h"
#include "server/core/shard_follower.h"
#include "server/core/shard_state.h"
#include "server/core/update_assembler.h"
#include "server/service/applied_reporter.h"
#include "server/service/auth.h"
#include "server/service/checkpoint_copies.h"
#include "server/service/parameter_wire.h"
#include "server/service/push_ingest.h"

namespace aloe::server {

// Follow streams over gRPC: ShardControl.Follow with the token, started at the first Read.
class GrpcFollowTransport final : public FollowTransport {
 public:
  // stub must outlive the transport and its streams.
  GrpcFollowTransport(v1::ShardControl::Stub& stub, std::string token)
      : stub_(stub), token_(std::move(token)) {}
  std::unique_ptr<OrderStream> Open(const v1::FollowRequest& request) override;

 private:
  v1::ShardControl::Stub& stub_;
  const std::string token_;
};

// The wait between Follow streams on the real clock. Thread-safe.
class InterruptibleWait final : public ReconnectWait {
 public:
  void Wait(absl::Duration delay) override ABSL_LOCKS_EXCLUDED(mu_);
  void Interrupt() override ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Mutex mu_;
  bool interrupted_ ABSL_GUARDED_BY(mu_) = false;
};

class ShardServer final : public PushIngestService, private FollowedState {
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

  // Follows the coordinator until StopFollowing or the coordinator says the job is over (FINISH,
  // once every order was applied) (OK), following again whenever the stream ends. The
  // coordinator refusing this process for good (another config: kInvalidArgument or
  // kFailedPrecondition; a missing or unknown token: kUnauthenticated or kPermissionDenied)
  // ends it with that refusal instead (ShardFollower::Run).
  absl::Status RunFollowLoop() { return follower_.Run(); }
  // Ends RunFollowLoop at once (the stream open now and any wait), or before it starts.
  void StopFollowing() { follower_.Stop(); }
  // At exit: checkpoints the current version unless it is on disk already (or the state is
  // still fresh, i.e. never assembled), so that a restart loses nothing that was applied.
  void WriteFinalCheckpoint();

  uint64_t version() override;
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
  // FollowedState: what this process's state says in a Follow request, the orders applied to
  // it, and its loss (an order it cannot apply).
  void Describe(v1::FollowRequest* request) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Apply(const v1::ShardOrder& order) override ABSL_LOCKS_EXCLUDED(mu_);
  void MarkFresh() override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Restore(uint64_t version) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What a pull streams: the version it names (kUnavailable while not committed here), or for a
  // pull by layer group the current version once the group reached the version it names.
  absl::StatusOr<ModelSnapshot> SnapshotFor(const v1::PullRequest& request) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies a COMMIT, DISCARD or FORGET to the state and counts it; sets *due to the checkpoint
  // a COMMIT makes due (checkpoint.every_versions), to be written outside the lock.
  absl::Status ApplyLogOrder(const v1::ShardOrder& order, std::optional<v1::ShardCheckpoint>* due)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Asks the coordinator to admit the update `header` names (ShardControl.Admit) until it does,
  // refuses, the push is cancelled or kSlotWait passes.
  absl::Status AwaitAdmission(const std::function<bool()>& cancelled, const v1::PushHeader& header,
                              const std::string& identity);
  // The checks of a push before it is read: its slice and codec (kInvalidArgument), then the
  // coordinator's admission (AwaitAdmission) unless options_.admit_locally.
  absl::Status Admit(const v1::PushHeader& header, const std::string& identity,
                     const std::function<bool()>& cancelled);
  // Waits (up to kSlotWait, or until `cancelled`) for a local staging slot for the update
  // `header` names and takes it; returns the buffers to assemble it in. kResourceExhausted when
  // none came free. The caller gives the slot back (receiving_).
  absl::StatusOr<std::shared_ptr<FloatBufferPool>> TakeSlot(const v1::PushHeader& header,
                                                            const std::function<bool()>& cancelled)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Reports the whole part staged here to the coordinator (ShardControl.ReportStaged) and
  // returns its answer; a refusal (or no answer) drops the part from staging again.
  absl::StatusOr<v1::PushReply> ReportPart(const v1::PushHeader& header,
                                           const std::string& identity, uint64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);
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
  AppliedReporter applied_;  // every version Publish sees
  GrpcFollowTransport follow_transport_;
  InterruptibleWait follow_wait_;
  ShardFollower follower_;
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
