// LocalTrainer: the inner loop of a single-process DiLoCo worker (paper 002 Alg. 1, inner part),
// a TrainerInterface (common/trainer_interface.h). It holds one replica of the transformer LM
// (worker/transformer.h) or of a TorchScript model and its AdamW inner optimizer. The AdamW
// moments stay on the worker across rounds: never sent, never reset (docs/algorithms.md).
//
// LibTorch stays out of this header (pimpl): including it costs no <torch/torch.h>. Every
// LibTorch exception is caught inside and returned as kInternal.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/step_times.h"
#include "common/token_source.h"
#include "common/trainer_interface.h"
#include "proto/aloe.pb.h"

namespace aloe::worker {

struct ScriptModel;  // worker/script_model.h

// Owns a bring-your-own TorchScript model in code that does not include LibTorch's headers.
struct ScriptModelDeleter {
  void operator()(ScriptModel* model) const;
};
using ScriptModelPtr = std::unique_ptr<ScriptModel, ScriptModelDeleter>;

// LoadScriptModel (worker/script_model.h, same errors) for code without LibTorch's headers;
// sets *fingerprint to the module's architecture fingerprint (common/imported_model.h). An
// empty path is no model: null, and "" as the fingerprint (the built-in transformer).
absl::StatusOr<ScriptModelPtr> OpenScriptModel(const std::string& path, std::string* fingerprint);

// Sets the number of intra-op threads LibTorch (and an OpenMP BLAS) uses for training and
// evaluation in this process; LocalTrainer applies it on the thread that calls Train/Evaluate.
// Default 1: one single-threaded worker process per core is fastest on CPU
// (docs/architecture.md).
// Values < 1 are treated as 1. Thread-safe.
void SetTrainerThreads(int num_threads);
int TrainerThreads();

// Mixed precision of the inner loop in this process (aloe-worker --autocast bf16): the forward
// pass and the loss run under LibTorch's autocast with bfloat16 (matrix products in bf16, what
// autocast keeps in float32 stays so), while parameters, gradients, AdamW state and
// pseudo-gradients stay float32. Off by default. Applies to LocalTrainer and FsdpTrainer
// training steps (not evaluation). Thread-safe.
void SetTrainerAutocastBf16(bool on);
bool TrainerAutocastBf16();

// Whether the built-in transformer's inner step runs as one CUDA graph on a GPU (aloe-worker
// --cuda_graphs, worker/step_graph.h): captured after 3 eager steps, then replayed, one launch
// a step instead of one per kernel. Needs a CUDA LibTorch >= 2.3 (CudaGraphsAvailable); a
// TorchScript model, the CPU and FsdpTrainer always step eagerly. On by default; the same
// arithmetic either way. Read when a trainer takes its first GPU step. Thread-safe.
void SetTrainerCudaGraphs(bool on);
bool TrainerCudaGraphs();

// The kernels behind LibTorch 2.x's fused attention (scaled_dot_product_attention), as
// aloe-worker --attention names them: auto (LibTorch picks among all, in its own order: on a GPU
// FlashAttention first where it applies), flash (FlashAttention; also on the CPU), cudnn
// (cuDNN's fused attention; GPU, LibTorch >= 2.4), efficient (the memory-efficient kernel; GPU)
// and math (the unfused reference: scores, softmax, weighted sum). All compute the same function
// up to rounding. Implemented in worker/transformer.cc, which holds the attention.
enum class AttentionKernel { kAuto, kFlash, kCudnn, kEfficient, kMath };

// kInvalidArgument naming the choices for another name.
absl::StatusOr<AttentionKernel> ParseAttentionKernel(const std::string& name);
const char* AttentionKernelName(AttentionKernel kernel);

// Lets the built-in transformer's attention use `kernel` alone in this process (LibTorch's
// global context; kAuto enables every kernel again). kFailedPrecondition, nothing changed, where
// this LibTorch has no such kernel (1.13 runs the unfused form: only auto and math) or the
// training device cannot run it (cudnn and efficient need a GPU): call after SetTrainerDevice.
// Trainers check at creation that the kernel takes their model (CheckAttentionKernelRuns,
// worker/transformer.h). Not thread-safe with training.
absl::Status SetAttentionKernel(AttentionKernel kernel);
AttentionKernel CurrentAttentionKernel();

// The device the inner loop of this process trains on (aloe-worker --device):
//   "cpu"; "cuda" (GPU 0) or "cuda:I" (GPU I); "auto": GPU 0 when LibTorch sees a GPU, else cpu.
// The model's parameters, activations and gradients and the AdamW state live there (FsdpTrainer:
// its parameter, gradient and moment slices too); pulled parameters and pushed pseudo-gradients
// pass through host memory. Returns the device chosen ("cpu" or "cuda:I"). kInvalidArgument for
// another string; kFailedPrecondition for a GPU that this LibTorch build (CPU-only builds have
// none) or this machine does not have. Call before creating trainers; not thread-safe with
// training. Default "cpu".
absl::StatusOr<std::string> SetTrainerDevice(const std::string& device);
std::string TrainerDevice();
// The GPUs LibTorch sees in this process (0 with a CPU-only LibTorch).
int VisibleGpus();

// Keeps the training step's large temporaries (activations, gradients: up to a few MiB each)
// in the malloc heap instead of fresh mmap'ed pages: sets glibc's mmap threshold to 32 MiB and
// the trim threshold to 256 MiB. Without it every step page-faults and zero-fills its
// temporaries again (~10% of a CPU step on the demo model). Process-wide: call once from main()
// before training. No-op on non-glibc platforms. (aloe-worker also applies the same settings
// to every thread's arena with KeepLargeBuffersInHeap, common/allocator.h.)
void ConfigureAllocatorForTraining();

// Not thread-safe: one caller at a time (the worker's round loop).
class LocalTrainer final : public TrainerInterface {
 public:
  // Builds the model for `model` (which must pass ValidateTransformerConfig) and checks that
  // its parameters are exactly the tensors of `spec` (kFailedPrecondition naming the first
  // mismatch otherwise). Initialises the parameters with InitializeParameters(spec, seed).
  // `inner` must pass ValidateInnerOptimizerConfig (kInvalidArgument otherwise). AdamW uses
  // betas (beta1, beta2), eps and weight_decay from `inner`; weight decay applies to the
  // matrices (embeddings, linear weights) only, not to biases and LayerNorm parameters.
  static absl::StatusOr<std::unique_ptr<LocalTrainer>> Create(const v1::TransformerConfig& model,
                                                              const v1::InnerOptimizerConfig& inner,
                                                              const v1::ModelSpec& spec,
                                                              uint64_t seed);

