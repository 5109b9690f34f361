#include "server/service/checkpoint_copies.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "server/service/auth.h"

namespace aloe::server {
namespace {

absl::Status FromGrpc(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

}  // namespace

bool ForEachCheckpointPiece(uint32_t shard_index, uint64_t version, const std::string& bytes,
                            const std::function<bool(const v1::CheckpointPiece&)>& write) {
  size_t at = 0;
  do {
    v1::CheckpointPiece piece;
    if (at == 0) {
      piece.set_shard_index(shard_index);
      piece.set_version(version);
      piece.set_total_bytes(bytes.size());
    }
    const size_t n = std::min(kCheckpointPieceBytes, bytes.size() - at);
    piece.set_data(bytes.substr(at, n));
    at += n;
    if (!write(piece)) return false;
  } while (at < bytes.size());
  return true;
}

absl::StatusOr<std::string> StoreCheckpointCopy(v1::ShardControl::StubInterface& coordinator,
                                                const std::string& token,
                                                const v1::ShardCheckpoint& checkpoint) {
  std::string bytes;
  if (!checkpoint.SerializeToString(&bytes)) {
    return absl::InternalError("the checkpoint does not serialise");
  }
  grpc::ClientContext context;
  if (!token.empty()) context.AddMetadata(kTokenMetadata, token);
  // A minute, plus the time at 10 MB/s (a coordinator that hangs must not hold the uploader).
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60) +
                       std::chrono::milliseconds(bytes.size() / 10000));
  v1::StoreCheckpointReply reply;
  std::unique_ptr<grpc::ClientWriterInterface<v1::CheckpointPiece>> writer =
      coordinator.StoreCheckpoint(&context, &reply);
  // A write fails when the coordinator ended the call: Finish says why.
  ForEachCheckpointPiece(checkpoint.shard_index(), checkpoint.version(), bytes,
                         [&](const v1::CheckpointPiece& piece) { return writer->Write(piece); });
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  if (!status.ok()) return FromGrpc(status);
  return reply.path();
}

absl::StatusOr<v1::ShardCheckpoint> FetchCheckpointCopy(
    v1::ShardControl::StubInterface& coordinator, const std::string& token, uint32_t shard_index) {
  grpc::ClientContext context;
  if (!token.empty()) context.AddMetadata(kTokenMetadata, token);
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(30));
  v1::FetchCheckpointRequest request;
  request.set_shard_index(shard_index);
  std::unique_ptr<grpc::ClientReaderInterface<v1::CheckpointPiece>> reader =
      coordinator.FetchCheckpoint(&context, request);
  std::string bytes;
  uint64_t total = 0;
  uint64_t version = 0;
  bool first = true;
  v1::CheckpointPiece piece;
  while (reader->Read(&piece)) {
    if (first) {
      total = piece.total_bytes();
      version = piece.version();
      bytes.reserve(total);
      first = false;
    }
    if (bytes.size() + piece.data().size() > total) {
      context.TryCancel();
      reader->Finish();
      return absl::DataLossError(
          absl::StrFormat("the coordinator's copy of shard %d's checkpoint runs past its %d bytes",
                          shard_index, total));
    }
    bytes += piece.data();
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) return FromGrpc(status);
  v1::ShardCheckpoint checkpoint;
  if (first || bytes.size() != total || !checkpoint.ParseFromString(bytes) ||
      checkpoint.shard_index() != shard_index || checkpoint.version() != version) {
    return absl::DataLossError(absl::StrFormat(
        "the coordinator's copy of shard %d's checkpoint is incomplete or not that shard's "
        "(%d of %d bytes)",
        shard_index, bytes.size(), total));
  }
  return checkpoint;
}

CheckpointUploader::CheckpointUploader(v1::ShardControl::StubInterface& coordinator,
                                       std::string token)
    : coordinator_(coordinator), token_(std::move(token)), thread_([this] { Loop(); }) {}

CheckpointUploader::~CheckpointUploader() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void CheckpointUploader::Upload(v1::ShardCheckpoint checkpoint) {
  absl::MutexLock lock(&mu_);
  waiting_ = std::move(checkpoint);
}

bool CheckpointUploader::Flush(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]()
                  ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !waiting_.has_value() && !sending_; };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

uint64_t CheckpointUploader::sent() {
  absl::MutexLock lock(&mu_);
  return sent_;
}

void CheckpointUploader::Loop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    auto work = [this]()
                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || waiting_.has_value(); };
    mu_.Await(absl::Condition(&work));
    if (stop_) return;
    v1::ShardCheckpoint checkpoint = *std::move(waiting_);
    waiting_.reset();
    sending_ = true;
    mu_.Unlock();
    absl::StatusOr<std::string> path = StoreCheckpointCopy(coordinator_, token_, checkpoint);
    if (path.ok()) {
      ALOE_LOG_INFO("shard", "shard %d: the coordinator keeps a copy of version %d (%s)",
                    checkpoint.shard_index(), checkpoint.version(), *path);
    } else {
      ALOE_LOG_WARNING("shard",
                       "shard %d: the coordinator took no copy of version %d: %s (the next "
                       "checkpoint is sent as usual)",
                       checkpoint.shard_index(), checkpoint.version(), path.status().message());
    }
    mu_.Lock();
    sending_ = false;
    if (path.ok()) ++sent_;
  }
}

}  // namespace aloe::server
