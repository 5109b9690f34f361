#include "server/service/shard_control.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/core/checkpoint_store.h"
#include "server/core/server_metrics.h"
#include "server/service/checkpoint_copies.h"
#include "server/service/grpc_services.h"

namespace aloe::server {
namespace {

OrderFeed::Options FeedOptions(const ShardControlService::Options& options) {
  OrderFeed::Options feed;
  feed.shard_processes = options.shard_processes;
  feed.fingerprint = options.fingerprint;
  return feed;
}

// A Follow stream's writer.
class GrpcOrderSink final : public OrderSink {
 public:
  GrpcOrderSink(grpc::ServerContext& context, grpc::ServerWriter<v1::ShardOrder>& writer)
      : context_(context), writer_(writer) {}
  bool Write(const v1::ShardOrder& order) override { return writer_.Write(order); }
  bool Cancelled() override { return context_.IsCancelled(); }

 private:
  grpc::ServerContext& context_;
  grpc::ServerWriter<v1::ShardOrder>& writer_;
};

// The bytes of one checkpoint copy, read piece by piece (the first says whose and how big);
// sets *first to the first piece. kInvalidArgument for no piece, a shard process out of range, a
// size out of bounds or pieces running past it.
absl::StatusOr<std::string> ReadCopyBytes(grpc::ServerReader<v1::CheckpointPiece>& reader,
                                          uint32_t processes, v1::CheckpointPiece* first) {
  v1::CheckpointPiece piece;
  if (!reader.Read(&piece)) return absl::InvalidArgumentError("no checkpoint was sent");
  const uint32_t shard = piece.shard_index();
  const uint64_t total = piece.total_bytes();
  if (shard >= processes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a checkpoint of shard %d, but this coordinator has %d shard processes", shard, processes));
  }
  // A shard process's checkpoint is its layers and their optimizer state: far below this.
  constexpr uint64_t kMaxBytes = uint64_t{1} << 40;
  if (total == 0 || total > kMaxBytes) {
    return absl::InvalidArgumentError(absl::StrFormat("a checkpoint of %d bytes", total));
  }
  *first = piece;
  first->clear_data();
  std::string bytes;
  do {
    if (bytes.size() + piece.data().size() > total) {
      return absl::InvalidArgumentError(
          absl::StrFormat("the pieces of shard %d's checkpoint run past the %d bytes its first "
                          "piece announced",
                          shard, total));
    }
    bytes += piece.data();
  } while (bytes.size() < total && reader.Read(&piece));
  return bytes;
}

// One checkpoint copy, whole and of one of `processes` shard processes of `fingerprint`:
// kInvalidArgument for one cut off, unparsable or other than its first piece says;
// kFailedPrecondition for another fingerprint or process count.
absl::StatusOr<v1::ShardCheckpoint> ReceiveCopy(grpc::ServerReader<v1::CheckpointPiece>& reader,
                                                uint32_t processes,
                                                const std::string& fingerprint) {
  v1::CheckpointPiece first;
  ALOE_ASSIGN_OR_RETURN(std::string bytes, ReadCopyBytes(reader, processes, &first));
  const uint32_t shard = first.shard_index();
  v1::ShardCheckpoint checkpoint;
  if (bytes.size() != first.total_bytes() || !checkpoint.ParseFromString(bytes)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("shard %d's checkpoint is cut off or does not parse (%d of %d bytes)",
                        shard, bytes.size(), first.total_bytes()));
  }
  if (checkpoint.shard_index() != shard || checkpoint.version() != first.version()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the first piece names shard %d version %d, the checkpoint is shard %d's version %d", shard,
        first.version(), checkpoint.shard_index(), checkpoint.version()));
  }
  if (checkpoint.fingerprint() != fingerprint || checkpoint.shard_processes() != processes) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "shard %d's checkpoint is of another model, optimizer or shard count (%s, "
        "%d processes) than the coordinator (%s, %d)",
        shard, checkpoint.fingerprint(), checkpoint.shard_processes(), fingerprint, processes));
  }
  return checkpoint;
}

}  // namespace

ShardControlService::ShardControlService(CoreHandle& handle, Authenticator& auth, Options options)
    : handle_(handle),
      auth_(auth),
      options_(std::move(options)),
      feed_(FeedOptions(options_), *this, waits_, clock_) {}

