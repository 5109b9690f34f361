#include "worker/trainer.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <map>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/lr_schedule.h"
#include "common/model_spec.h"
#include "common/status_macros.h"
#include "worker/inner_adamw.h"
#include "worker/script_model.h"
#include "worker/step_graph.h"
#include "worker/tensor_round_boundary.h"
#include "worker/torch_util.h"
#include "worker/transformer.h"

namespace aloe::worker {
namespace {

std::atomic<int> g_trainer_threads{1};
std::atomic<bool> g_autocast_bf16{false};
std::atomic<bool> g_cuda_graphs{true};
std::atomic<int> g_device_index{-1};  // -1: the CPU; else the CUDA device's index

}  // namespace

int VisibleGpus() {
  try {
    return torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  } catch (const std::exception&) {
    return 0;
  }
}

absl::StatusOr<std::string> SetTrainerDevice(const std::string& device) {
  int index = -1;
  if (device == "cpu") {
    index = -1;
  } else if (device == "auto") {
    index = VisibleGpus() > 0 ? 0 : -1;
  } else if (device == "cuda") {
    index = 0;
  } else if (!absl::StartsWith(device, "cuda:") ||
             !absl::SimpleAtoi(absl::string_view(device).substr(5), &index) || index < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("device must be cpu, cuda, cuda:I or auto, got \"%s\"", device));
  }
  if (index >= 0) {
    const int gpus = VisibleGpus();
    if (gpus == 0) {
#if defined(ALOE_WITH_TORCH_CUDA)
      return absl::FailedPreconditionError(absl::StrFormat(
          "device %s: LibTorch sees no CUDA GPU (check the driver and CUDA_VISIBLE_DEVICES)",
          device));
#else
      return absl::FailedPreconditionError(absl::StrFormat(
          "device %s: this build of ALOE links a CPU-only LibTorch; build it against a CUDA "
          "LibTorch (README: GPU workers)",
          device));
#endif
    }
    if (index >= gpus) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "device cuda:%d: LibTorch sees %d GPU(s), cuda:0 to cuda:%d", index, gpus, gpus - 1));
    }
    try {
      // The current device of the process: CUDA streams and the NCCL group follow it.
      c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
          ->setDevice(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index)));
    } catch (const std::exception& e) {
      return absl::FailedPreconditionError(
          absl::StrCat("device ", device, ": ", LibTorchError("selecting the GPU", e).message()));
    }
  }
  g_device_index.store(index, std::memory_order_relaxed);
  return TrainerDevice();
}

std::string TrainerDevice() {
  const int index = g_device_index.load(std::memory_order_relaxed);
  return index < 0 ? std::string("cpu") : absl::StrCat("cuda:", index);
}

torch::Device TrainingDevice() {
  const int index = g_device_index.load(std::memory_order_relaxed);
  if (index < 0) return torch::Device(torch::kCPU);
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

void ApplyTrainerThreads() {
  const int want = g_trainer_threads.load(std::memory_order_relaxed);
  if (torch::get_num_threads() != want) torch::set_num_threads(want);
  // Once per thread and pool size: a pool that grew has threads without the setting.
  thread_local int flushed_for = 0;
  if (flushed_for != want) {
    FlushDenormals();
    flushed_for = want;
  }
}

void SetTrainerThreads(int num_threads) {
  g_trainer_threads.store(std::max(num_threads, 1), std::memory_order_relaxed);
}

int TrainerThreads() { return g_trainer_threads.load(std::memory_order_relaxed); }

void SetTrainerAutocastBf16(bool on) { g_autocast_bf16.store(on, std::memory_order_relaxed); }

bool TrainerAutocastBf16() { return g_autocast_bf16.load(std::memory_order_relaxed); }

void SetTrainerCudaGraphs(bool on) { g_cuda_graphs.store(on, std::memory_order_relaxed); }

bool TrainerCudaGraphs() { return g_cuda_graphs.load(std::memory_order_relaxed); }

void ConfigureAllocatorForTraining() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's maximum on 64-bit
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
#endif
}

void ScriptModelDeleter::operator()(ScriptModel* model) const { delete model; }

