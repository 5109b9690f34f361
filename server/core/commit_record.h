// The record of the updates a shard process committed (aloe-server --role shard
// --record_commits FILE): for testing, so that a run of real processes can be replayed in one
// process from the coordinator's order journal (server/core/commit_replay.h, aloe-replay).
//
// Format: records appended one after the other, each
//   u32 magic "ALCR" | u64 worker_id | u64 update_id | u32 layers |
//   per layer: u32 global layer id | u64 count | count float32
// in the host's byte order (little-endian on every supported host). The values are the update as
// staged, before any discount: what the COMMIT's weights multiply. A process killed mid-write
// leaves its last record cut; the reader drops it. A restarted process appends to the same file.
#pragma once

#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/core/update.h"

namespace aloe::server {

class CommitRecorder {
 public:
  // Opens `path` for appending (creating it). kInvalidArgument naming the path when it cannot be
  // opened.
  static absl::StatusOr<std::unique_ptr<CommitRecorder>> Open(const std::string& path);

  // Appends one record per update; updates[i]->layers[j] is global layer owned[j]. Flushed before
  // it returns, so a killed process loses at most the record being written. The first write
  // error is logged and kept in status(); later calls write nothing. Thread-safe.
  void Record(const std::vector<uint32_t>& owned, const std::vector<const PendingUpdate*>& updates);
  absl::Status status() const;

 private:
  explicit CommitRecorder(std::string path) : path_(std::move(path)) {}

  const std::string path_;
  mutable absl::Mutex mu_;
  std::ofstream out_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// One recorded update: its layers by global layer id (a shard process's owned layers).
struct RecordedUpdate {
  uint64_t worker_id = 0;
  uint64_t update_id = 0;
  std::map<uint32_t, std::vector<float>> layers;
};

// The whole records of the file at `path`, in file order; *cut (when not null) says whether a cut
// last record was dropped. kNotFound for a missing file; kDataLoss naming the offset for a record
// that does not start with the magic (not a record file, or damaged in the middle).
absl::StatusOr<std::vector<RecordedUpdate>> ReadCommitRecords(const std::string& path,
                                                              bool* cut = nullptr);

}  // namespace aloe::server
