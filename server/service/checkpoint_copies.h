// Copies of the shard processes' checkpoints kept by the coordinator of a layer-sharded server
// (checkpoint.replicate_shards), so that a shard whose host is lost for good starts again
// elsewhere from the newest copy instead of stopping the job. The shard's side: it hands every
// checkpoint it writes to a CheckpointUploader, and at start, finding none of its own, fetches
// the newest copy (FetchCheckpointCopy). The coordinator's side is ShardControlService's
// StoreCheckpoint and FetchCheckpoint; the wire format is aloe.v1.CheckpointPiece.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/aloe.grpc.pb.h"

namespace aloe::server {

// The largest piece of a checkpoint on the wire (the servers take messages up to 2 MiB).
inline constexpr size_t kCheckpointPieceBytes = 1 << 20;

// Cuts `bytes` (a serialised ShardCheckpoint of `shard_index` at `version`) into pieces of at
// most kCheckpointPieceBytes, the first saying whose and how big, and hands each to `write` until
// it returns false; returns whether every piece was written.
bool ForEachCheckpointPiece(uint32_t shard_index, uint64_t version, const std::string& bytes,
                            const std::function<bool(const v1::CheckpointPiece&)>& write);

// Sends one checkpoint to the coordinator (ShardControl.StoreCheckpoint) with `token`; returns
// where the coordinator wrote its copy, or the call's error.
absl::StatusOr<std::string> StoreCheckpointCopy(v1::ShardControl::StubInterface& coordinator,
                                                const std::string& token,
                                                const v1::ShardCheckpoint& checkpoint);

// The newest copy of shard `shard_index`'s checkpoints at the coordinator. kNotFound when it
// keeps none; kDataLoss when the pieces do not add up to a checkpoint of that shard; the call's
// error otherwise.
absl::StatusOr<v1::ShardCheckpoint> FetchCheckpointCopy(
    v1::ShardControl::StubInterface& coordinator, const std::string& token, uint32_t shard_index);

// Sends checkpoints to the coordinator on a thread of its own, newest first: one handed over
// while another is being sent replaces any still waiting (only the newest copy matters). A
// failed send is logged and dropped (the next checkpoint is sent as usual). Thread-safe.
class CheckpointUploader {
 public:
  // `coordinator` must outlive the uploader.
  CheckpointUploader(v1::ShardControl::StubInterface& coordinator, std::string token);
  // Stops; a checkpoint still waiting is not sent (Flush first to send it).
  ~CheckpointUploader();
  CheckpointUploader(const CheckpointUploader&) = delete;
  CheckpointUploader& operator=(const CheckpointUploader&) = delete;

  void Upload(v1::ShardCheckpoint checkpoint) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until nothing waits or is being sent, up to `timeout`; false on timeout.
  bool Flush(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);
  // Copies the coordinator confirmed so far.
  uint64_t sent() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop();

  v1::ShardControl::StubInterface& coordinator_;
  const std::string token_;
  absl::Mutex mu_;
  std::optional<v1::ShardCheckpoint> waiting_ ABSL_GUARDED_BY(mu_);
  bool sending_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t sent_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace aloe::server