absl::StatusOr<ScriptModelPtr> OpenScriptModel(const std::string& path, std::string* fingerprint) {
  fingerprint->clear();
  if (path.empty()) return nullptr;
  ALOE_ASSIGN_OR_RETURN(std::unique_ptr<ScriptModel> model, LoadScriptModel(path));
  *fingerprint = model->architecture.fingerprint();
  return ScriptModelPtr(model.release());
}

struct LocalTrainer::Impl {
  v1::TransformerConfig model_config;  // for a TorchScript model: vocab_size and seq_len only
  v1::InnerOptimizerConfig inner;
  v1::ModelSpec spec;
  TransformerLM model{nullptr};       // the built-in transformer, or
  ScriptModelPtr script;              // a bring-your-own TorchScript model
  torch::Device device{torch::kCPU};  // where parameters, activations and AdamW state live
  std::vector<torch::Tensor> params;  // model parameters in spec order
  std::unique_ptr<InnerAdamW> optimizer;
  std::unique_ptr<TensorRoundBoundary> boundary;  // made at the first device_round_boundary()
  bool boundary_failed = false;
  // A GPU's steps through one CUDA graph: considered at the first step (Graphed()), null where
  // steps run eagerly.
  std::unique_ptr<GraphedSteps> graphed;
  bool graphs_decided = false;

  // Clears the gradients, takes the loss of `batch` (the forward pass under --autocast) and its
  // gradients, and returns the loss; *clip becomes GradClipFactor's tensor (undefined without
  // a clip). The AdamW step is the caller's: eager, or launched inside a graph.
  torch::Tensor LossAndGradients(const torch::Tensor& batch, torch::Tensor* clip) {
    optimizer->ZeroGrad();
    torch::Tensor loss;
    {
      TrainingAutocast autocast;  // --autocast bf16: the forward pass only
      loss = Loss(batch);
    }
    loss.backward();
    const double max_norm = inner.grad_clip();
    *clip = max_norm > 0 ? GradClipFactor(params, max_norm) : torch::Tensor();
    return loss;
  }

  // The graph of the built-in transformer's step on a GPU, or null where steps run eagerly.
  GraphedSteps* Graphed() {
    if (!graphs_decided) {
      graphs_decided = true;
      if (device.is_cuda() && !script && TrainerCudaGraphs() && CudaGraphsAvailable() &&
          optimizer->capturable()) {
        try {
          graphed = std::make_unique<GraphedSteps>(
              optimizer.get(), device, [this](const torch::Tensor& batch) {
                torch::Tensor clip;
                torch::Tensor loss = LossAndGradients(batch, &clip);
                optimizer->LaunchStep(clip);
                return loss;
              });
        } catch (const std::exception& e) {
          ALOE_LOG_WARNING("worker", "the inner step runs without a CUDA graph: %s", e.what());
        }
      }
    }
    return graphed.get();
  }

  // Mean cross-entropy of predicting batch[:, 1:] from batch[:, :-1].
  torch::Tensor Loss(const torch::Tensor& batch) {
    return script ? ScriptLoss(*script, batch, model_config.vocab_size()) : model->Loss(batch);
  }
  void SetTraining(bool on) {
    if (script) {
      script->module.train(on);
    } else {
      model->train(on);
    }
  }
  // AdamW over `params`: GPT-style decoupled weight decay on matrices only; biases and
  // LayerNorm gains/shifts are not decayed towards zero.
  absl::Status MakeOptimizer() {
    try {
      std::vector<bool> decay;
      for (const torch::Tensor& p : params) decay.push_back(p.dim() >= 2);
      optimizer =
          std::make_unique<InnerAdamW>(params, std::move(decay), inner, DefaultAdamWKernel(device));
    } catch (const std::exception& e) {
      return LibTorchError("creating AdamW", e);
    }
    return absl::OkStatus();
  }
};

LocalTrainer::LocalTrainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LocalTrainer::~LocalTrainer() = default;

const v1::ModelSpec& LocalTrainer::spec() const { return impl_->spec; }

