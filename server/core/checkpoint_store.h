// Checkpoint files in a directory: checkpoint-<version>.aloeckpt, written atomically (temp file,
// fsync, rename, fsync of the directory), with a checksum, keeping the newest K.
//
// File layout (little-endian): magic "ALOECKPT" (8 bytes) | u32 format (1) | u32 reserved (0) |
// u64 payload length | u32 CRC-32C of the payload | payload (a serialised aloe.v1.ServerCheckpoint,
// or aloe.v1.ShardCheckpoint in a shard process's directory).
//
// LoadLatest walks the files newest first and returns the first one that is whole; a corrupt or
// truncated file is skipped with a log line naming it and the reason. Not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/durable_file.h"
#include "proto/aloe.pb.h"

namespace aloe::server {

class CheckpointStore {
 public:
  CheckpointStore(std::string dir, uint32_t keep) : dir_(std::move(dir)), keep_(keep) {}

  // Writes the checkpoint and deletes all but the newest `keep`. Returns the file path.
  // kUnavailable when the directory cannot be created or written. One store holds one kind: the
  // server's checkpoints, or one shard process's (aloe.v1.ShardCheckpoint).
  absl::StatusOr<std::string> Write(const v1::ServerCheckpoint& checkpoint);
  absl::StatusOr<std::string> Write(const v1::ShardCheckpoint& checkpoint);

  template <typename Checkpoint>
  struct LoadedOf {
    Checkpoint checkpoint;
    std::string path;
    std::vector<std::string> skipped;  // corrupt newer files, with the reason
  };
  using Loaded = LoadedOf<v1::ServerCheckpoint>;

  // The newest whole checkpoint. kNotFound when the directory has none; kDataLoss when every
  // file is corrupt.
  template <typename Checkpoint = v1::ServerCheckpoint>
  absl::StatusOr<LoadedOf<Checkpoint>> LoadLatest() const {
    LoadedOf<Checkpoint> loaded;
    absl::StatusOr<std::string> path = LoadLatestMessage(&loaded.checkpoint, &loaded.skipped);
    if (!path.ok()) return path.status();
    loaded.path = *std::move(path);
    return loaded;
  }

  // Checkpoint files, newest (highest version) first.
  std::vector<std::string> List() const;
  // The versions of List(), newest first.
  std::vector<uint64_t> Versions() const;
  // Where the checkpoint of `version` is (or would be) written.
  std::string PathOf(uint64_t version) const;

  // Reads and verifies one file.
  template <typename Checkpoint = v1::ServerCheckpoint>
  static absl::StatusOr<Checkpoint> ReadFile(const std::string& path) {
    Checkpoint checkpoint;
    absl::Status s = ReadMessage(path, &checkpoint);
    if (!s.ok()) return s;
    return checkpoint;
  }

 private:
  absl::StatusOr<std::string> WriteMessage(uint64_t version,
                                           const google::protobuf::MessageLite& checkpoint);
  static absl::Status ReadMessage(const std::string& path,
                                  google::protobuf::MessageLite* checkpoint);
  absl::StatusOr<std::string> LoadLatestMessage(google::protobuf::MessageLite* checkpoint,
                                                std::vector<std::string>* skipped) const;

  std::string dir_;
  uint32_t keep_;
};

}  // namespace aloe::server
