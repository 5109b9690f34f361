// Intra-node fully sharded data parallelism (FSDP, ZeRO-3 style) for the inner loop: the N ranks
// of one node (processes or threads) train one model replica together, over Gloo on the CPU or
// over NCCL with one GPU per rank (ConnectNodeGroups; NCCL needs a CUDA LibTorch). Every spec
// layer's flat float32 buffer is cut into N equal slices (the last padded), and rank r owns slice r
// of every layer:
//
//   state          held by each rank                       without FSDP (LocalTrainer)
//   parameters     its slice, between steps (1/N)          the whole model, always
//   AdamW m, v     its slice (1/N), never gathered         the whole model
//   gradients      its slice after the step (1/N)          the whole model
//   during a step  the whole model's parameters and gradients (gathered, then released)
//
// One step on rank r: all-gather every layer's parameters into the module; forward and backward
// on rows [r*B/N, (r+1)*B/N) of the node's batch of B sequences (every rank draws the same B
// windows from the task seed, so the node's batch does not depend on N); reduce-scatter the
// gradients (sum / N = the gradient of the mean loss over the node's batch); clip by the global
// gradient norm (all-reduced); AdamW on the owned slice; release the gathered parameters and
// gradients. So N ranks compute the same steps as one rank with the whole batch, up to float
// summation order (tests/unit/worker/fsdp_test.cc). AdamW is implemented on the flat slices and
// follows LibTorch's AdamW step for step (decoupled decay on matrices only).
//
// The pseudo-gradient of a round is per slice too (PseudoGradientShards), so no rank ever holds a
// full pseudo-gradient.
//
// Every buffer above lives on the training device (worker/trainer.h SetTrainerDevice): on a GPU
// rank its slices, AdamW moments, the gathered layers and the gradients are GPU memory, and only
// pulled slices and pseudo-gradient slices pass through host memory.
//
// LibTorch stays out of this header (pimpl). Not thread-safe: one caller per rank.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/token_source.h"
#include "proto/aloe.pb.h"
#include "worker/trainer.h"

namespace at {
class Tensor;
}  // namespace at

namespace aloe::worker {

// The collectives a sharded trainer needs over the ranks of one node. Every rank must make the
// same calls in the same order with the same sizes. Errors are kInternal (a rank died, a
// transport failed); after one the group is unusable.
class Collectives {
 public:
  virtual ~Collectives() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // full[r * n + i] = shard[i] of rank r; `full` holds size() * n floats.
  virtual absl::Status AllGather(const float* shard, size_t n, float* full) = 0;
  // shard[i] = sum over ranks r of rank r's full[rank() * n + i]; `full` holds size() * n floats.
  virtual absl::Status ReduceScatterSum(const float* full, size_t n, float* shard) = 0;
  // The two above on flat contiguous float32 tensors of the training device (`shard`: n
  // elements; `full`: size() * n). The defaults take host tensors and call the pointer forms; a
  // GPU group overrides them to stay on the device.
  virtual absl::Status AllGatherTensor(const at::Tensor& shard, const at::Tensor& full);
  virtual absl::Status ReduceScatterSumTensor(const at::Tensor& full, const at::Tensor& shard);
  // The sum over ranks of `value`.
  virtual absl::StatusOr<double> AllReduceSum(double value) = 0;
  // values[i] = the sum over ranks of their values[i], the same bits on every rank (host memory;
  // a GPU group copies through the device). The low-rank factors of a node's push
  // (common/low_rank_fsdp.h).
  virtual absl::Status AllReduceSumFloats(float* values, size_t n) = 0;
  // Every rank's *bytes becomes rank `root`'s (a serialised message: the node's task).
  virtual absl::Status Broadcast(std::string* bytes, int root) = 0;
};

// Connects rank `rank` of `size` to a Gloo process group (CPU, loopback TCP) that meets through
// a c10d FileStore at `store_path` (a path every rank can reach: the ranks of one node share it;
// the file must not exist before the group forms and is left behind for the caller to remove).
// Blocks until every rank has connected, up to `timeout_seconds`. kInvalidArgument for a bad
// rank/size, kInternal when the group cannot form.
absl::StatusOr<std::unique_ptr<Collectives>> ConnectGloo(const std::string& store_path, int rank,
                                                         int size, double timeout_seconds = 60);
// The same with `groups` independent process groups over the one rendezvous (each under a
// prefix of its own), for collectives that run at the same time on different threads: group 0
// trains, group 1 carries the node's background communication of overlapped rounds. Each group
// must be used by one thread at a time.
absl::StatusOr<std::vector<std::unique_ptr<Collectives>>> ConnectGlooGroups(
    const std::string& store_path, int rank, int size, int groups, double timeout_seconds = 60);
// The process groups of a node's rank, as ConnectGlooGroups, with group 0 (the trainer's) over
// NCCL when the training device (SetTrainerDevice) is a GPU; the other groups stay Gloo (they
// carry small host messages). kFailedPrecondition for a GPU device when this LibTorch has no
// NCCL.
absl::StatusOr<std::vector<std::unique_ptr<Collectives>>> ConnectNodeGroups(
    const std::string& store_path, int rank, int size, int groups, double timeout_seconds = 60);

// How spec layers are cut into per-rank slices (common/model_spec.h SliceRange): layer l of n_l
// elements has slices of ceil(n_l / N) elements; rank r owns [r * slice, min((r + 1) * slice,
// n_l)).
struct ShardLayout {
  ShardLayout(const v1::ModelSpec& spec, int num_ranks, int rank);
  size_t slice(int layer) const { return slice_[layer]; }  // padded slice length
  size_t begin(int layer) const;                           // first owned element
  size_t end(int layer) const;                             // one past the last owned element
  size_t owned(int layer) const { return end(layer) - begin(layer); }
  size_t total_owned() const;  // elements this rank owns over all layers