absl::StatusOr<std::unique_ptr<LocalTrainer>> LocalTrainer::Create(
    const v1::TransformerConfig& model, const v1::InnerOptimizerConfig& inner,
    const v1::ModelSpec& spec, uint64_t seed) {
  ALOE_RETURN_IF_ERROR(ValidateTransformerConfig(model));
  ALOE_RETURN_IF_ERROR(ValidateInnerOptimizerConfig(inner));
  auto impl = std::make_unique<Impl>();
  impl->model_config = model;
  impl->inner = inner;
  impl->spec = spec;
  try {
    ApplyTrainerThreads();
    impl->model = TransformerLM(model);
  } catch (const std::exception& e) {
    return LibTorchError("building the model", e);
  }
  ALOE_RETURN_IF_ERROR(CheckParametersMatchSpec(*impl->model, spec));
  ALOE_RETURN_IF_ERROR(LoadParameters(InitializeParameters(spec, seed), spec, *impl->model));
  impl->device = TrainingDevice();
  ALOE_RETURN_IF_ERROR(CheckAttentionKernelRuns(model, impl->device));
  try {
    impl->model->to(impl->device);
  } catch (const std::exception& e) {
    return LibTorchError("moving the model to the training device", e);
  }
  impl->params = impl->model->parameters();
  ALOE_RETURN_IF_ERROR(impl->MakeOptimizer());
  return std::unique_ptr<LocalTrainer>(new LocalTrainer(std::move(impl)));
}

absl::StatusOr<std::unique_ptr<LocalTrainer>> LocalTrainer::CreateForScript(
    ScriptModelPtr model, uint32_t vocab_size, uint32_t seq_len,
    const v1::InnerOptimizerConfig& inner, const v1::ModelSpec& spec) {
  ALOE_RETURN_IF_ERROR(ValidateInnerOptimizerConfig(inner));
  auto impl = std::make_unique<Impl>();
  ALOE_ASSIGN_OR_RETURN(impl->model_config, ScriptDataShape(vocab_size, seq_len));
  impl->inner = inner;
  impl->spec = spec;
  impl->device = TrainingDevice();
  ALOE_RETURN_IF_ERROR(MoveScriptModel(*model, impl->device));
  ALOE_ASSIGN_OR_RETURN(impl->params, ParametersInSpecOrder(*model, spec));
  impl->script = std::move(model);
  ALOE_RETURN_IF_ERROR(impl->MakeOptimizer());
  return std::unique_ptr<LocalTrainer>(new LocalTrainer(std::move(impl)));
}

absl::Status LocalTrainer::SetParameters(const std::vector<std::vector<float>>& layers) {
  return CopyLayersIntoParameters(layers, impl_->spec, impl_->params);
}

absl::Status LocalTrainer::GetParameters(std::vector<std::vector<float>>* layers) const {
  return CopyParametersIntoLayers(impl_->params, impl_->spec, layers);
}

absl::Status LocalTrainer::GetLayers(absl::Span<const uint32_t> ids,
                                     std::vector<std::vector<float>>* layers) const {
  if (ids.empty()) return absl::OkStatus();
  return CopyParametersIntoLayers(impl_->params, impl_->spec, layers, ids);
}

absl::Status LocalTrainer::SetLayers(absl::Span<const uint32_t> ids,
                                     const std::vector<std::vector<float>>& layers) {
  if (ids.empty()) return absl::OkStatus();
  return CopyLayersIntoParameters(layers, impl_->spec, impl_->params, ids);
}

absl::Status LocalTrainer::PseudoGradient(const std::vector<std::vector<float>>& base,
                                          std::vector<std::vector<float>>* out) const {
  ApplyTrainerThreads();
  return PseudoGradientOfParameters(impl_->params, impl_->spec, base, out);
}

RoundBoundary* LocalTrainer::device_round_boundary() {
  if (impl_->boundary == nullptr && !impl_->boundary_failed) {
    absl::StatusOr<std::unique_ptr<TensorRoundBoundary>> made =
        TensorRoundBoundary::Create(impl_->params, impl_->spec);
    if (made.ok()) {
      impl_->boundary = *std::move(made);
    } else {
      impl_->boundary_failed = true;
      ALOE_LOG_WARNING("worker", "the round boundary stays on the host: %s",
                       made.status().message());
    }
  }
  return impl_->boundary.get();
}

