// A pseudo-gradient pushed by a worker, fully received and decoded (server/core/update_assembler.h)
// but not yet applied.
#pragma once

#include <cstdint>
#include <vector>

#include "proto/aloe.pb.h"

namespace aloe::server {

struct PendingUpdate {
  uint64_t worker_id = 0;
  uint64_t task_id = 0;
  uint64_t update_id = 0;
  // The version the pseudo-gradient was taken against: the model's, or for a group push the
  // layer group's.
  uint64_t base_version = 0;
  // Partial synchronization: the update carries only this layer group's layers (the others
  // are empty) when by_group; task_continues: more pushes of the task follow (PushHeader).
  bool by_group = false;
  uint32_t group = 0;
  bool task_continues = false;
  uint32_t steps_done = 0;
  uint64_t tokens_learned = 0;
  double train_loss = 0;
  double compute_seconds = 0;
  // A sliced push (PushHeader.slices > 1) carries slice `slice` of every layer; the others
  // elements of `layers` are 0 until the slices are merged.
  uint32_t slice = 0;
  uint32_t slices = 1;
  // The staleness discount applied to this update. A single-process server scales `layers` by
  // it on arrival; the coordinator of a layer-sharded server (whose updates carry no data) folds
  // it into the update's commit weight instead.
  float weight_scale = 1.0f;
  // PushHeader.want_next_task: the reply that completes the update carries the worker's next
  // task (ServerCore::SubmitUpdate).
  bool want_next_task = false;
  // Payload bytes of this push as received (for the status page; 0 = not counted).
  uint64_t received_bytes = 0;
  // PushHeader.observed_ranks: the effective rank of each low-rank tensor in this push.
  std::vector<v1::TensorRank> observed_ranks;
  // g = theta_base - theta_end, one flat float32 buffer per layer of the ModelSpec.
  std::vector<std::vector<float>> layers;
  // sum_i g[i]^2 per layer (of the elements received: a slice's, until merged), measured while
  // the pushed values were still in cache (UpdateAssembler with sum_squares), scaled with
  // weight_scale; empty = not measured. Only for the norm metric: it adds in another order than
  // kernels::SquaredL2Norm over the whole layer would, so it agrees with that to rounding.
  std::vector<double> layer_squares;
};

}  // namespace aloe::server
