// The one trainer interface: the inner loop of a DiLoCo worker (paper 002 Alg. 1, inner part) as
// the worker agent (worker/agent.h) and the straggler simulator (sim/simulator.h) drive it. Its
// implementations: worker::LocalTrainer (LibTorch, one process), worker::FsdpTrainer (one rank
// of a multi-rank node) and sim::SyntheticTrainer (a cheap objective without LibTorch). This
// header includes neither LibTorch nor worker code, so the simulator stays free of both.
//
// A round is:
//   SetParameters(theta_base) -> Train(request) -> PseudoGradient(theta_base, &g)
// with g = theta_base - theta_end (the DiLoCo sign, docs/algorithms.md). Inner optimizer state
// (e.g. AdamW moments) belongs to the implementation and persists across rounds; SetParameters
// never resets it.
//
// Layers are the ModelSpec's layers (common/model_spec.h): one flat float32 buffer each, in spec
// order. A trainer that holds a slice of every layer (a rank of a multi-rank node) takes and
// gives its slices instead. Implementations are not thread-safe: one caller at a time.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/token_source.h"

namespace aloe {

// One round of local work, taken from an aloe.v1.Task of kind TRAIN.
struct TrainRequest {
  // The data shard's tokens (Task.shard_file), borrowed for the call. Null only for a trainer
  // that draws no tokens (the synthetic one, which goes by shard_name).
  const TokenSource* data = nullptr;
  std::string shard_name;  // Task.shard_name: identifies the data shard
  uint32_t steps = 0;      // local steps, or the cap when a budget or interrupt ends the round
  uint64_t lr_step = 0;    // Task.lr_step: the shard's LR schedule position at the first step
  uint64_t seed = 0;       // Task.seed: data sampling / noise seed of this round
  // >= 1: emulates slower hardware by sleeping (slowdown - 1) x each step's compute time after
  // it. Only the single-process trainer takes a value other than 1.
  double slowdown = 1.0;
  // > 0 (A-EDiT, paper 000 Sec. 3.3): the round ends at the first step end at or after this
  // much wall time; `steps` is then the cap.
  double time_budget_seconds = 0;
  // May be null. Ends the round at the first step end after it becomes true, so a stopping
  // worker can push the steps it has done; no step is taken when it is already true.
  const std::atomic<bool>* interrupt = nullptr;
};

struct TrainStats {
  uint32_t steps = 0;          // local steps taken
  uint64_t tokens = 0;         // data points learned, as counted by the shard sampler
  double mean_loss = 0;        // mean training loss over the steps; 0 when steps == 0
  double compute_seconds = 0;  // wall time of the steps, excluding slowdown sleeps
};

// An evaluation of the current parameters on held-out data.
// The inner optimizer's state (AdamW) of a trainer: what a restarted worker needs to go on as if
// it had not stopped. Per spec layer, this trainer's elements of the layer (all of them for one
// process, its owned slice for a rank of a multi-rank node), in the order of its parameters.
struct InnerState {
  uint64_t steps = 0;                      // AdamW steps taken (for the bias corrections)
  std::vector<std::vector<float>> first;   // exp_avg (m)
  std::vector<std::vector<float>> second;  // exp_avg_sq (v)
};

struct EvalRequest {
  // The held-out tokens, borrowed for the call; null only for a trainer that needs none.
  const TokenSource* heldout = nullptr;
  uint32_t max_sequences = 0;  // evaluate at most this many windows of seq_len + 1 tokens
};

// The boundary between two overlapped rounds (worker/agent_overlap.cc), kept where the trainer
// keeps its parameters. Between rounds the trainer's device would otherwise wait while the host
// takes the pseudo-gradient and writes the next start: with a device of its own (a GPU) the
// trainer keeps the round's base and the pseudo-gradient there, and moves them to and from the
// host beside training. A round is:
//   StageStart(theta_next) [any thread, while the previous round trains]
//   -> StartStaged(s): theta = theta_next + s * g_prev  (g_prev: the last EndRound's)
//   -> Train -> EndRound(): g = theta_start - theta_end
//   -> TakePseudoGradient(&g) [any thread, while the next round trains]
// StageStart and TakePseudoGradient are the only calls that may run on another thread while
// the trainer trains, one of each at a time. The caller orders them with the rounds: a
// StageStart returns before the StartStaged that consumes it, and a TakePseudoGradient returns
// before the next EndRound (which overwrites the pseudo-gradient). Inner optimizer state is
// never touched.
class RoundBoundary {
 public:
  virtual ~RoundBoundary() = default;

