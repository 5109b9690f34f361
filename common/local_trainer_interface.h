// The trainer interface of the straggler simulator (aloe-sim, server/sim/): the part of a
// worker's inner loop (paper 002 Alg. 1, inner part) that the simulator needs, with no LibTorch
// and no worker code behind it. DESIGN.md: server code never includes worker code; aloe-sim's
// main is the one place that wires in an implementation, either the cheap synthetic objective
// (server/sim/synthetic_trainer.h) or an adapter over worker::LocalTrainer (real gradients).
//
// A simulated round is:
//   SetParameters(theta_base) -> Train(request) -> PseudoGradient(theta_base, &g)
// with g = theta_base - theta_end (the DiLoCo sign, ALGORITHMS.md "Conventions"). Inner
// optimizer state (e.g. AdamW moments) belongs to the implementation and persists across rounds;
// SetParameters never resets it.
//
// Layers are the ModelSpec's layers (common/model_spec.h): one flat float32 buffer each, in spec
// order. Implementations are not required to be thread-safe: one caller at a time.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace aloe {

// One round of local work, taken from an aloe.v1.Task of kind TRAIN.
struct LocalTrainRequest {
  std::string shard_name;  // Task.shard_name: identifies the data shard
  std::string shard_file;  // Task.shard_file: relative to the corpus directory
  uint32_t steps = 0;      // exactly this many local steps (the caller resolved any time budget)
  uint64_t lr_step = 0;    // Task.lr_step: the shard's LR schedule position at the first step
  uint64_t seed = 0;       // Task.seed: data sampling / noise seed of this round
};

struct LocalTrainStats {
  uint32_t steps = 0;    // local steps taken (== request.steps on success)
  uint64_t tokens = 0;   // data points learned, as counted by the shard sampler
  double mean_loss = 0;  // mean training loss over the steps; 0 when steps == 0
};

class LocalTrainerInterface {
 public:
  virtual ~LocalTrainerInterface() = default;

  // Replaces the current parameters by `layers` (one buffer per spec layer). Inner optimizer
  // state is kept. kInvalidArgument on a wrong layer count or size (parameters then unchanged).
  virtual absl::Status SetParameters(const std::vector<std::vector<float>>& layers) = 0;

  // Runs request.steps local steps from the current parameters on the named shard.
  // Deterministic for (current parameters, inner state, request). kInvalidArgument for an
  // unknown shard or unusable data; kInternal for a failure of the implementation.
  virtual absl::StatusOr<LocalTrainStats> Train(const LocalTrainRequest& request) = 0;

  // out[l][i] = base[l][i] - current[l][i] (resizes `out`). kInvalidArgument when `base` does
  // not fit the spec.
  virtual absl::Status PseudoGradient(const std::vector<std::vector<float>>& base,
                                      std::vector<std::vector<float>>* out) const = 0;

  // Held-out loss of the current parameters (lower is better; for an LM the mean per-token
  // cross-entropy in nats). Deterministic; changes neither parameters nor inner state.
  virtual absl::StatusOr<double> Evaluate() = 0;
};

}  // namespace aloe
