#include "server/service/shard_service.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/model_spec.h"
#include "common/status_macros.h"
#include "server/core/server_metrics.h"
#include "server/core/update_assembler.h"
#include "server/service/grpc_services.h"

namespace aloe::server {
namespace {

// How long a push waits for a staging slot, and a pull for its version to be committed here.
constexpr absl::Duration kSlotWait = absl::Seconds(120);
constexpr absl::Duration kVersionWait = absl::Seconds(10);

// A raw push answers with the status a gRPC push would have.
absl::Status AbslStatusOf(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

ShardFollower::Options FollowerOptions(const ShardServer::Options& options) {
  ShardFollower::Options follow;
  follow.shard_index = options.shard_index;
  follow.address = options.address;
  follow.push_address = options.push_address;
  follow.fingerprint = options.fingerprint;
  return follow;
}

AppliedReporter::Options ReporterOptions(const ShardServer::Options& options) {
  AppliedReporter::Options report;
  report.shard_index = options.shard_index;
  report.token = options.token;
  return report;
}

}  // namespace

ShardServer::ShardServer(v1::ModelSpec spec, std::unique_ptr<ShardState> state, Options options,
                         Authenticator& auth, MetricsSink& metrics)
    : PushIngestService(auth, metrics, spec, options.shard_index, state->layer_groups()),
      spec_(std::move(spec)),
      options_(std::move(options)),
      auth_(auth),
      metrics_(metrics),
      control_(v1::ShardControl::NewStub(options_.coordinator)),
      applied_(*control_, ReporterOptions(options_)),
      follow_transport_(*control_, options_.token),
      follower_(FollowerOptions(options_), follow_transport_, *this, follow_wait_),
      state_(std::move(state)) {}

uint64_t ShardServer::version() {
  absl::MutexLock lock(&mu_);
  return state_->version();
}

void ShardServer::Publish() {
  metrics_.Set(kModelVersion, static_cast<double>(state_->version()));
  metrics_.Set(kStagedUpdates, static_cast<double>(state_->staged_count()));
  metrics_.Set(kStagedBytes, static_cast<double>(state_->staged_bytes()));
  applied_.Set(state_->version());
}

grpc::Status ShardServer::ServePull(grpc::ServerContext* context, const v1::PullRequest* request,
                                    PullStreamWriter* writer) {
  if (absl::StatusOr<std::string> who = auth_.Identify(*context); !who.ok()) {
    return ToGrpcStatus(who.status());
  }
  if (absl::Status s = CheckSlice(request->slice(), request->slices()); !s.ok()) {
    return ToGrpcStatus(s);
  }
  absl::StatusOr<ModelSnapshot> snapshot;
  {
    absl::MutexLock lock(&mu_);
    if (request->by_group() &&
        (layer_groups().empty() || request->group() >= state_->num_layer_groups())) {
      return ToGrpcStatus(absl::InvalidArgumentError(absl::StrFormat(
          "pull of layer group %d, but this server has %d layer groups (partial_sync.groups)",
          request->group(), layer_groups().empty() ? 1 : state_->num_layer_groups())));
    }
    const absl::Time deadline = absl::Now() + kVersionWait;
    const uint64_t restores = restores_;
    while (true) {
      snapshot = SnapshotFor(*request);
      if (snapshot.status().code() != absl::StatusCode::kUnavailable) break;
      if (restores_ != restores) {
        // The processes went back to a common version: the one asked for, if it comes again,
        // will hold other parameters. Its task is gone too; the worker joins again.
        snapshot = absl::FailedPreconditionError(absl::StrFormat(
            "version %d will not come to shard %d: the shard processes went back to version %d "
            "(a shard process restarted); join again",
            request->version(), options_.shard_index, state_->version()));
        break;
      }
      if (context->IsCancelled() || changed_.WaitWithDeadline(&mu_, deadline)) break;
    }
  }
  if (!snapshot.ok()) return ToGrpcStatus(snapshot.status());
  if (!request->by_group()) {
    return StreamSnapshot(*context, *snapshot, request->slice(), request->slices(), *writer,
                          metrics_);
  }
  const GroupPull group{layer_groups(), request->group(),
                        snapshot->group_versions[request->group()]};
  return StreamSnapshot(*context, *snapshot, request->slice(), request->slices(), *writer, metrics_,
                        &group);
}

absl::StatusOr<ModelSnapshot> ShardServer::SnapshotFor(const v1::PullRequest& request) const {
  if (!request.by_group()) {
    return state_->SnapshotAt(request.latest() ? state_->version() : request.version());
  }
  // A layer group at its current version, once this shard has applied the group's commit of
  // the version asked for.
  if (state_->group_version(request.group()) < request.version()) {
    return absl::UnavailableError(absl::StrFormat(
        "layer group %d is at version %d on shard %d, %d was asked for", request.group(),
        state_->group_version(request.group()), options_.shard_index, request.version()));
  }
  return state_->SnapshotAt(state_->version());
}

absl::Status ShardServer::Rejected(const absl::Status& status) {
  metrics_.Add(kUpdatesRejected, 1, {RejectReason(status)});
  return status;
}

absl::StatusOr<v1::PushReply> ShardServer::AcceptPush(
    const v1::PushHeader& header, const std::string& identity,
    const std::function<bool()>& cancelled, absl::FunctionRef<absl::Status(UpdateAssembler&)> read,
    absl::Time start) {
  if (absl::Status admitted = Admit(header, identity, cancelled); !admitted.ok()) {
    return Rejected(admitted);
  }
  absl::StatusOr<std::shared_ptr<FloatBufferPool>> buffers = TakeSlot(header, cancelled);
  if (!buffers.ok()) return Rejected(buffers.status());
  struct Release {
    ShardServer* server;
    ~Release() {
      absl::MutexLock lock(&server->mu_);
      --server->receiving_;
      server->changed_.SignalAll();
    }
  } release{this};

  // The layer groups never change after the start.
  UpdateAssembler assembler(spec_, header, options_.shard_index, *std::move(buffers),
                            /*sum_squares=*/false, layer_groups());
  if (absl::Status s = read(assembler); !s.ok()) return Rejected(s);
  CountReceivedBytes(assembler, metrics_);
  const uint64_t bytes = assembler.bytes_received();
  received_bytes_ += bytes;
  absl::StatusOr<PendingUpdate> part = std::move(assembler).Finish();
  if (!part.ok()) return Rejected(part.status());
  absl::StatusOr<StageResult> staged;
  {
    absl::MutexLock lock(&mu_);
    staged = state_->Stage(*std::move(part));
    Publish();
  }
  if (!staged.ok()) return Rejected(staged.status());
  v1::PushReply reply;
  if (!staged->complete) {
    reply.set_staged(true);
    reply.set_slices_received(staged->slices_received);
    reply.set_version(version());
    return reply;
  }
  absl::StatusOr<v1::PushReply> reported = ReportPart(header, identity, bytes);
  if (!reported.ok()) return Rejected(reported.status());
  metrics_.Observe(kPushLatency, absl::ToDoubleSeconds(absl::Now() - start));
  return reported;
}

absl::Status ShardServer::Admit(const v1::PushHeader& header, const std::string& identity,
                                const std::function<bool()>& cancelled) {
  ALOE_RETURN_IF_ERROR(CheckSlice(header.slice(), header.slices()));
  if (!v1::Codec_IsValid(header.codec())) {
    return absl::InvalidArgumentError(absl::StrFormat("unsupported codec %d", header.codec()));
  }
  // The coordinator admits at most max_staged_updates updates at once, the same on every shard
  // (admitting here alone, simultaneous pushes could fill each shard with updates another shard
  // never admits, and none would complete). Unread meanwhile: gRPC flow control holds the pusher.
  // The only shard process needs no such agreement: its local slot (TakeSlot) is the same bound,
  // and the round trip is saved (the coordinator admits the update when it is reported).
  if (options_.admit_locally) return absl::OkStatus();
  return AwaitAdmission(cancelled, header, identity);
}

absl::StatusOr<std::shared_ptr<FloatBufferPool>> ShardServer::TakeSlot(
    const v1::PushHeader& header, const std::function<bool()>& cancelled) {
  // A local slot as well: admissions the coordinator ended may still be staged here until their
  // COMMIT or DISCARD order arrives.
  absl::MutexLock lock(&mu_);
  const absl::Time deadline = absl::Now() + kSlotWait;
  // A retry of an update staged already needs no new slot.
  auto room = [&] {
    return state_->staged_count() + receiving_ < options_.max_staged ||
           (state_->staged_count() >= options_.max_staged &&
            state_->HasRoom(header.worker_id(), header.update_id()));
  };
  while (!room()) {
    if (cancelled() || changed_.WaitWithDeadline(&mu_, deadline)) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "shard %d: staging full (%d updates staged or being received) for %.0f s; push again "
          "later",
          options_.shard_index, options_.max_staged, absl::ToDoubleSeconds(kSlotWait)));
    }
  }
  ++receiving_;
  return state_->staging_buffers();
}

