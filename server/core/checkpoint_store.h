// Checkpoint files in a directory: checkpoint-<version>.aloeckpt, written atomically (temp file,
// fsync, rename, fsync of the directory), with a checksum, keeping the newest K.
//
// File layout (little-endian): magic "ALOECKPT" (8 bytes) | u32 format (1) | u32 reserved (0) |
// u64 payload length | u32 CRC-32C of the payload | payload (a serialised aloe.v1.ServerCheckpoint).
//
// LoadLatest walks the files newest first and returns the first one that is whole; a corrupt or
// truncated file is skipped with a log line naming it and the reason. Not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/aloe.pb.h"

namespace aloe::server {

// CRC-32C (Castagnoli) of data.
uint32_t Crc32c(std::string_view data);

class CheckpointStore {
 public:
  CheckpointStore(std::string dir, uint32_t keep) : dir_(std::move(dir)), keep_(keep) {}

  // Writes the checkpoint and deletes all but the newest `keep`. Returns the file path.
  // kUnavailable when the directory cannot be created or written.
  absl::StatusOr<std::string> Write(const v1::ServerCheckpoint& checkpoint);

  struct Loaded {
    v1::ServerCheckpoint checkpoint;
    std::string path;
    std::vector<std::string> skipped;  // corrupt newer files, with the reason
  };
  // The newest whole checkpoint. kNotFound when the directory has none; kDataLoss when every
  // file is corrupt.
  absl::StatusOr<Loaded> LoadLatest() const;

  // Checkpoint files, newest (highest version) first.
  std::vector<std::string> List() const;

  // Reads and verifies one file.
  static absl::StatusOr<v1::ServerCheckpoint> ReadFile(const std::string& path);

 private:
  std::string dir_;
  uint32_t keep_;
};

}  // namespace aloe::server
