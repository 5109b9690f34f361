// The checkpoint converter of aloe-reshard (tools/reshard_main.cc): moves a job's checkpoint to
// another process layout.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "proto/aloe.pb.h"
#include "server/core/shard_sampler.h"

namespace aloe::server {

// Reads the newest version in `from_dir` that is whole in every process's checkpoints (a
// one-process server's, or a coordinator's with the shard-<i> directories of its N shard
// processes beside them, or else its own copies of them in replicas/shard-<i>), converts it
// (server/core/checkpoint_layout.h) to the layout of `config` (config.shard_processes: 0 for one
// process) and writes it to config.checkpoint.dir (and its shard-<i> directories), from where the
// server resumes (aloe-server --resume).
//
// The source must be of config's model, outer optimizer, penalty and corpus with any number of
// processes: each file's fingerprint is compared with the one a server of that many processes
// would write. Every converted checkpoint is restored into the objects a server builds
// (ServerCore, ShardState) before anything is written. Nothing is written, or everything
// written removed, on error:
//   kInvalidArgument: no checkpoint.dir; config.checkpoint.dir is from_dir, or is not empty;
//     from_dir has shard-<i> directories with gaps, or a coordinator's checkpoints without them;
//   kNotFound: from_dir has no checkpoint;
//   kFailedPrecondition: a checkpoint of another model/optimizer/corpus, or no version that the
//     coordinator and every shard process checkpointed;
//   kDataLoss: every candidate version has a corrupt file;
//   the restore's errors; kUnavailable when writing fails.
absl::Status Reshard(const v1::ServerConfig& config, const std::string& from_dir,
                     const std::vector<DataShard>& train, const std::string& heldout_file);

}  // namespace aloe::server