bool LocalTrainer::replays_cuda_graph() const {
  return impl_->graphed != nullptr && impl_->graphed->replaying();
}

void LocalTrainer::SetStepSlowdowns(StepSlowdowns slowdowns) {
  step_slowdowns_ = std::move(slowdowns);
}

absl::StatusOr<TrainStats> LocalTrainer::Train(const TrainRequest& request) {
  if (request.data == nullptr) return absl::InvalidArgumentError("no training data");
  return Train(*request.data, request.steps, request.lr_step, request.seed, request.slowdown,
               request.time_budget_seconds, request.interrupt);
}

absl::StatusOr<double> LocalTrainer::Evaluate(const EvalRequest& request) {
  if (request.heldout == nullptr) return absl::InvalidArgumentError("no held-out data");
  return Evaluate(*request.heldout, request.max_sequences);
}

absl::StatusOr<InnerState> LocalTrainer::SaveInnerState() const {
  InnerState state;
  try {
    const InnerAdamW& adam = *impl_->optimizer;
    std::vector<torch::Tensor> first, second;  // spec order, like params
    for (size_t i = 0; i < adam.size(); ++i) {
      state.steps = std::max<uint64_t>(state.steps, static_cast<uint64_t>(adam.steps(i)));
      first.push_back(adam.exp_avg(i));
      second.push_back(adam.exp_avg_sq(i));
    }
    ALOE_RETURN_IF_ERROR(CopyParametersIntoLayers(first, impl_->spec, &state.first));
    ALOE_RETURN_IF_ERROR(CopyParametersIntoLayers(second, impl_->spec, &state.second));
  } catch (const std::exception& e) {
    return LibTorchError("saving the AdamW state", e);
  }
  return state;
}

absl::Status LocalTrainer::RestoreInnerState(const InnerState& state) {
  ALOE_RETURN_IF_ERROR(CheckLayerSizes(state.first, impl_->spec));
  ALOE_RETURN_IF_ERROR(CheckLayerSizes(state.second, impl_->spec));
  try {
    std::vector<torch::Tensor> first, second;
    for (const torch::Tensor& p : impl_->params) {
      first.push_back(torch::zeros_like(p, torch::MemoryFormat::Contiguous));
      second.push_back(torch::zeros_like(p, torch::MemoryFormat::Contiguous));
    }
    ALOE_RETURN_IF_ERROR(CopyLayersIntoParameters(state.first, impl_->spec, first));
    ALOE_RETURN_IF_ERROR(CopyLayersIntoParameters(state.second, impl_->spec, second));
    impl_->optimizer->Restore(static_cast<int64_t>(state.steps), first, second);
  } catch (const std::exception& e) {
    return LibTorchError("restoring the AdamW state", e);
  }
  return absl::OkStatus();
}

