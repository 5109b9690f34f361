// Converts checkpoints between the two process layouts of a server (ServerConfig.shard_processes):
//   - one process: an aloe.v1.ServerCheckpoint holding every layer's parameters and outer
//     optimizer state and the penalty statistics of every layer;
//   - a coordinator and N shard processes: the coordinator's ServerCheckpoint (membership, tasks,
//     data-shard schedule, evaluations; no layers) and one aloe.v1.ShardCheckpoint per shard
//     process with the layers ModelSpec assigns it (layers[l].shard), their optimizer state and
//     their penalty statistics, all at the coordinator's version.
// The layout a job runs with is fixed while it runs; converting its checkpoint is how a job moves
// from one process to N shard processes, or from N to M (tools/reshard.h, aloe-reshard).
//
// Every value is moved, none is recomputed: a joined and split checkpoint restores exactly the
// state that was saved. Fingerprints are the caller's (the target layout's differ from the
// source's); the outputs carry the coordinator's (Join) or the whole checkpoint's (Split, for the
// coordinator; "" for the shard processes). Pure: no I/O.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "proto/aloe.pb.h"

namespace aloe::server {

// One version of a layer-sharded server's checkpoints.
struct ShardedCheckpoint {
  v1::ServerCheckpoint coordinator;         // no layer parameters or optimizer states
  std::vector<v1::ShardCheckpoint> shards;  // shards[i]: shard process i's
};

// The one-process checkpoint of `in`. spec: the full model spec with its layers assigned to the
// spec.num_shards() shard processes the checkpoints were written by (AssignShards; layer ids 0,
// 1, ... in order). A shard process's checkpoint without penalty statistics contributes fresh
// (empty) statistics for its layers when another one has some; when none has, the result has
// none. kInvalidArgument, naming the shard process and layer, for: a count of shard checkpoints
// other than spec.num_shards(); checkpoint i saying it is another index or of another process
// count; one at another version than the coordinator; layer ids other than the layers spec
// assigns that shard process; parameter buffers that are not num_elements float32 values; a
// missing optimizer state; penalty statistics of another module count or malformed; a
// coordinator holding layers; layer group versions (partial synchronization) other than the
// coordinator's.
absl::StatusOr<v1::ServerCheckpoint> JoinShardCheckpoints(const v1::ModelSpec& spec,
                                                          const ShardedCheckpoint& in);

// The layout of spec.num_shards() shard processes of `whole` (a one-process checkpoint: one
// parameter buffer and optimizer state per spec layer). The coordinator's checkpoint is `whole`
// without its layers and penalty statistics; each shard process gets its layers in ascending id
// order.
// kInvalidArgument for a layer count other than the spec's, a parameter buffer of the wrong
// size, or penalty statistics that are malformed or not one module per layer.
absl::StatusOr<ShardedCheckpoint> SplitCheckpoint(const v1::ModelSpec& spec,
                                                  const v1::ServerCheckpoint& whole);

}  // namespace aloe::server