grpc::Status ShardControlService::CheckShardCaller(const grpc::ServerContext& context,
                                                   const char* rpc) const {
  absl::StatusOr<std::string> who = auth_.Identify(context);
  if (!who.ok()) return ToGrpcStatus(who.status());
  if (auth_.enabled() && *who != options_.shard_identity) {
    return grpc::Status(
        grpc::StatusCode::PERMISSION_DENIED,
        absl::StrFormat("ShardControl.%s is for the shard processes (token identity \"%s\", "
                        "security.shard_identity); this token is identity \"%s\"",
                        rpc, options_.shard_identity, *who));
  }
  return grpc::Status::OK;
}

grpc::Status ShardControlService::CheckPartCall(const grpc::ServerContext& context,
                                                uint64_t worker_id, const std::string& identity) {
  if (grpc::Status caller = CheckShardCaller(context, "Admit/ReportStaged"); !caller.ok()) {
    return caller;
  }
  if (absl::Status owner = auth_.CheckOwner(worker_id, identity); !owner.ok()) {
    return ToGrpcStatus(owner);
  }
  if (!feed_.ready()) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "the shard processes are (re)assembling; push again");
  }
  return grpc::Status::OK;
}

grpc::Status ShardControlService::Admit(grpc::ServerContext* context,
                                        const v1::AdmitRequest* request, v1::AdmitReply*) {
  if (grpc::Status ok = CheckPartCall(*context, request->header().worker_id(), request->identity());
      !ok.ok()) {
    return ok;
  }
  // A short wait per call: the shard asks again while its pusher waits, so no coordinator thread
  // is held long and a cancelled push stops asking.
  return ToGrpcStatus(handle_.AdmitPush(request->header(), absl::Seconds(2)));
}

grpc::Status ShardControlService::ReportStaged(grpc::ServerContext* context,
                                               const v1::StagedReport* request,
                                               v1::PushReply* reply) {
  if (grpc::Status ok = CheckPartCall(*context, request->header().worker_id(), request->identity());
      !ok.ok()) {
    return ok;
  }
  absl::StatusOr<v1::PushReply> result = handle_.Run([&](ServerCore& core) {
    return core.SubmitShardPart(request->shard_index(), request->header());
  });
  if (result.ok()) *reply = *std::move(result);
  return ToGrpcStatus(result.status());
}

uint64_t ShardControlService::version() {
  return handle_.Run([](ServerCore& core) { return core.version(); });
}

void ShardControlService::SetAddresses(const std::vector<ShardAddress>& addresses) {
  handle_.Run([&](ServerCore& core) {
    for (const ShardAddress& a : addresses)
      core.SetShardAddress(a.shard, a.address, a.push_address);
  });
}

void ShardControlService::Assembled(uint64_t version) {
  if (options_.journal != nullptr) options_.journal->Assembled(version);
}

std::optional<uint64_t> ShardControlService::OrderIndexAfter(uint64_t version) {
  return handle_.Run([&](ServerCore& core) { return core.shard_log()->OrderIndexAfter(version); });
}

std::vector<v1::ShardOrder> ShardControlService::OrdersFrom(uint64_t cursor) {
  std::vector<v1::ShardOrder> batch;
  uint64_t generation = 0;
  handle_.Peek(&generation, [&](const ServerCore& core) {
    const std::vector<v1::ShardOrder>& orders = core.shard_log()->orders();
    const uint64_t first = core.shard_log()->first_order_index();
    if (options_.journal != nullptr) options_.journal->CatchUp(orders, first);  // before sending
    if (cursor >= first + orders.size()) return;
    const std::vector<uint64_t> keep = core.RetainedVersions();
    for (; cursor < first + orders.size(); ++cursor) {
      batch.push_back(orders[cursor - first]);
      if (batch.back().kind() == v1::ShardOrder::COMMIT) {
        for (uint64_t v : keep) batch.back().add_keep_versions(v);
      }
    }
  });
  return batch;
}

void ShardControlService::TrimOrdersBefore(uint64_t index) {
  uint64_t first = 0;
  uint64_t generation = 0;
  handle_.Peek(&generation,
               [&](const ServerCore& core) { first = core.shard_log()->first_order_index(); });
  if (index >= first + ShardCommitLog::kOrderTrimBatch) {
    handle_.Run([&](ServerCore& core) { core.shard_log()->TrimOrdersBefore(index); });
  }
}

grpc::Status ShardControlService::Follow(grpc::ServerContext* context,
                                         const v1::FollowRequest* request,
                                         grpc::ServerWriter<v1::ShardOrder>* writer) {
  if (grpc::Status caller = CheckShardCaller(*context, "Follow"); !caller.ok()) return caller;
  GrpcOrderSink sink(*context, *writer);
  return ToGrpcStatus(feed_.Serve(*request, sink));
}