  // Takes `layers` (TrainerInterface layers) as the next round's start. kInvalidArgument when
  // they do not fit the parameters (the staged start, if any, is then unchanged).
  virtual absl::Status StageStart(std::vector<std::vector<float>> layers) = 0;

  // Makes the staged start plus `delta_scale` times the last EndRound's pseudo-gradient the
  // parameters, and that start the base of the next EndRound (eager overlap applies the last
  // round's pseudo-gradient locally at once with delta_scale = -outer lr; 0 = the staged start
  // as it is). Consumes the staged start. kFailedPrecondition when nothing is staged, or when
  // delta_scale != 0 and there is no pseudo-gradient (none yet, or taken already); nothing
  // changes then.
  virtual absl::Status StartStaged(float delta_scale) = 0;

  // Ends the round begun by StartStaged: g = base - current parameters, kept for
  // TakePseudoGradient and the next StartStaged. kFailedPrecondition without a started round.
  virtual absl::Status EndRound() = 0;

  // Moves the last EndRound's pseudo-gradient into *out (one buffer per layer, resized),
  // waiting for it to reach the host. kFailedPrecondition when there is none (none yet, or
  // taken already).
  virtual absl::Status TakePseudoGradient(std::vector<std::vector<float>>* out) = 0;
};

class TrainerInterface {
 public:
  virtual ~TrainerInterface() = default;

  // Replaces the current parameters by `layers`. Inner optimizer state is kept.
  // kInvalidArgument on a wrong layer count or size (parameters then unchanged).
  virtual absl::Status SetParameters(const std::vector<std::vector<float>>& layers) = 0;

  // Runs up to request.steps local steps from the current parameters. Deterministic for
  // (current parameters, inner state, request) without a budget or interrupt.
  // kInvalidArgument for unusable data or request fields; kInternal for a failure of the
  // implementation.
  virtual absl::StatusOr<TrainStats> Train(const TrainRequest& request) = 0;

  // out[l][i] = base[l][i] - current[l][i] (resizes `out`). kInvalidArgument when `base` does
  // not fit the parameters.
  virtual absl::Status PseudoGradient(const std::vector<std::vector<float>>& base,
                                      std::vector<std::vector<float>>* out) const = 0;

  // Layer-wise access (partial synchronization moves one layer group at a time). `layers` has
  // one entry per spec layer; GetLayers writes the current values of the layers `ids` into
  // their entries (resized) and leaves the others as they are; SetLayers replaces the layers
  // `ids` by their entries (the others and the inner optimizer state are kept). kInvalidArgument
  // for an id or size that does not fit (nothing changed). The defaults answer kUnimplemented:
  // the caller then goes through the whole model (PseudoGradient, SetParameters).
  virtual absl::Status GetLayers(absl::Span<const uint32_t> ids,
                                 std::vector<std::vector<float>>* layers) const {
    return absl::UnimplementedError("this trainer has no layer-wise access");
  }
  virtual absl::Status SetLayers(absl::Span<const uint32_t> ids,
                                 const std::vector<std::vector<float>>& layers) {
    return absl::UnimplementedError("this trainer has no layer-wise access");
  }

  // The inner optimizer state, and its restore. RestoreInnerState takes a state of the same
  // shape (kInvalidArgument naming the first layer that differs; nothing changed) and makes the
  // next Train continue as the trainer that saved it would. The defaults answer kUnimplemented:
  // the caller then starts from a fresh state.
  virtual absl::StatusOr<InnerState> SaveInnerState() const {
    return absl::UnimplementedError("this trainer cannot save its inner optimizer state");
  }
  virtual absl::Status RestoreInnerState(const InnerState& state) {
    return absl::UnimplementedError("this trainer cannot restore an inner optimizer state");
  }

  // Held-out loss of the current parameters (lower is better; for an LM the mean per-token
  // cross-entropy in nats). Deterministic; changes neither parameters nor inner state.
  // kInvalidArgument when the request cannot be evaluated; kFailedPrecondition for a trainer
  // that does not evaluate.
  virtual absl::StatusOr<double> Evaluate(const EvalRequest& request) = 0;

  // The trainer's own round boundary on its device (RoundBoundary), owned by the trainer; null
  // (the default) when it has none: the caller then goes through SetParameters and
  // PseudoGradient on the host (worker/round_boundary.h HostRoundBoundary).
  virtual RoundBoundary* device_round_boundary() { return nullptr; }
};

}  // namespace aloe
