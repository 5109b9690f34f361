// A single-process replay of a layer-sharded run: the initial model, then every COMMIT of the
// coordinator's order journal that stands (CommittedHistory), in order and with its weights,
// through one ParameterStore over the whole model, the updates' values taken from the shard
// processes' commit records (server/core/commit_record.h). Its result must equal, bit for bit,
// the parameters the shard processes ended with: the test that no update was half-applied,
// applied twice, lost or reordered on any shard, over restarts and restores. aloe-replay
// (tools/replay_main.cc) runs it on a soak's files. Without the EDiT penalty only (its
// per-layer weights are not in the journal).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/aloe.pb.h"
#include "server/core/commit_record.h"

namespace aloe::server {

struct ReplayInputs {
  // The whole model (every layer, any apply group or shard assignment) and its initial values.
  v1::ModelSpec spec;
  std::vector<std::vector<float>> initial;
  v1::OuterOptimizerConfig optimizer;
  std::vector<v1::ShardOrder> journal;
  // Every shard process's records (any order; an update recorded twice must agree).
  std::vector<RecordedUpdate> records;
  // What the shard processes ended with: every layer by id, and the version of each process.
  std::map<uint32_t, std::vector<float>> final_params;
  std::vector<uint64_t> final_versions;
};

struct ReplayReport {
  uint64_t first_version = 0;  // the first RESTORE's: where the standing commits start
  uint64_t version = 0;        // after the last standing commit
  uint64_t commits = 0;
  uint64_t updates = 0;
  uint64_t parameters = 0;
  uint64_t different = 0;       // parameters whose final value differs from the replay's
  double max_diff = 0;          // max |final - replay|
  double max_moved = 0;         // max |replay - initial|: the commits moved the model
  bool versions_match = false;  // every final version equals `version`
  std::string Summary() const;
};

// kDataLoss for a journal CommittedHistory refuses; kFailedPrecondition naming the update and
// layer when a committed update has no record of a layer, or two records of it disagree;
// kInvalidArgument when the first RESTORE is not of version 0 (the replay starts from the initial
// model), for final_params missing a layer or of the wrong size, or for a bad optimizer config.
absl::StatusOr<ReplayReport> ReplayCommits(const ReplayInputs& in);

}  // namespace aloe::server