std::string ShardControlService::CopiesDir(uint32_t shard) const {
  return absl::StrFormat("%s/shard-%d", options_.replica_dir, shard);
}

bool ShardControlService::AwaitCopies(uint64_t version, absl::Duration timeout) {
  if (options_.replica_dir.empty()) return true;
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    bool all = true;
    {
      absl::MutexLock lock(&copies_mu_);
      for (uint32_t i = 0; i < options_.shard_processes && all; ++i) {
        const std::vector<uint64_t> versions =
            CheckpointStore(CopiesDir(i), options_.keep).Versions();
        all = std::find(versions.begin(), versions.end(), version) != versions.end();
      }
    }
    if (all) return true;
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(100));
  }
}

grpc::Status ShardControlService::StoreCheckpoint(grpc::ServerContext* context,
                                                  grpc::ServerReader<v1::CheckpointPiece>* reader,
                                                  v1::StoreCheckpointReply* reply) {
  if (grpc::Status caller = CheckShardCaller(*context, "StoreCheckpoint"); !caller.ok()) {
    return caller;
  }
  if (options_.replica_dir.empty()) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "this coordinator keeps no copies of shard checkpoints "
                        "(checkpoint.replicate_shards is off in its config)");
  }
  absl::StatusOr<v1::ShardCheckpoint> checkpoint =
      ReceiveCopy(*reader, options_.shard_processes, options_.fingerprint);
  if (!checkpoint.ok()) return ToGrpcStatus(checkpoint.status());
  const uint32_t shard = checkpoint->shard_index();
  absl::MutexLock lock(&copies_mu_);
  CheckpointStore store(CopiesDir(shard), options_.keep);
  absl::StatusOr<std::string> path = store.Write(*checkpoint);
  if (!path.ok()) return ToGrpcStatus(path.status());
  reply->set_path(*path);
  if (options_.metrics != nullptr) {
    const std::vector<uint64_t> kept = store.Versions();  // newest first
    options_.metrics->Set(kShardProcessCopyVersion, static_cast<double>(kept.front()),
                          {std::to_string(shard)});
  }
  return grpc::Status::OK;
}

grpc::Status ShardControlService::ReportApplied(grpc::ServerContext* context,
                                                const v1::AppliedReport* request, v1::AppliedAck*) {
  if (grpc::Status caller = CheckShardCaller(*context, "ReportApplied"); !caller.ok()) {
    return caller;
  }
  if (request->shard_index() >= options_.shard_processes) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrFormat("a report of shard %d, but this coordinator has %d shard "
                                        "processes",
                                        request->shard_index(), options_.shard_processes));
  }
  if (options_.metrics != nullptr) {
    options_.metrics->Set(kShardProcessAppliedVersion, static_cast<double>(request->version()),
                          {std::to_string(request->shard_index())});
  }
  return grpc::Status::OK;
}

grpc::Status ShardControlService::FetchCheckpoint(grpc::ServerContext* context,
                                                  const v1::FetchCheckpointRequest* request,
                                                  grpc::ServerWriter<v1::CheckpointPiece>* writer) {
  if (grpc::Status caller = CheckShardCaller(*context, "FetchCheckpoint"); !caller.ok()) {
    return caller;
  }
  const uint32_t shard = request->shard_index();
  if (shard >= options_.shard_processes) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrFormat("shard index %d, but this coordinator has %d shard "
                                        "processes",
                                        shard, options_.shard_processes));
  }
  if (options_.replica_dir.empty()) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        "this coordinator keeps no copies of shard checkpoints "
                        "(checkpoint.replicate_shards is off in its config)");
  }
  std::string bytes;
  std::string path;
  uint64_t version = 0;
  {
    absl::MutexLock lock(&copies_mu_);
    auto loaded =
        CheckpointStore(CopiesDir(shard), options_.keep).LoadLatest<v1::ShardCheckpoint>();
    if (!loaded.ok()) return ToGrpcStatus(loaded.status());
    loaded->checkpoint.SerializeToString(&bytes);
    path = loaded->path;
    version = loaded->checkpoint.version();
  }
  const bool sent = ForEachCheckpointPiece(
      shard, version, bytes,
      [&](const v1::CheckpointPiece& piece) { return writer->Write(piece); });
  if (!sent) return grpc::Status(grpc::StatusCode::CANCELLED, "the fetch was cancelled");
  ALOE_LOG_INFO("coordinator", "sent shard %d its checkpoint copy of version %d (%s)", shard,
                version, path);
  return grpc::Status::OK;
}

}  // namespace aloe::server
