// Where the ServerCore's parameters live. The core runs the algorithm (membership, tasks,
// aggregation, staleness, scheduling, evaluation, the stop condition) the same way whatever the
// deployment; a backend holds the model and takes the outer steps the core decides:
//   - LocalParameters: the whole model in this process (ParameterStore), with the EDiT penalty;
//   - ShardCommitLog: a layer-sharded coordinator's order log; the shard processes hold the
//     parameters and apply each step's COMMIT order in log order, and an update counts as pushed
//     once every shard process staged its part.
//
// Not thread-safe: the core serialises calls.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/buffer_pool.h"
#include "common/clock.h"
#include "common/executor.h"
#include "common/imported_model.h"
#include "common/metrics.h"
#include "proto/aloe.pb.h"
#include "server/core/aggregation.h"
#include "server/core/parameter_store.h"
#include "server/core/pseudo_gradient_penalty.h"
#include "server/core/update.h"

namespace aloe::server {

class ParameterBackend {
 public:
  virtual ~ParameterBackend() = default;

  // The version of the last outer step (or of the restored checkpoint).
  virtual uint64_t version() const = 0;
  // The current version: its parameters where this process holds them, else its number only.
  virtual ModelSnapshot Snapshot() const = 0;
  // Layer groups (partial synchronization): how many, and the version of each (its own outer
  // steps). One group at version() where there are none.
  virtual uint32_t num_layer_groups() const { return 1; }
  virtual uint64_t group_version(uint32_t group) const { return version(); }

  // --- Where workers reach the parameters.
  // Part `part` of the parameters is served to workers at `address` ("" = gone) and takes raw
  // pushes at `push_address` ("" = none). LocalParameters has one part, served with the core's
  // own API (only its push address is told).
  virtual void SetAddress(uint32_t part, std::string address, std::string push_address) = 0;
  // Whether a worker may join now: kUnavailable while a part has no address; kResourceExhausted
  // when one more trainer (`role`, with `live_trainers` already) could never be served.
  virtual absl::Status CheckJoin(v1::Role role, size_t live_trainers) const = 0;
  // Tells a joining worker where to pull and push.
  virtual void DescribeTo(v1::JoinReply& reply) const = 0;

  // --- Updates.
  // Whether pushed updates should carry their layers' sums of squares (UpdateAssembler).
  virtual bool wants_layer_squares() const = 0;
  // Where pushes take their layer buffers (null when updates carry no layers here).
  virtual std::shared_ptr<FloatBufferPool> staging_buffers() const = 0;
  // kInvalidArgument when `update` does not fit the model (OK for an update without layers
  // where the parameters are elsewhere).
  virtual absl::Status CheckShapes(const PendingUpdate& update) const = 0;
  // One outer step of `batch` (weights already scaled by the core's staleness discount, carried
  // in PendingUpdate.weight_scale): version() advances by one, and so does the version of the
  // layer group the batch's updates carry (every group's for whole-model updates). Gives the
  // updates' layer buffers back to staging_buffers(). kInternal when the step fails (shapes were
  // checked on submission).
  virtual absl::Status ApplyOuterStep(ApplyBatch& batch) = 0;

  // --- Updates pushed in parts (a part per shard process; LocalParameters refuses these with
  // kFailedPrecondition). The core checks each header first.
  // Admits the update `header` names to be staged: true when admitted now or before, false while
  // max_staged_updates others are. Admitting a new update of a worker drops its older one that
  // did not reach every shard process.
  virtual absl::StatusOr<bool> Admit(const v1::PushHeader& header) = 0;
  // Part `part` of the update `header` names is staged. Returns how many parts are now, which is
  // PartsOf(header.group()) once the update is complete (the update then stays admitted until
  // its COMMIT or Discard). kInvalidArgument for a bad part (with layer groups: a shard process
  // that owns no layer of the header's group); kFailedPrecondition when not admitted;
  // kResourceExhausted when a lone shard process admits it itself (Admit's false).
  virtual absl::StatusOr<uint32_t> StagePart(uint32_t part, const v1::PushHeader& header) = 0;
  // How many parts an update of layer group `group` has (group 0 without layer groups): the
  // shard processes that own a layer of it.
  virtual uint32_t PartsOf(uint32_t group) const = 0;
  // The update of `worker` with `update_id` will never be applied: its staged parts are dropped.
  virtual void Discard(uint64_t worker, uint64_t update_id) = 0;

  // --- Workers.
  // `worker` is leaving: what it did not stage everywhere is dropped (before its open round
  // closes without it).
  virtual void DropUnsubmitted(uint64_t worker) = 0;
  // `worker` is gone for good: statistics kept per worker (the penalty's) are dropped.
  virtual void ForgetWorker(uint64_t worker) = 0;
  // The EDiT penalty when this backend applies it; null otherwise.
  virtual const PseudoGradientPenalty* penalty() const { return nullptr; }

  // --- Checkpoints.
  // Adds the parameters and optimizer states held here (and the penalty's state) to `checkpoint`.
  virtual void SaveTo(v1::ServerCheckpoint& checkpoint) const = 0;
  // Restores what SaveTo wrote, at checkpoint.version(). All or nothing: kInvalidArgument or
  // kFailedPrecondition naming the problem, state unchanged.
  virtual absl::Status RestoreFrom(const v1::ServerCheckpoint& checkpoint) = 0;
  // Whether every checkpoint that falls due is kept for writing (small ones), or only the newest
  // (each holds the whole model, and a slow disk must not queue them up).
  virtual bool keeps_every_checkpoint() const = 0;
};

class ShardCommitLog;

// The model and the parameter backend of `config`'s deployment: the whole model in this process
// (LocalParameters) for shard_processes 0, else a coordinator's ShardCommitLog that builds no
// layer. `model` has the spec, fingerprint and vocabulary (its initial parameters moved into the
// backend); `shard_log` is the backend when it is a ShardCommitLog, else null. executor, clock
// and metrics must outlive the backend. The model's and the backend's errors.
struct DeployedParameters {
  std::unique_ptr<ParameterBackend> backend;
  ShardCommitLog* shard_log = nullptr;
  ServerModel model;
};
absl::StatusOr<DeployedParameters> CreateParameterBackend(const v1::ServerConfig& config,
                                                          Executor& executor, const Clock& clock,
                                                          MetricsSink& metrics);

}  // namespace aloe::server
