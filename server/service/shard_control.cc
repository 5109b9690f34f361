#include "server/service/shard_control.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "server/core/checkpoint_store.h"
#include "server/core/server_metrics.h"
#include "server/core/shard_assembly.h"
#include "server/service/checkpoint_copies.h"
#include "server/service/grpc_services.h"

namespace aloe::server {

ShardControlService::ShardControlService(CoreHandle& handle, Authenticator& auth, Options options)
    : handle_(handle),
      auth_(auth),
      options_(std::move(options)),
      assembly_(options_.shard_processes) {}

uint32_t ShardControlService::Finish(uint64_t version, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  assembly_.Finish(version);
  const absl::Time deadline = absl::Now() + timeout;
  while (assembly_.finished_shards() < options_.shard_processes) {
    if (assembled_.WaitWithDeadline(&mu_, deadline)) break;
  }
  return assembly_.finished_shards();
}

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
  absl::MutexLock lock(&mu_);
  if (!assembly_.ready()) {
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

void ShardControlService::BeginAssembly() {
  assembly_.Begin();
  handle_.Run([&](ServerCore& core) {
    for (uint32_t i = 0; i < options_.shard_processes; ++i) core.SetShardAddress(i, "");
  });
  ALOE_LOG_INFO("coordinator", "assembling the %d shard processes (epoch %d)",
                options_.shard_processes, assembly_.current_epoch());
  assembled_.SignalAll();
}

void ShardControlService::MaybeCompleteAssembly() {
  const std::optional<std::vector<ShardStart>> starts = assembly_.Starts();
  if (!starts) return;
  std::vector<uint64_t> mine = options_.coordinator_versions();
  const uint64_t current = handle_.Run([](ServerCore& core) { return core.version(); });
  const uint64_t version = ChooseCommonVersion(mine, *starts);
  if (assembly_.NeedsRestore(version, current)) {
    absl::Status s = options_.restore(version);
    if (!s.ok()) {
      ALOE_LOG_ERROR("coordinator", "cannot restore version %d: %s; starting over", version,
                     s.message());
      BeginAssembly();
      return;
    }
  }
  assembly_.Complete(version);
  if (options_.journal != nullptr) options_.journal->Assembled(version);
  handle_.Run([&](ServerCore& core) {
    for (uint32_t i = 0; i < options_.shard_processes; ++i) {
      core.SetShardAddress(i, assembly_.request(i).address(), assembly_.request(i).push_address());
    }
  });
  ALOE_LOG_INFO("coordinator", "the %d shard processes are assembled at version %d",
                options_.shard_processes, version);
  assembled_.SignalAll();
}

void ShardControlService::TrimLog(uint64_t index) {
  uint64_t first = 0;
  uint64_t generation = 0;
  handle_.Peek(&generation,
               [&](const ServerCore& core) { first = core.shard_log()->first_order_index(); });
  // Only when the core will drop a batch (a Run wakes every stream).
  if (index >= first + ShardCommitLog::kOrderTrimBatch) {
    handle_.Run([&](ServerCore& core) { core.shard_log()->TrimOrdersBefore(index); });
  }
}

grpc::Status ShardControlService::Follow(grpc::ServerContext* context,
                                         const v1::FollowRequest* request,
                                         grpc::ServerWriter<v1::ShardOrder>* writer) {
  if (grpc::Status caller = CheckShardCaller(*context, "Follow"); !caller.ok()) return caller;
  const uint32_t shard = request->shard_index();
  if (shard >= options_.shard_processes) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrFormat("shard index %d, but this coordinator has %d shard "
                                        "processes (shard_processes)",
                                        shard, options_.shard_processes));
  }
  if (request->fingerprint() != options_.fingerprint) {
    return grpc::Status(
        grpc::StatusCode::FAILED_PRECONDITION,
        absl::StrFormat("shard process %d has another model, optimizer or shard count (%s) than "
                        "the coordinator (%s): start every process with the same config",
                        shard, request->fingerprint(), options_.fingerprint));
  }
  if (request->address().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the shard must say its address");
  }
  uint64_t connection = 0;
  uint64_t epoch = 0;
  uint64_t cursor = 0;  // absolute order index
  bool send_restore = false;
  uint64_t restore_version = 0;
  {
    absl::MutexLock lock(&mu_);
    connection = assembly_.Connect(shard, *request);
    std::optional<uint64_t> next;
    if (assembly_.MayFollowOn(shard)) {
      next = handle_.Run(
          [&](ServerCore& core) { return core.shard_log()->OrderIndexAfter(request->version()); });
    }
    if (next) {
      // Lost only its connection: follows on from its version.
      assembly_.FollowOn(shard, *next);
      cursor = *next;
      handle_.Run([&](ServerCore& core) {
        core.SetShardAddress(shard, request->address(), request->push_address());
      });
      ALOE_LOG_INFO("coordinator", "shard %d follows again from version %d", shard,
                    request->version());
    } else {
      if (assembly_.ready()) {
        ALOE_LOG_WARNING("coordinator",
                         "shard %d %s at version %d: its staged updates are lost, so every "
                         "process goes back to a common checkpoint",
                         shard, request->fresh() ? "restarted" : "fell out of the log",
                         request->version());
        BeginAssembly();
      }
      assembly_.Join(shard);
      MaybeCompleteAssembly();
      while (assembly_.StreamState(shard, connection) == ShardAssembly::Stream::kWaiting &&
             !context->IsCancelled()) {
        assembled_.WaitWithTimeout(&mu_, absl::Milliseconds(200));
      }
      if (assembly_.StreamState(shard, connection) != ShardAssembly::Stream::kFollowing) {
        return grpc::Status(grpc::StatusCode::ABORTED, "the shards are reassembling; follow again");
      }
      send_restore = true;
      restore_version = assembly_.start_version();
    }
    epoch = assembly_.epoch_of(shard);
  }
  if (send_restore) {
    v1::ShardOrder restore;
    restore.set_kind(v1::ShardOrder::RESTORE);
    restore.set_version(restore_version);
    if (!writer->Write(restore)) return grpc::Status(grpc::StatusCode::CANCELLED, "shard gone");
  }
  uint64_t seen = 0;
  while (!context->IsCancelled()) {
    std::vector<v1::ShardOrder> batch;
    std::optional<uint64_t> finish;
    {
      absl::MutexLock lock(&mu_);
      if (!assembly_.Current(shard, connection, epoch)) {
        return grpc::Status(grpc::StatusCode::ABORTED, "the shards are reassembling; follow again");
      }
      finish = assembly_.finish_version();
      handle_.Peek(&seen, [&](const ServerCore& core) {
        const std::vector<v1::ShardOrder>& orders = core.shard_log()->orders();
        const uint64_t first = core.shard_log()->first_order_index();
        if (options_.journal != nullptr)
          options_.journal->CatchUp(orders, first);  // before sending
        if (cursor >= first + orders.size()) return;
        const std::vector<uint64_t> keep = core.RetainedVersions();
        for (; cursor < first + orders.size(); ++cursor) {
          batch.push_back(orders[cursor - first]);
          if (batch.back().kind() == v1::ShardOrder::COMMIT) {
            for (uint64_t v : keep) batch.back().add_keep_versions(v);
          }
        }
      });
    }
    for (const v1::ShardOrder& order : batch) {
      if (!writer->Write(order)) return grpc::Status(grpc::StatusCode::CANCELLED, "shard gone");
    }
    if (!batch.empty()) {
      absl::MutexLock lock(&mu_);
      if (const std::optional<uint64_t> trim = assembly_.Sent(shard, connection, epoch, cursor)) {
        TrimLog(*trim);
      }
    }
    if (finish.has_value() && batch.empty()) {
      // Every order was sent (the log held none past the cursor when finish was read).
      v1::ShardOrder order;
      order.set_kind(v1::ShardOrder::FINISH);
      order.set_version(*finish);
      if (!writer->Write(order)) return grpc::Status(grpc::StatusCode::CANCELLED, "shard gone");
      absl::MutexLock lock(&mu_);
      assembly_.FinishSent(shard);
      assembled_.SignalAll();
      return grpc::Status::OK;
    }
    // Woken by a new order only; a reassembly or a newer connection of this shard is noticed
    // within the timeout.
    handle_.WaitForOrder(cursor, absl::Milliseconds(200));
  }
  return grpc::Status(grpc::StatusCode::CANCELLED, "shard gone");
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
  v1::CheckpointPiece piece;
  if (!reader->Read(&piece)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no checkpoint was sent");
  }
  const uint32_t shard = piece.shard_index();
  const uint64_t total = piece.total_bytes();
  const uint64_t version = piece.version();
  if (shard >= options_.shard_processes) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrFormat("a checkpoint of shard %d, but this coordinator has %d "
                                        "shard processes",
                                        shard, options_.shard_processes));
  }
  // A shard's checkpoint is its layers and their optimizer state: far below this.
  constexpr uint64_t kMaxBytes = uint64_t{1} << 40;
  if (total == 0 || total > kMaxBytes) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrFormat("a checkpoint of %d bytes", total));
  }
  std::string bytes;
  do {
    if (bytes.size() + piece.data().size() > total) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrFormat("the pieces of shard %d's checkpoint run past the %d "
                                          "bytes its first piece announced",
                                          shard, total));
    }
    bytes += piece.data();
  } while (bytes.size() < total && reader->Read(&piece));
  v1::ShardCheckpoint checkpoint;
  if (bytes.size() != total || !checkpoint.ParseFromString(bytes)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrFormat("shard %d's checkpoint is cut off or does not parse (%d of "
                                        "%d bytes)",
                                        shard, bytes.size(), total));
  }
  if (checkpoint.shard_index() != shard || checkpoint.version() != version) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrFormat("the first piece names shard %d version %d, the checkpoint is shard %d's "
                        "version %d",
                        shard, version, checkpoint.shard_index(), checkpoint.version()));
  }
  if (checkpoint.fingerprint() != options_.fingerprint ||
      checkpoint.shard_processes() != options_.shard_processes) {
    return grpc::Status(
        grpc::StatusCode::FAILED_PRECONDITION,
        absl::StrFormat("shard %d's checkpoint is of another model, optimizer or shard count (%s, "
                        "%d processes) than the coordinator (%s, %d)",
                        shard, checkpoint.fingerprint(), checkpoint.shard_processes(),
                        options_.fingerprint, options_.shard_processes));
  }
  absl::MutexLock lock(&copies_mu_);
  CheckpointStore store(CopiesDir(shard), options_.keep);
  absl::StatusOr<std::string> path = store.Write(checkpoint);
  if (!path.ok()) return ToGrpcStatus(path.status());
  reply->set_path(*path);
  if (options_.metrics != nullptr) {
    const std::vector<uint64_t> kept = store.Versions();  // newest first
    options_.metrics->Set(kShardProcessCopyVersion, static_cast<double>(kept.front()),
                          {std::to_string(shard)});
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