absl::StatusOr<v1::PushReply> ShardServer::ReportPart(const v1::PushHeader& header,
                                                      const std::string& identity, uint64_t bytes) {
  v1::StagedReport report;
  report.set_shard_index(options_.shard_index);
  *report.mutable_header() = header;
  report.set_bytes_received(bytes);
  report.set_identity(identity);
  grpc::ClientContext call;
  call.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  if (!options_.token.empty()) call.AddMetadata(kTokenMetadata, options_.token);
  v1::PushReply reply;
  const grpc::Status reported = control_->ReportStaged(&call, report, &reply);
  if (!reported.ok()) {
    // Refused (or the coordinator is unreachable): nothing of this update may stay here.
    absl::MutexLock lock(&mu_);
    state_->Discard(header.worker_id(), header.update_id());
    Publish();
    changed_.SignalAll();
    return AbslStatusOf(reported);
  }
  return reply;
}

absl::Status ShardServer::Restore(uint64_t version) {
  if (version == state_->version()) {
    // Same version: only the staged updates go (they belong to the previous assembly).
    return state_->Restore(state_->Capture(options_.fingerprint), options_.fingerprint);
  }
  if (version == 0) {
    absl::StatusOr<std::unique_ptr<ShardState>> initial = options_.make_initial();
    if (!initial.ok()) return initial.status();
    state_ = *std::move(initial);
    return absl::OkStatus();
  }
  if (options_.checkpoints == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrFormat("RESTORE of version %d, but this shard keeps no checkpoints", version));
  }
  absl::StatusOr<v1::ShardCheckpoint> c =
      CheckpointStore::ReadFile<v1::ShardCheckpoint>(options_.checkpoints->PathOf(version));
  if (c.ok()) return state_->Restore(*c, options_.fingerprint);
  unreadable_checkpoints_.insert(version);
  return c.status();
}