absl::StatusOr<TrainStats> LocalTrainer::Train(const TokenSource& data, uint32_t steps,
                                               uint64_t lr_step, uint64_t seed, double slowdown,
                                               double time_budget_seconds,
                                               const std::atomic<bool>* interrupt) {
  if (!(time_budget_seconds >= 0) || !std::isfinite(time_budget_seconds)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("time budget must be a finite number >= 0, got %g", time_budget_seconds));
  }
  if (!(slowdown >= 1.0) || !std::isfinite(slowdown)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("slowdown must be a finite number >= 1, got %g", slowdown));
  }
  const int64_t seq_len = impl_->model_config.seq_len();
  const int64_t window = seq_len + 1;
  const uint32_t batch_size = impl_->inner.batch_size();
  const uint64_t n = data.num_tokens();
  if (n < static_cast<uint64_t>(window)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "training data has %d tokens, fewer than one window of seq_len + 1 = %d", n, window));
  }
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<uint64_t> start_dist(0, n - window);
  std::vector<uint64_t> starts(batch_size);
  TrainStats stats;
  double loss_sum = 0;
  // On a GPU the host queues steps ahead of the device and reads the losses back once, at the
  // round's end, unless each step must be timed on its own (a slowdown to emulate, a time
  // budget to stop at): then every step ends with the device idle, as on the CPU.
  const bool time_each_step = !impl_->device.is_cuda() || slowdown > 1.0 ||
                              time_budget_seconds > 0 || step_slowdowns_.has_value();
  try {
    ApplyTrainerThreads();
    impl_->SetTraining(true);
    const auto round_start = std::chrono::steady_clock::now();
    torch::Tensor queued_loss_sum;  // float64 on the device, without time_each_step
    for (uint32_t i = 0; i < steps; ++i) {
      if (interrupt != nullptr && interrupt->load()) break;
      const auto t0 = std::chrono::steady_clock::now();
      for (uint64_t& s : starts) s = start_dist(rng);
      ALOE_ASSIGN_OR_RETURN(torch::Tensor batch,
                            ReadBatch(data, starts, window, impl_->model_config.vocab_size()));
      const double lr = InnerLearningRate(impl_->inner, lr_step + i);  // paper 002 Eq. 3
      torch::Tensor loss;
      if (GraphedSteps* graphed = impl_->Graphed()) {
        loss = graphed->Step(batch, lr);
      } else {
        torch::Tensor clip;
        loss = impl_->LossAndGradients(BatchOnDevice(batch, impl_->device), &clip);
        impl_->optimizer->Step(lr, clip);
      }
      ++stats.steps;
      if (!time_each_step) {
        const torch::Tensor step_loss = loss.detach().to(torch::kFloat64);
        queued_loss_sum = queued_loss_sum.defined() ? queued_loss_sum + step_loss : step_loss;
        continue;
      }
      loss_sum += loss.item<double>();
      const double step_seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      stats.compute_seconds += step_seconds;
      const double factor =
          slowdown * (step_slowdowns_.has_value() ? step_slowdowns_->Next() : 1.0);
      if (factor > 1.0) {
        std::this_thread::sleep_for(std::chrono::duration<double>((factor - 1.0) * step_seconds));
      }
      // A-EDiT (paper 000 Sec. 3.3): stop at the first step end at or after the budget.
      if (time_budget_seconds > 0 &&
          std::chrono::duration<double>(std::chrono::steady_clock::now() - round_start).count() >=
              time_budget_seconds) {
        break;
      }
    }
    if (!time_each_step) {
      // Waits for the queued steps: the round's compute time is the whole loop's.
      if (queued_loss_sum.defined()) loss_sum = queued_loss_sum.item<double>();
      stats.compute_seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - round_start).count();
    }
  } catch (const std::exception& e) {
    return LibTorchError("training step", e);
  }
  stats.tokens = static_cast<uint64_t>(stats.steps) * batch_size * seq_len;
  stats.mean_loss = stats.steps > 0 ? loss_sum / stats.steps : 0.0;
  return stats;
}

absl::StatusOr<double> LocalTrainer::Evaluate(const TokenSource& heldout, uint32_t max_sequences) {
  const int64_t seq_len = impl_->model_config.seq_len();
  const uint64_t window = seq_len + 1;
  const uint64_t windows = std::min<uint64_t>(max_sequences, heldout.num_tokens() / window);
  if (windows == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "evaluation needs max_sequences >= 1 and at least seq_len + 1 = %d tokens; got "
        "max_sequences %d and %d tokens",
        window, max_sequences, heldout.num_tokens()));
  }
  const uint64_t batch_size = impl_->inner.batch_size();
  double loss_sum = 0;  // summed per-token loss
  try {
    ApplyTrainerThreads();
    torch::NoGradGuard no_grad;
    impl_->SetTraining(false);
    std::vector<uint64_t> starts;
    for (uint64_t first = 0; first < windows; first += batch_size) {
      const uint64_t rows = std::min(batch_size, windows - first);
      starts.resize(rows);
      for (uint64_t r = 0; r < rows; ++r) starts[r] = (first + r) * window;
      ALOE_ASSIGN_OR_RETURN(torch::Tensor batch,
                            ReadBatch(heldout, starts, window, impl_->model_config.vocab_size()));
      batch = BatchOnDevice(batch, impl_->device);
      loss_sum += impl_->Loss(batch).item<double>() * static_cast<double>(rows * seq_len);
    }
  } catch (const std::exception& e) {
    return LibTorchError("evaluation", e);
  }
  return loss_sum / static_cast<double>(windows * seq_len);
}

}  // namespace aloe::worker