  // A trainer for a bring-your-own TorchScript model (worker/script_model.h) on data of
  // `vocab_size` token ids in windows of seq_len + 1 tokens. The module's parameters must be
  // exactly the tensors of `spec` (matched by name, any order; kFailedPrecondition naming the
  // first mismatch). The module keeps its own parameter values until SetParameters (the server's
  // version 0 of an imported model is those same values). AdamW as in Create.
  static absl::StatusOr<std::unique_ptr<LocalTrainer>> CreateForScript(
      ScriptModelPtr model, uint32_t vocab_size, uint32_t seq_len,
      const v1::InnerOptimizerConfig& inner, const v1::ModelSpec& spec);

  ~LocalTrainer() override;
  LocalTrainer(const LocalTrainer&) = delete;
  LocalTrainer& operator=(const LocalTrainer&) = delete;

  // Copies the global parameters (one flat float32 buffer per spec layer) into the model.
  // The AdamW state is left untouched. kInvalidArgument on a wrong layer count or layer size
  // (the model is then unchanged).
  absl::Status SetParameters(const std::vector<std::vector<float>>& layers) override;

  // Copies the model's parameters out, one flat buffer per spec layer (resizes `layers`).
  absl::Status GetParameters(std::vector<std::vector<float>>* layers) const;
  // Only the layers `ids` (TrainerInterface): their tensors alone are copied.
  absl::Status GetLayers(absl::Span<const uint32_t> ids,
                         std::vector<std::vector<float>>* layers) const override;
  absl::Status SetLayers(absl::Span<const uint32_t> ids,
                         const std::vector<std::vector<float>>& layers) override;

  // out[l][i] = base[l][i] - current[l][i] in float32 (the DiLoCo pseudo-gradient sign: the
  // outer optimizer descends along it). kInvalidArgument when `base` does not fit the spec.
  absl::Status PseudoGradient(const std::vector<std::vector<float>>& base,
                              std::vector<std::vector<float>>* out) const override;