absl::Status ShardServer::Apply(const v1::ShardOrder& order) {
  std::optional<v1::ShardCheckpoint> due;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    if (order.kind() == v1::ShardOrder::RESTORE) {
      status = Restore(order.version());
      if (status.ok()) {
        fresh_ = false;
        ++restores_;
        ALOE_LOG_INFO("shard", "shard %d restored version %d", options_.shard_index,
                      order.version());
      }
    } else {
      status = ApplyLogOrder(order, &due);
    }
    Publish();
    changed_.SignalAll();
  }
  if (due) WriteCheckpoint(*std::move(due));  // outside the lock: pushes and pulls go on meanwhile
  return status;
}

absl::Status ShardServer::ApplyLogOrder(const v1::ShardOrder& order,
                                        std::optional<v1::ShardCheckpoint>* due) {
  const absl::Time start = absl::Now();
  const uint64_t steps = state_->layer_steps(), copied = state_->copied_layer_steps();
  const absl::Status status = state_->Apply(order);
  layer_steps_ += state_->layer_steps() - steps;
  const uint64_t copies = state_->copied_layer_steps() - copied;
  copied_layer_steps_ += copies;
  if (copies > 0) metrics_.Add(kLayerStepsCopied, static_cast<double>(copies));
  if (!status.ok() || order.kind() != v1::ShardOrder::COMMIT) return status;
  const uint64_t v = state_->version();
  metrics_.Observe(kApplyLatency, absl::ToDoubleSeconds(absl::Now() - start));
  if (!state_->last_penalty_reports().empty()) {
    ReportPenalty(state_->last_penalty_reports(), v, "shard", metrics_);
  }
  if (options_.checkpoints != nullptr && options_.every_versions > 0 &&
      v % options_.every_versions == 0) {
    *due = state_->Capture(options_.fingerprint);
  }
  return status;
}