  int num_ranks;
  int rank;

 private:
  std::vector<size_t> slice_;
  std::vector<size_t> elements_;
};

// A TrainerInterface over this rank's slices: SetParameters, PseudoGradient and Train are the
// *Shards forms below and collectives (every rank calls them together).
class FsdpTrainer final : public TrainerInterface {
 public:
  // As LocalTrainer::Create, over `collectives` (which must outlive the trainer); every rank
  // calls it with the same arguments. inner.batch_size is the node's batch per step and must be
  // a multiple of the number of ranks (kInvalidArgument otherwise). Each rank keeps only its
  // slices of the initial parameters InitializeParameters(spec, seed).
  static absl::StatusOr<std::unique_ptr<FsdpTrainer>> Create(const v1::TransformerConfig& model,
                                                             const v1::InnerOptimizerConfig& inner,
                                                             const v1::ModelSpec& spec,
                                                             uint64_t seed,
                                                             Collectives& collectives);
  // As LocalTrainer::CreateForScript (a bring-your-own TorchScript model; every rank loads the
  // same file), over `collectives`. Each rank keeps only its slices of the module's parameters.
  // kInvalidArgument as Create; kFailedPrecondition when the module is not the spec's
  // (ParametersInSpecOrder).
  static absl::StatusOr<std::unique_ptr<FsdpTrainer>> CreateForScript(
      ScriptModelPtr model, uint32_t vocab_size, uint32_t seq_len,
      const v1::InnerOptimizerConfig& inner, const v1::ModelSpec& spec, Collectives& collectives);
  ~FsdpTrainer() override;
  FsdpTrainer(const FsdpTrainer&) = delete;
  FsdpTrainer& operator=(const FsdpTrainer&) = delete;

  const ShardLayout& layout() const;

  // This rank's slices of the parameters: shards[l] holds layout().owned(l) elements.
  // kInvalidArgument on a wrong layer count or slice size (nothing changed then).
  absl::Status SetParameterShards(const std::vector<std::vector<float>>& shards);
  absl::Status GetParameterShards(std::vector<std::vector<float>>* shards) const;
  // out[l] = base[l] - current slice of layer l (base: this rank's slices of theta_base).
  absl::Status PseudoGradientShards(const std::vector<std::vector<float>>& base,
                                    std::vector<std::vector<float>>* out) const;
  // TrainerInterface: SetParameterShards, PseudoGradientShards and Train on *request.data
  // (kInvalidArgument when it is null or request.slowdown is not 1). A node does not evaluate:
  // Evaluate is kFailedPrecondition.
  absl::Status SetParameters(const std::vector<std::vector<float>>& shards) override;
  absl::Status PseudoGradient(const std::vector<std::vector<float>>& base,
                              std::vector<std::vector<float>>* out) const override;
  absl::StatusOr<TrainStats> Train(const TrainRequest& request) override;
  absl::StatusOr<double> Evaluate(const EvalRequest& request) override;

  // The moments of this rank's owned slices (InnerState per layer: owned(l) elements).
  absl::StatusOr<InnerState> SaveInnerState() const override;
  absl::Status RestoreInnerState(const InnerState& state) override;

  // The whole model, gathered from every rank (a collective: every rank must call it). For
  // evaluation and tests.
  absl::Status GatherParameters(std::vector<std::vector<float>>* layers);

  // LocalTrainer::Train over the node (a collective). The round's step count is the same on
  // every rank: with a time budget or an interrupt the ranks agree (all-reduce) after each step
  // whether any of them wants to stop. mean_loss is the node's mean; tokens count the node's
  // whole batch.
  absl::StatusOr<TrainStats> Train(const TokenSource& data, uint32_t steps, uint64_t lr_step,
                                   uint64_t seed, double time_budget_seconds = 0,
                                   const std::atomic<bool>* interrupt = nullptr);

  // AdamW state elements (m and v) held by this rank: 2 * layout().total_owned().
  size_t optimizer_state_elements() const;
  // AdamW steps taken.
  uint64_t optimizer_steps() const;

 private:
  struct Impl;
  explicit FsdpTrainer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The trainer a join reply asks for: an FsdpTrainer over `node` (a rank of a multi-rank node),
// else a LocalTrainer; of `script` when it is not null (a bring-your-own model), else of the
// built-in transformer. A LocalTrainer replays `step_slowdowns` when given; a rank of a node
// refuses them (kInvalidArgument). Otherwise errors as the Create functions.
absl::StatusOr<std::unique_ptr<TrainerInterface>> TrainerFor(
    const v1::JoinReply& joined, ScriptModelPtr script, Collectives* node,
    std::optional<StepSlowdowns> step_slowdowns = std::nullopt);

}  // namespace aloe::worker