  // Train below on *request.data (kInvalidArgument when it is null). Tokens learned are
  // steps * batch_size * seq_len.
  absl::StatusOr<TrainStats> Train(const TrainRequest& request) override;
  // Evaluate below on *request.heldout (kInvalidArgument when it is null).
  absl::StatusOr<double> Evaluate(const EvalRequest& request) override;

  // The AdamW moments of every parameter, per spec layer; steps is the most steps any parameter
  // has taken (a parameter that had no gradient in some steps restores with that count).
  // Parameters that have not stepped yet give zeros.
  absl::StatusOr<InnerState> SaveInnerState() const override;
  absl::Status RestoreInnerState(const InnerState& state) override;

  // Runs `steps` AdamW steps on `data`. Step i (0-based):
  //   - samples batch_size windows of seq_len + 1 tokens, starts uniform in
  //     [0, num_tokens - seq_len - 1], from a std::mt19937_64 seeded with `seed`;
  //   - sets the lr of every parameter group to InnerLearningRate(inner, lr_step + i)
  //     (paper 002 Eq. 3; lr_step is the data shard's schedule position);
  //   - forward, mean cross-entropy, backward, global grad-norm clip to grad_clip (if > 0),
  //     AdamW step (worker/inner_adamw.h).
  // On a GPU the step is replayed as a CUDA graph from its 4th step on (SetTrainerCudaGraphs).
  // On a GPU the host queues the steps without waiting for each (compute_seconds is then the
  // round's wall time up to the device finishing its last step), except with a slowdown, a step
  // trace or a time budget, which time every step.
  // `slowdown` >= 1 emulates slower hardware: after each step the trainer sleeps
  // (slowdown - 1) x that step's compute time (not counted in compute_seconds).
  // `time_budget_seconds` > 0 (A-EDiT, paper 000 Sec. 3.3) ends the round at the first step end
  // at or after that much wall time (sleeps included); `steps` is then the cap.
  // `interrupt` (may be null; e.g. set by a SIGTERM handler) ends the round at the first step
  // end after it becomes true, so a worker that is asked to stop can push the steps it has
  // done; no step is taken when it is already true.
  // Errors: kInvalidArgument when data has fewer than seq_len + 1 tokens, a sampled token is
  // >= vocab_size (steps before it have already been applied), or slowdown is not finite >= 1;
  // kInternal on a LibTorch error.
  absl::StatusOr<TrainStats> Train(const TokenSource& data, uint32_t steps, uint64_t lr_step,
                                   uint64_t seed, double slowdown = 1.0,
                                   double time_budget_seconds = 0,
                                   const std::atomic<bool>* interrupt = nullptr);

  // Mean per-token cross-entropy (nats) over the first min(max_sequences,
  // num_tokens / (seq_len + 1)) non-overlapping windows of seq_len + 1 tokens of `heldout`,
  // evaluated without gradients in batches of batch_size. Deterministic. Does not change the
  // parameters or the optimizer state. kInvalidArgument when no window fits, max_sequences is 0
  // or a token is >= vocab_size; kInternal on a LibTorch error.
  absl::StatusOr<double> Evaluate(const TokenSource& heldout, uint32_t max_sequences);

  const v1::ModelSpec& spec() const;

  // A TensorRoundBoundary (worker/tensor_round_boundary.h) over this trainer's parameters,
  // made at the first call (three more copies of the parameters on the training device, two
  // page-locked host copies on a GPU); null, with the reason logged, when it cannot be made
  // (e.g. a TorchScript model with parameters that are not contiguous float32).
  RoundBoundary* device_round_boundary() override;

  // Whether this trainer's steps now replay a CUDA graph (SetTrainerCudaGraphs): false on the
  // CPU, before the capture and after a failed one.
  bool replays_cuda_graph() const;

  // Replays a step-time trace (aloe-worker --step_trace): from now on every step is slowed by
  // the trace's next factor, on top of `slowdown` (the two multiply). The cycle continues
  // across rounds.
  void SetStepSlowdowns(StepSlowdowns slowdowns);

 private:
  struct Impl;
  explicit LocalTrainer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  std::optional<StepSlowdowns> step_slowdowns_;
};

}  // namespace aloe::worker