absl::Status ShardServer::AwaitAdmission(const std::function<bool()>& cancelled,
                                         const v1::PushHeader& header,
                                         const std::string& identity) {
  v1::AdmitRequest request;
  request.set_shard_index(options_.shard_index);
  *request.mutable_header() = header;
  request.set_identity(identity);
  const absl::Time deadline = absl::Now() + kSlotWait;
  while (true) {
    grpc::ClientContext call;
    call.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    if (!options_.token.empty()) call.AddMetadata(kTokenMetadata, options_.token);
    v1::AdmitReply reply;
    const grpc::Status status = control_->Admit(&call, request, &reply);
    if (status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED || cancelled() ||
        absl::Now() >= deadline) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          status.error_message());
    }
  }
}

void ShardServer::WriteCheckpoint(v1::ShardCheckpoint checkpoint) {
  absl::StatusOr<std::string> path = options_.checkpoints->Write(checkpoint);
  if (path.ok()) {
    metrics_.Set(kCheckpointVersion, static_cast<double>(checkpoint.version()));
    if (options_.uploader != nullptr) options_.uploader->Upload(std::move(checkpoint));
  } else {
    ALOE_LOG_ERROR("shard", "checkpoint of version %d failed: %s", checkpoint.version(),
                   path.status().message());
  }
}

void ShardServer::WriteFinalCheckpoint() {
  if (options_.checkpoints == nullptr) return;
  std::optional<v1::ShardCheckpoint> last;
  {
    absl::MutexLock lock(&mu_);
    const std::vector<uint64_t> on_disk = options_.checkpoints->Versions();
    if (!fresh_ && std::find(on_disk.begin(), on_disk.end(), state_->version()) == on_disk.end()) {
      last = state_->Capture(options_.fingerprint);
    }
  }
  if (last) WriteCheckpoint(*std::move(last));
}

void ShardServer::Describe(v1::FollowRequest* request) {
  absl::MutexLock lock(&mu_);
  request->set_version(state_->version());
  request->set_fresh(fresh_);
  if (options_.checkpoints == nullptr) return;
  for (uint64_t v : options_.checkpoints->Versions()) {
    if (!unreadable_checkpoints_.count(v)) request->add_checkpoint_versions(v);
  }
}

void ShardServer::MarkFresh() {
  absl::MutexLock lock(&mu_);
  fresh_ = true;
}

namespace {

// A Follow call, started at the first Read or Finish so that Cancel may come before it.
class GrpcOrderStream final : public OrderStream {
 public:
  GrpcOrderStream(v1::ShardControl::Stub& stub, v1::FollowRequest request, const std::string& token)
      : stub_(stub), request_(std::move(request)) {
    if (!token.empty()) context_.AddMetadata(kTokenMetadata, token);
  }
  bool Read(v1::ShardOrder* order) override { return Started().Read(order); }
  void Cancel() override { context_.TryCancel(); }
  absl::Status Finish() override { return AbslStatusOf(Started().Finish()); }

 private:
  grpc::ClientReader<v1::ShardOrder>& Started() {
    if (reader_ == nullptr) reader_ = stub_.Follow(&context_, request_);
    return *reader_;
  }

  v1::ShardControl::Stub& stub_;
  const v1::FollowRequest request_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<v1::ShardOrder>> reader_;
};

}  // namespace

std::unique_ptr<OrderStream> GrpcFollowTransport::Open(const v1::FollowRequest& request) {
  return std::make_unique<GrpcOrderStream>(stub_, request, token_);
}

void InterruptibleWait::Wait(absl::Duration delay) {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithTimeout(absl::Condition(&interrupted_), delay);
}

void InterruptibleWait::Interrupt() {
  absl::MutexLock lock(&mu_);
  interrupted_ = true;
}

}  // namespace aloe::server
